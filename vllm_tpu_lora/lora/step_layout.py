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

# From block_sizes, not bgmv_xla (which re-exports it): this module imports no torch, so
# benchmarks/tpu_lora_layer.py builds the engine's layouts with it on a JAX-only host.
from vllm_tpu_lora.ops.block_sizes import padded_num_tokens

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
# Split (from T=64): continuous batching mixes a few prefill chunks (many tokens of few
# adapters) with single decode tokens of many adapters, so the one-hot pays S-fold for
# adapters that own one token each and grouped pads every one of them to a block. Split
# runs the one-hot over the heavy adapters only and a gathered bgmv over 16 light rows.
# `benchmark_ops.py --packed --mixed 4 --tokens 64 256 --slots 8 16` (distinct weights per
# layer, 4 heavy adapters + one decode token for each other one; LoRA ms over the base):
#   T=64:  S=8  onehot 1.0 | grouped B=16 8.0 | gathered 20.9 | split 2.5
#          S=16 onehot 29.6 | grouped B=16 25.3 | gathered 32.4 | split 8.3
#   T=256: S=8  onehot 38.7 | grouped B=16 37.1 | gathered 108 | split 26.2
#          S=16 onehot 58.7 | grouped B=16 63.3 | gathered 119 | split 34.2
# In the engine (1,000-adapter benchmark shape) 16 adapters per step went from 0.82x of
# 8 adapters to 1.0x.
# Slots (first choice where it applies, else the strategies above as its fallback): each
# adapter's tokens grouped into its own DEVICE slot's rows, so one batched matmul per slice
# over the slot buffers as they lie reads every slot's weights exactly once, without a
# copy: no per-token weight gather (gathered), no S-fold FLOPs (one-hot), no per-block
# weight copy (grouped). It reads all max_loras slots, so it applies only where the
# step's bucket is above half of them, and each slot holds C = 2T/S rows (2T to 4T rows in
# all); a step with more tokens on one adapter runs the bucket's fallback graph (its own
# arrays, so its own graph key; warm-up traces both). Measured in the engine, forward
# graphs replayed with every slot in use (`benchmarks/replay_buckets.py`; LoRA ms over the
# base graph, slots | the fallback):
#   benchmark_lora shape, S = max_loras = 8:  T=64 5.1 | split 12.3;  T=128 7.3 | 15.2;
#                                             T=256 10.9 | 20.1
#   vs-PEFT shape (hidden 1024, 8 layers), S = max_loras = 16:  T=64 31.6 | gathered 35.5;
#                                             T=256 87.2 | split 234;  T=512 98.7 | 311
# Below 64 tokens it lost in the engine (T=16, S=8: +3.2-3.8 against gathered's +2.7-3.0;
# T=32, S=16 at the vs-PEFT shape: 29-33 against 15-18), though an op-level replay of the
# LoRA linears alone had it ahead: decode buckets keep gathered.
# All of the above was measured with the slot buffers in PEFT's layout. With the xla
# buffers transposed (A [D, R], B [R, O]: punica.weights_transposed) every strategy got
# cheaper and the choice stayed: the engine's graphs replayed with each strategy forced,
# interleaved in one process (LoRA ms over the base graph), benchmark_lora shape, S = 8:
#   T=16 gathered 2.3 | slots 2.1 | onehot 4.3;  T=32 2.9 | 3.0 | 5.1;
#   T=64 slots 3.6 | gathered 5.4 | onehot 6.9;  T=256 slots 8.0 | gathered 26 | onehot 18
# (before: gathered +2.7 at T=16, +4.1 at T=32; slots +4.9 at T=64, +12.7 at T=256), and
# at the vs-PEFT shape, S = 16: T=32 gathered 10.7 | slots 10.9 (before: 15-18 | 29-33);
# T=256 slots 35 | gathered 138 (before: slots 87); T=512 slots 70-78 (before: 99).
# How often a slots bucket falls back, from the engine's own count
# (stats()["forward_graph_steps"]) on benchmark_vs_peft.py --num-adapters 16 --output-len
# 32 32 (another host: an AVX-512 Xeon, where the LoRA ops cost about twice the above):
# of 67 steps, 57 were 32-token decode steps (gathered) and 8 prefill steps, of which 7
# ran the split fallback (the scheduler admits a waiting adapter's requests together, so
# one adapter's prefill tokens often exceed a slot's 2T/S rows), replayed there at +136 ms
# over the base graph at T=256 (slots +38) and +195 at T=512 (slots +93). On
# benchmark_lora.py all 9 prefill steps fit (256 tokens over 8 slots: 64 rows each).
# On a TPU (xla backend): "onehot" for every graph with S >= 2, "single" for S = 1. The
# TPU moves weights cheaply and rows between segment and token order dearly. Measured on
# a TPU v5e in JAX (benchmarks/tpu_lora_layer.py: Llama-3-8B's four LoRA linears, bf16,
# rank 16; docs/results/tpu_lora_layer.jsonl runs 4-8), linears-only base / (base +
# LoRA) for N slots with A of them in use: the Pallas path as the engine composes it (a
# gather into segment order, the kernels, a scatter back, per slice) | "dense" (both
# products one-hot over every device slot in token order, no weight copy: the TPU's
# strategy until runs 5-6) | onehot:
#   T=16:   N=8 A=8 0.78 | 0.84 | 0.88;  N=16 A=16 0.69 | 0.81 | 0.87;  A=2 0.81 | 0.81 | 0.89
#   T=256:  N=8 A=8 0.60 | 0.79 | 0.83;  N=16 A=16 0.54 | 0.77 | 0.81;  A=2 0.61 | 0.77 | 0.82
#   T=1024: N=8 A=8 0.66 | 0.83 | 0.85;  N=16 A=16 0.64 | 0.82 | 0.84;  A=2 0.69 | 0.82 | 0.85
# and at N=4 slots of rank 64: 0.80 | 0.82 | 0.88, 0.61 | 0.77 | 0.81, 0.69 | 0.82 | 0.83.
# The Pallas kernels themselves are cheap there; what costs is the output-sized gather,
# mask and add that put their segment-ordered rows back in token order. onehot beats
# dense even with every slot in use (it shrinks a packed layer once over its slices'
# concatenated A; dense contracts over all N slots whatever the step uses, though with
# 2 of 16 in use onehot gained about 0.02 more; no per-op profile was taken). S = 1
# keeps "single" (x @ A[slot], no one-hot or weight copy) on a tie: 0.894 against
# onehot's 0.888 at 16 tokens, 0.820 against 0.821 at 256, 0.847 against 0.849 at 1024
# (noise either way; single is the simpler graph). At rank 64 with every slot in use
# (run 8) onehot still led, Pallas | onehot: N=8 (N*R = 512) 0.76 | 0.86, 0.59 | 0.76,
# 0.65 | 0.78 at 16 / 256 / 1024 tokens; N=16 (1024) 0.68 | 0.83, 0.53 | 0.68, 0.62 |
# 0.68, its lead shrinking as S*R grows (the Pallas kernels alone beat a one-hot
# product 1.4-2.5x at 16 adapters of rank 64 in tpu_kernels.py; the row reordering
# around them is what loses). Runs 9-10 went past 16 slots of rank 64 to where it turns, every
# slot in use, Pallas | onehot at 16 / 256 / 1024 tokens, by S*R (the one-hot's width,
# which sizes both its weight copy and its FLOPs):
#   S*R = 512:  N=32 R=16 0.63 | 0.80, 0.46 | 0.75, 0.63 | 0.77
#   S*R = 1024: N=64 R=16 0.61 | 0.78, 0.34 | 0.66, 0.53 | 0.67;  N=32 R=32 0.63 | 0.69,
#               0.46 | 0.66, 0.62 | 0.67;  N=8 R=128 0.65 | 0.83, 0.56 | 0.68, 0.64 |
#               0.68;  N=4 R=256 0.64 | 0.82, 0.55 | 0.68, 0.64 | 0.68;  N=2 R=512
#               0.62 | 0.83, 0.50 | 0.68, 0.60 | 0.68
#   S*R = 2048: N=32 R=64 0.59 | 0.61, 0.44 | 0.53, 0.61 | 0.54;  N=16 R=128 0.55 | 0.72,
#               0.48 | 0.54, 0.59 | 0.54 (onehot loses at 1024 tokens)
#   S*R = 4096: N=32 R=128 0.53 | 0.49, 0.36 | 0.38, 0.56 | 0.38
# and at 64 / 128 tokens (decode buckets) N=16 R=16: 0.65 | 0.85, 0.62 | 0.84. Those
# Pallas figures are the per-slice segment path, which the engine no longer runs: its
# linears run the fused grouped kernel (ops/grouped_lora.py), which lost to onehot at
# every shape measured (run 12, 128 slots of rank 16, 1/8/32/128 in use: 1.4-1.7x
# onehot's delta at 16 tokens, 1.2-3.0x at 256).
# Where onehot's product T*S*R is largest it turns (runs 16-18, 2026-12-07, Llama-3-8B
# layer, bf16; device ms of the layer's LoRA, onehot | stacked | grouped kernel):
#   T*S*R = 2^18-2^19, grouped loses: T=512 S=32 R=16 0.436 | 0.431 | 0.712;
#     T=256 S=128 R=16 0.805 | 0.717 | 0.874;  T=1024 S=32 R=16 0.781 | 0.773 | 1.164;
#     T=256 S=32 R=64 0.694 | 2.34 | 1.04  (and T=256 S=32 R=16, 2^17: 0.284 | 0.737 | 0.600)
#   T*S*R = 2^20, grouped wins: T=512 S=128 R=16 1.241 | 1.149 | 1.074
#   T*S*R = 2^21: T=1024 S=128 R=16 2.48-2.53 | 2.14-2.16 | 1.53-1.57 (1.6-1.7x roofline);
#     T=256 S=128 R=64 2.76 | 2.35 | 2.17
# so on a TPU a graph whose T*S*R reaches 2^20 with a one-hot at least 2,048 lanes wide
# (S*R: the kernel's lead is skipping the groups of 128 rank lanes a tile does not touch,
# and every win measured had S*R >= 2,048) runs the fused grouped kernel over the buffers
# as they lie ("grouped_kernel": A [N, R, D] and B [N, R, O] are already its layout there);
# any other S >= 2 onehot or stacked as above. Both paths' FLOPs scale with the width
# D+O, so the rule leaves it out. At rank 64 over 32 slots (S*R = 2,048, run 20) it holds:
# T=1024 S=32 R=64 (2^21) 2.17 | 2.11 | 1.54, and T=1024 S=128 R=64 (2^23) 9.28 | 7.72 |
# 2.93 (1.05x roofline); while 8 of 32 slots in use (a step the engine runs in an 8-slot
# graph, 2^19) 0.77 | 2.11 | 1.30. Not measured: T*S*R past 2^23.
# On XLA CPU the table above wins (onehot is its fallback at a few buckets only).

# The indexed kernel (ops/indexed_lora.py: the step's adapters fetched in groups by its
# own DMAs, each read once, no copy) in decode graphs over many of more slots, with
# kernels on ("auto"). On the v5e at Llama-3.2-1B, rank 16, a decode step over 32 of 128
# slots took 4.73 ms of device time against onehot's 5.10 (base 3.45; profiled side by
# side on one engine with the slot buffers pinned to HBM, docs/benchmarks.md, eleventh
# session); forced on the prefill graphs too it lost there (T=1024: 490 ms against
# onehot's 432 over a run, tenth session, before each tile read only its own adapters).
# Picked only where measured: T <= 32, S >= 32, rank 16.
INDEXED_UP_TO_TOKENS, INDEXED_FROM_SLOTS, INDEXED_RANKS = 32, 32, (16,)
SLOTS_MAX_TOKENS = 512  # rows grow to 4T x the output width: large buckets keep the fallback
GROUPED_BLOCK = 16  # token block B of the xla grouped matmul (forced only)
# (T*S*R, S*R) from which a TPU graph runs the grouped kernel (above)
GROUPED_KERNEL_FROM = (2**20, 2048)
GATHERED_UP_TO = ((8, 32), (16, 64))  # (min S, max T) pairs where gathered wins
SPLIT_FROM_TOKENS = 64  # buckets from here run "split" (below)
LIGHT_ROWS = 16  # rows of the split strategy's gathered part


def xla_strategy(num_tokens: int, num_slots: int, max_loras: int = 0,
                 on_tpu: bool = False, rank: int = 0,
                 kernel_from: tuple[int, int] | None = GROUPED_KERNEL_FROM) -> str:
    """The xla backend's LoRA strategy for graph (T, S): on a TPU "single" for S = 1, the
    fused grouped kernel where T*S*R and S*R (R: the buffers' rank, at most 64, its
    groups of 128 lanes full) reach `kernel_from` (None: never, XLA ops only), "stacked"
    where S is every device slot, the indexed kernel in the decode graphs measured for it
    (INDEXED_*; kernels on), else "onehot"; elsewhere "slots" where it applies (its
    steps that do not fit run `fallback_strategy`), else the fallback itself."""
    if on_tpu:
        if num_slots == 1:
            return "single"
        # Measured at ranks 16 and 64, whose slots fill the kernel's 128 lanes in groups;
        # past 64 a group is one slot of rank width: not measured, not picked. (A
        # max_loras that 128 / R does not divide gives smaller groups: not measured.)
        if (kernel_from is not None and num_tokens * num_slots * rank >= kernel_from[0]
                and num_slots * rank >= kernel_from[1] and 0 < rank <= 64):
            return "grouped_kernel"
        if 0 < max_loras <= num_slots:
            return "stacked"
        if (kernel_from is not None and num_tokens <= INDEXED_UP_TO_TOKENS
                and num_slots >= INDEXED_FROM_SLOTS and rank in INDEXED_RANKS):
            return "indexed"
        return "onehot"
    if (num_slots >= 2 and 0 < max_loras < 2 * num_slots
            and SPLIT_FROM_TOKENS <= num_tokens <= SLOTS_MAX_TOKENS):
        return "slots"
    return fallback_strategy(num_tokens, num_slots)


def fallback_strategy(num_tokens: int, num_slots: int) -> str:
    """"single", "gathered", "onehot" or "split" ("grouped" only when forced). In a split
    graph S counts the step's *heavy* adapters only (see split_layout)."""
    if num_slots == 1:
        return "single"
    if any(num_slots >= s and num_tokens <= t for s, t in GATHERED_UP_TO):
        return "gathered"
    if num_tokens >= SPLIT_FROM_TOKENS:
        return "split"
    return "onehot"


def heavy_positions(token_pos: np.ndarray, num_active: int,
                    light_rows: int = LIGHT_ROWS) -> tuple[list[int], np.ndarray]:
    """The split strategy's partition of the step's adapters: (heavy positions, bool
    [num_active] light). The adapters with the fewest tokens are light, smallest first,
    while their tokens fit in `light_rows` (decode tokens, typically); the other used
    ones are heavy (prefill chunks, typically)."""
    counts = np.bincount(token_pos[token_pos >= 0], minlength=num_active)
    light = np.zeros(num_active, bool)
    budget = light_rows
    for pos in np.argsort(counts, kind="stable"):
        if counts[pos] > budget:
            break
        light[pos] = counts[pos] > 0
        budget -= counts[pos]
    return [p for p in range(num_active) if counts[p] and not light[p]], light


def split_layout(token_pos: np.ndarray, active_slots: list[int],
                 num_slots: int, light_rows: int = LIGHT_ROWS) -> dict[str, np.ndarray]:
    """Split strategy: a one-hot product over the step's heavy adapters (at most
    `num_slots`) for every token, plus a gathered bgmv over `light_rows` rows for the
    tokens of the light ones (decode tokens, typically):
      token_lora_idx int32 [T]     position of each token's adapter among the heavy (-1:
                                   light or none)
      active_slots   int32 [S]     device slot of each heavy position (padding: 0, never
                                   matched by a token)
      light_rows     int32 [L]     token of each light row (padding rows: token 0)
      light_slot     int32 [L]     device slot of each light row's adapter
      light_valid    bool  [L]     the row holds a light token"""
    heavy, light = heavy_positions(token_pos, len(active_slots), light_rows)
    if len(heavy) > num_slots:
        raise ValueError(f"{len(heavy)} heavy adapters > the graph's {num_slots} slots")
    position = np.full(len(active_slots) + 1, -1, np.int32)  # index -1: no adapter
    position[heavy] = np.arange(len(heavy), dtype=np.int32)
    slots = np.asarray(active_slots, np.int32)
    active = np.zeros(num_slots, np.int32)
    active[:len(heavy)] = slots[heavy]
    rows = np.flatnonzero((token_pos >= 0) & light[np.maximum(token_pos, 0)]).astype(np.int32)
    light_rows_arr = np.zeros(light_rows, np.int32)
    light_rows_arr[:rows.size] = rows
    light_slot = np.zeros(light_rows, np.int32)
    light_slot[:rows.size] = slots[token_pos[rows]]
    light_valid = np.zeros(light_rows, bool)
    light_valid[:rows.size] = True
    return {"token_lora_idx": position[token_pos], "active_slots": active,
            "light_rows": light_rows_arr, "light_slot": light_slot, "light_valid": light_valid}


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


def slot_capacity(num_tokens: int, num_slots: int) -> int:
    """Rows per device slot in a slots graph (T, S): twice an even share."""
    return max(1, -(-2 * num_tokens // num_slots))


def slots_fit(token_pos: np.ndarray, num_slots: int) -> bool:
    """Whether no adapter has more of the step's tokens than a slot's rows."""
    used = token_pos[token_pos >= 0]
    return used.size == 0 or np.bincount(used).max() <= slot_capacity(token_pos.size, num_slots)


def slots_layout(token_pos: np.ndarray, active_slots: list[int], num_slots: int,
                 max_loras: int) -> dict[str, np.ndarray]:
    """The slots strategy (the step must fit, see slots_fit). Rows: C per device slot,
    slot n's tokens in rows [n*C, n*C + count), in token order; row index T and token row
    N*C are the zero rows each side appends:
      slot_perm int32 [N*C]  token feeding each row (T: no token, a zero row)
      slot_dest int32 [T]    row of each token (N*C: no adapter, a zero delta)"""
    num_tokens = token_pos.size
    cap = slot_capacity(num_tokens, num_slots)
    perm = np.full(max_loras * cap, num_tokens, np.int32)
    dest = np.full(num_tokens, max_loras * cap, np.int32)
    for pos, slot in enumerate(active_slots):
        tokens = np.flatnonzero(token_pos == pos)
        rows = slot * cap + np.arange(tokens.size, dtype=np.int32)
        perm[rows] = tokens
        dest[tokens] = rows
    return {"slot_perm": perm, "slot_dest": dest}


def single_slot_layout(token_pos: np.ndarray, active_slots: list[int]) -> dict[str, np.ndarray]:
    """S = 1: every LoRA token uses the same adapter; no reordering at all."""
    slot = np.array(active_slots[:1] or [0], np.int32)
    return {"slot": slot, "token_valid": token_pos >= 0}


def onehot_layout(token_pos: np.ndarray, active_slots: list[int],
                  num_slots: int) -> dict[str, np.ndarray]:
    """The onehot strategy (and the Pallas and tensor-parallel paths): each token's
    position among the step's adapters, and their device slots padded to the graph's S
    (padding points at slot 0; no token's one-hot selects it)."""
    active = np.zeros(num_slots, np.int32)
    active[: len(active_slots)] = active_slots
    return {"token_lora_idx": token_pos.astype(np.int32), "active_slots": active}


def token_slot_layout(token_pos: np.ndarray, active_slots: list[int]) -> dict[str, np.ndarray]:
    """The gathered strategy: each token's DEVICE slot (0 for tokens without an adapter,
    whose delta is masked out by token_valid)."""
    slots = np.asarray(list(active_slots) + [0], np.int32)
    return {"token_slot": slots[np.where(token_pos >= 0, token_pos, len(active_slots))],
            "token_valid": token_pos >= 0}
