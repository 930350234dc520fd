"""The step's token -> adapter layout, built once per step on the host in numpy.

Every LoRA layer of a step needs the same facts: which adapter each token uses and how
the tokens group by adapter. They depend only on the scheduled requests, which the host
knows before the step starts, so they are computed here once, in numpy, and uploaded
with the other step inputs: no layer sorts tokens on the device, and the graph's shapes
depend only on the buckets (T tokens, S adapter slots) and the token block B.

Segment layout (for S >= 2): tokens sorted by adapter (stable), each adapter's run padded
to a multiple of B rows, so every block of B rows belongs to one adapter:
  perm        int32 [T_pad]   token feeding each row (padding rows repeat token 0)
  dest        int32 [T]       row of each token (tokens without an adapter: row 0)
  token_valid bool  [T]       the token uses an adapter
  row_valid   bool  [T_pad]   the row holds a token that uses an adapter
  block_slot  int32 [T_pad/B] DEVICE slot of each block's adapter, -1 for padding blocks
with T_pad = padded_num_tokens(T, S, B) (static: every adapter wastes < B rows).
"""

from __future__ import annotations

import numpy as np

from vllm_tpu_lora.ops.bgmv_xla import padded_num_tokens

# Measured with `benchmarks/benchmark_ops.py --packed` (XLA CPU, a Llama layer's four
# linears at hidden 512 / intermediate 1408, rank 16, replayed; LoRA ms over the base):
#   T=16:  S=2 onehot 0.42 | grouped B=16 0.51;  S=8 onehot 1.32 | grouped B=1 0.78
#   T=64:  S=4 onehot 0.63 | grouped B=16 0.80;  S=8 onehot 1.70 | grouped B=16 2.01
#   T=256: S=4 onehot 2.08 | grouped B=16 3.05;  S=8 onehot 6.05 | grouped B=16 4.38
# and at hidden 1024 / intermediate 2816, S=16 (2 layers):
#   T=32: onehot 7.5 | grouped B=16 7.9;  T=64: 9.1 | 7.5;  T=512: 51.2 | 48.0  (base 8-77)
# Grouped matmul with blocks under 8 rows runs XLA CPU's batched matmul badly (B=1 at
# T=256: 66 ms), so the one-hot product over the step's S adapters wins except for large
# buckets with many adapters, where its S-fold FLOPs dominate.
# Gathered = per-token weight gather + multiply-and-sum (the bgmv of punica/S-LoRA); same
# layer, 4 layers, LoRA ms over the base (as a batched matmul it fell off a cliff at 64
# rows: 15 ms at T=64):
#   S=8:  T=16 onehot 1.25 | gathered 0.55;  T=32 2.36 | 1.65;  T=64 2.46 | 2.60
#   S=16: T=16 onehot 3.02 | gathered 0.72;  T=32 4.40 | 1.54;  T=64 4.81 | 2.03
#         (grouped B=16 3.73);  T=128: grouped B=16 4.71 | onehot 10.9 | gathered 16.1
# It costs T*R*(D+O) whatever S is, so it wins where the one-hot's S-fold FLOPs hurt and
# the bucket is small enough for the gathered weights to stay cheap.
# Re-measured on a second machine of this kind (2-core AMD EPYC; the figures above come
# from another 2-core host), S=8: T=128 onehot 4.13 | grouped B=16 4.45; T=256 4.24 | 7.87;
# T=512 8.98 | 12.07 (and in the engine, 8 adapters' 256-token prefill steps cost +20 ms
# over the base with onehot, +37 ms grouped); S=16: T=128 onehot 4.98 | grouped 4.60,
# T=256 7.61 | 6.80. So grouped is kept only from 16 adapters: at 8, one-hot wins here by
# up to 1.9x, more than grouped's 1.4x lead at T=256 on the other host.
GROUPED_BLOCK = 16  # token block B of the xla grouped matmul
GROUPED_FROM = ((16, 64),)  # (min S, min T) pairs where grouped wins
GATHERED_UP_TO = ((8, 32), (16, 64))  # (min S, max T) pairs where gathered wins


def xla_strategy(num_tokens: int, num_slots: int) -> str:
    """The xla backend's LoRA strategy for graph (T, S): "single", "gathered", "onehot" or
    "grouped"."""
    if num_slots == 1:
        return "single"
    if any(num_slots >= s and num_tokens <= t for s, t in GATHERED_UP_TO):
        return "gathered"
    if any(num_slots >= s and num_tokens >= t for s, t in GROUPED_FROM):
        return "grouped"
    return "onehot"


def segment_layout(token_pos: np.ndarray, active_slots: list[int], num_slots: int,
                   block: int) -> dict[str, np.ndarray]:
    """token_pos int [T]: the position of each token's adapter in `active_slots` (-1 for
    none); active_slots: the device slot of each position. See the module docstring."""
    num_tokens = token_pos.shape[0]
    t_pad = padded_num_tokens(num_tokens, num_slots, block)
    perm = np.zeros(t_pad, np.int32)
    dest = np.zeros(num_tokens, np.int32)
    block_slot = np.full(t_pad // block, -1, np.int32)
    row = 0
    for pos, slot in enumerate(active_slots):
        tokens = np.flatnonzero(token_pos == pos)
        if tokens.size == 0:
            continue
        perm[row:row + tokens.size] = tokens
        dest[tokens] = np.arange(row, row + tokens.size)
        padded = -(-tokens.size // block) * block
        block_slot[row // block:(row + padded) // block] = slot
        row += padded
    row_valid = np.zeros(t_pad, bool)
    row_valid[dest[token_pos >= 0]] = True
    return {"perm": perm, "dest": dest, "token_valid": token_pos >= 0, "row_valid": row_valid,
            "block_slot": block_slot}


def single_slot_layout(token_pos: np.ndarray, active_slots: list[int]) -> dict[str, np.ndarray]:
    """S = 1: every LoRA token uses the same adapter; no reordering at all."""
    slot = np.array(active_slots[:1] or [0], np.int32)
    return {"slot": slot, "token_valid": token_pos >= 0}


def token_slot_layout(token_pos: np.ndarray, active_slots: list[int]) -> dict[str, np.ndarray]:
    """The gathered strategy: each token's DEVICE slot (0 for tokens without an adapter,
    whose delta is masked out by token_valid)."""
    slots = np.asarray(list(active_slots) + [0], np.int32)
    return {"token_slot": slots[np.where(token_pos >= 0, token_pos, len(active_slots))],
            "token_valid": token_pos >= 0}
