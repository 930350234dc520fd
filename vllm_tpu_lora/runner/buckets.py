"""Bucket ladders: every step is padded up to one of these shapes, so the set of graphs
is finite and known at start-up. Pure functions."""

from __future__ import annotations


def pow2_ladder(lo: int, hi: int) -> list[int]:
    """lo, 2lo, 4lo, ... with the last rung exactly `hi` (hi need not be a power of 2)."""
    if lo <= 0 or hi <= 0:
        raise ValueError(f"bucket bounds must be positive, got lo={lo} hi={hi}")
    ladder, b = [], lo
    while b < hi:
        ladder.append(b)
        b *= 2
    ladder.append(hi)
    return ladder


def token_buckets(max_num_batched_tokens: int, min_bucket: int = 16) -> list[int]:
    return pow2_ladder(min(min_bucket, max_num_batched_tokens), max_num_batched_tokens)


def request_buckets(max_num_seqs: int, min_bucket: int = 8) -> list[int]:
    return pow2_ladder(min(min_bucket, max_num_seqs), max_num_seqs)


def slot_buckets(max_loras: int) -> list[int]:
    """0 (base-only graph, no LoRA op traced), 1, 2, 4, ... max_loras."""
    if max_loras <= 0:
        return [0]
    return [0] + pow2_ladder(1, max_loras)


# The CPU attention path gathers each query block's whole context window (see
# layers/attention.py), so its cost follows the window, not the sequences' real lengths:
# at max_model_len 384 (benchmark_throughput's shape) attention was 22-31% of a decode
# step's forward and 41-48% of a prefill step's. Windows come in KV-block buckets, from
# KV_MIN_WINDOW tokens up to max_model_len: engines whose max_model_len is no larger
# (the tests') keep one bucket and their graph count.
KV_MIN_WINDOW = 256


def kv_block_buckets(max_blocks: int, block_size: int, ragged_kernel: bool = False) -> list[int]:
    """Attention context windows, in KV blocks per sequence: KV_MIN_WINDOW tokens, twice
    that, ... up to max_blocks. A ragged kernel (TPU) reads only each sequence's own
    blocks, so there one window: max_blocks."""
    if ragged_kernel:
        return [max_blocks]
    return pow2_ladder(min(max(1, KV_MIN_WINDOW // block_size), max_blocks), max_blocks)


def slots_reachable(t_b: int, s_b: int, slot_ladder: list[int], max_num_seqs: int) -> bool:
    """Whether a step of token bucket t_b can run slot bucket s_b. A step's adapters are
    at most its sequences, which are at most its tokens and max_num_seqs, so a slot
    bucket above the one that many adapters pick never runs with t_b: warm-up skips its
    graph (with max_loras 128 and 32 sequences, the 64- and 128-slot graphs of every
    token bucket)."""
    return s_b <= pick(slot_ladder, min(t_b, max_num_seqs, slot_ladder[-1]))


def pick(ladder: list[int], n: int) -> int:
    """The smallest bucket >= n."""
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")
