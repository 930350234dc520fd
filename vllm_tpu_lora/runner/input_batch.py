"""Host-side input preparation in numpy: one scheduled step -> padded arrays.

Token rows are padded to the token bucket T; per-sequence sampling rows to the request
bucket R, the TPU attention kernel's per-sequence rows to max_num_seqs (they belong to
the forward graph, which does not depend on R). Padding tokens write to and read
from the reserved null block, padding rows sample garbage that nobody reads.

For the CPU attention path each sequence's tokens are also cut into query blocks of Q
tokens (one sequence per block), so a block gathers its sequence's KV pages once
instead of once per token: a 256-token prefill chunk reads its context 16x less often.
A block gathers the first W blocks of its sequence's table, W the step's attention window
bucket (runner/buckets.py kv_block_buckets): the cost follows W, so W is the smallest
bucket that holds the step's longest sequence, not max_model_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from vllm_tpu_lora.engine.block_manager import NULL_BLOCK, blocks_needed
from vllm_tpu_lora.engine.scheduler import ScheduledSeq
from vllm_tpu_lora.sampling_params import INT32_MAX, INT64_MAX

MAX_BLOCKED_IDS = 8  # EOS + stop_token_ids masked out while min_tokens is not reached
QUERY_BLOCK = 16  # the largest query block
# c in query_block_shape's rule, from replaying the forward graphs of the throughput
# benchmark's model (hidden 1024, 8 layers, 16 heads / 4 kv heads, max_num_seqs 32,
# window 384) with Q forced, ms per step:
#   T=64:  Q=4 149 | Q=8 157 | Q=16 184      T=128: Q=4 212 | Q=8 202 | Q=16 226
#   T=256: Q=8 306-313 | Q=16 308-315         T=512: Q=8 520-528 | Q=16 487-500
# c = 16 picks 4, 8, 16 (8 and 16 tie at 256) and 16.
QUERY_BLOCK_BALANCE = 16


@dataclass
class StepArrays:
    # token rows [T]
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    q_block_token_idx: np.ndarray  # [NQB, Q] token row of each query (padding: 0)
    q_block_tables: np.ndarray  # [NQB, W] first W blocks of the block's sequence's table
    q_block_kv_lens: np.ndarray  # [NQB, Q] keys each query sees (position + 1)
    token_out_index: np.ndarray  # [T] row of each token in the flattened [NQB * Q] output
    token_lora_idx: np.ndarray  # -1: base model / padding
    # [T] row of the previous step's sampled tokens that is this row's input id (async
    # scheduling: sampled there, still on the device); -1: input_ids holds it
    prev_rows: np.ndarray
    # attention's sequence rows [S = max_num_seqs]
    seq_kv_lens: np.ndarray
    seq_block_tables: np.ndarray  # [S, MB]
    cu_q_lens: np.ndarray  # [S + 1]
    num_seqs: np.ndarray  # [1]
    logits_indices: np.ndarray  # [max_num_seqs]: last token row of each sequence
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    blocked_ids: np.ndarray  # [R, MAX_BLOCKED_IDS], -1 padded
    num_tokens: int
    num_seqs_real: int
    active_slots: list[int] = field(default_factory=list)  # device slot per active position


def query_block_shape(t_bucket: int, max_num_seqs: int) -> tuple[int, int]:
    """(number of query blocks NQB, block size Q) for a token bucket: static per bucket.

    Buckets no larger than max_num_seqs are mostly decodes (one token per sequence), so
    Q = 1. Larger ones hold prefill chunks, and each sequence wastes at most one partial
    block, hence NQB = T/Q + S blocks (S = max_num_seqs): the step gathers a window per
    block, (T/Q + S) windows, and computes scores for every block row, T + S*Q rows. Both
    grow with the other's loss, so Q is the power of two nearest sqrt(c * T / S), which
    balances them (capped at QUERY_BLOCK)."""
    if t_bucket <= max_num_seqs:
        return t_bucket, 1
    best = math.sqrt(QUERY_BLOCK_BALANCE * t_bucket / max_num_seqs)
    q = min(QUERY_BLOCK, 2 ** round(math.log2(best)))  # best > 4: T > S
    return -(-t_bucket // q) + min(max_num_seqs, t_bucket), q


def _alloc(t: int, r: int, mb: int, nqb: int, q: int, max_seqs: int,
           window: int) -> dict[str, np.ndarray]:
    return dict(
        input_ids=np.zeros(t, np.int64), positions=np.zeros(t, np.int64),
        slot_mapping=np.zeros(t, np.int64) + NULL_BLOCK,
        q_block_token_idx=np.zeros((nqb, q), np.int64),
        q_block_tables=np.full((nqb, window), NULL_BLOCK, np.int64),
        q_block_kv_lens=np.ones((nqb, q), np.int32), token_out_index=np.zeros(t, np.int64),
        token_lora_idx=np.full(t, -1, np.int32), prev_rows=np.full(t, -1, np.int64),
        # Attention's per-sequence rows are part of the forward graph, which is keyed by
        # (token bucket, slot bucket) only: always max_num_seqs rows.
        seq_kv_lens=np.zeros(max_seqs, np.int32),
        seq_block_tables=np.full((max_seqs, mb), NULL_BLOCK, np.int64),
        cu_q_lens=np.zeros(max_seqs + 1, np.int32), num_seqs=np.zeros(1, np.int32),
        logits_indices=np.zeros(max_seqs, np.int64), temperature=np.zeros(r, np.float32),
        top_k=np.zeros(r, np.int32), top_p=np.ones(r, np.float32), min_p=np.zeros(r, np.float32),
        seeds=np.zeros(r, np.int64), steps=np.zeros(r, np.int64),
        blocked_ids=np.full((r, MAX_BLOCKED_IDS), -1, np.int64),
    )


def _sampling_row(a: dict, i: int, s: ScheduledSeq, eos_id: int | None) -> None:
    p, seq = s.seq.params, s.seq
    # Any k past the vocabulary keeps every token: capped, a huge top_k fits the int32 row
    # (uncapped it raised OverflowError inside the step, failing the step's requests).
    a["temperature"][i], a["top_k"][i] = p.temperature, min(p.top_k, INT32_MAX)
    a["top_p"][i], a["min_p"][i] = p.top_p, p.min_p
    # The output position this row samples: a token still in flight counts.
    position = seq.num_output_tokens + seq.num_pending_tokens
    a["seeds"][i], a["steps"][i] = seq.seed, position
    if position < p.min_tokens:
        blocked = list(p.stop_token_ids) + ([eos_id] if eos_id is not None and not p.ignore_eos else [])
        # Only ids a token can have are blocked; one past int64 would not fit the row.
        blocked = [t for t in blocked if 0 <= t <= INT64_MAX][:MAX_BLOCKED_IDS]
        a["blocked_ids"][i, : len(blocked)] = blocked


def _query_blocks(a: dict, first_block: int, rows: range, pos: np.ndarray, seq_row: int) -> int:
    """Cut one sequence's token rows into query blocks; return the next free block."""
    q, window = a["q_block_token_idx"].shape[1], a["q_block_tables"].shape[1]
    for j, start in enumerate(range(0, len(rows), q)):
        blk, n = first_block + j, min(q, len(rows) - start)
        token_rows = np.arange(rows.start + start, rows.start + start + n)
        a["q_block_token_idx"][blk, :n] = token_rows
        a["q_block_kv_lens"][blk, :n] = pos[start:start + n] + 1
        a["q_block_tables"][blk] = a["seq_block_tables"][seq_row, :window]
        a["token_out_index"][token_rows] = blk * q + np.arange(n)
    return first_block + -(-len(rows) // q)


def kv_window_blocks(scheduled: list[ScheduledSeq], block_size: int) -> int:
    """KV blocks the step's longest sequence holds after this step (at least 1)."""
    return max([blocks_needed(s.start + s.num_tokens, block_size) for s in scheduled] + [1])


def prepare_step(scheduled: list[ScheduledSeq], t_bucket: int, r_bucket: int,
                 max_blocks: int, block_size: int, lora_position_of: dict[int, int],
                 eos_id: int | None, max_num_seqs: int,
                 window_blocks: int | None = None) -> StepArrays:
    """window_blocks: the attention window bucket (KV blocks each query block gathers,
    at least the step's longest sequence needs; see kv_window_blocks); default
    max_blocks."""
    a = _alloc(t_bucket, r_bucket, max_blocks, *query_block_shape(t_bucket, max_num_seqs),
               max_num_seqs, window_blocks or max_blocks)
    cursor, block = 0, 0
    for i, s in enumerate(scheduled):
        seq, n, start = s.seq, s.num_tokens, s.start
        rows = slice(cursor, cursor + n)
        pos = np.arange(start, start + n)
        table = np.asarray(seq.block_ids, np.int64)
        known = min(start + n, seq.num_tokens)
        a["input_ids"][cursor:cursor + known - start] = seq.token_ids_slice(start, known)
        if known < start + n:  # its last input is the token the step in flight samples
            if s.prev_row < 0 or start + n - known != 1:
                raise RuntimeError(f"sequence {seq.seq_id}: {start + n - known} unknown input "
                                   f"token(s), previous-step row {s.prev_row}")
            a["prev_rows"][cursor + n - 1] = s.prev_row
        a["positions"][rows] = pos
        a["slot_mapping"][rows] = table[pos // block_size] * block_size + pos % block_size
        a["seq_block_tables"][i, : len(table)] = table
        block = _query_blocks(a, block, range(cursor, cursor + n), pos, i)
        a["token_lora_idx"][rows] = lora_position_of.get(seq.lora_int_id, -1)
        a["seq_kv_lens"][i] = start + n
        a["cu_q_lens"][i + 1] = cursor + n
        a["logits_indices"][i] = cursor + n - 1
        _sampling_row(a, i, s, eos_id)
        cursor += n
    a["cu_q_lens"][len(scheduled) + 1:] = cursor
    a["num_seqs"][0] = len(scheduled)
    if not scheduled:
        # The all-padding step (warm-up) gets one phantom sequence: padding row 0 over
        # the null block's first slot. The TPU's ragged kernel starts copying the first
        # sequence's first KV page before its loop; with no sequence to wait on that copy
        # the kernel ends with a DMA in flight and the chip halts ("The program
        # continuator has halted unexpectedly", seen on the v5e).
        a["seq_kv_lens"][0], a["cu_q_lens"][1:], a["num_seqs"][0] = 1, 1, 1
    return StepArrays(**a, num_tokens=cursor, num_seqs_real=len(scheduled))
