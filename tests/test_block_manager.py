"""BlockManager on its own: pure Python, no device."""

import pytest

from vllm_tpu_lora.engine.block_manager import NULL_BLOCK, BlockManager, blocks_needed
from vllm_tpu_lora.engine.sequence import Sequence
from vllm_tpu_lora.sampling_params import SamplingParams


def _seq(n_prompt: int) -> Sequence:
    return Sequence("r", 0, list(range(1, n_prompt + 1)), SamplingParams(), seed=0)


def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_null_block_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=4)
    seqs = [_seq(4) for _ in range(4)]
    for s in seqs:
        bm.grow(s, 4)
    got = sorted(b for s in seqs for b in s.block_ids)
    assert got == [1, 2, 3, 4] and NULL_BLOCK not in got
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(_seq(1), 1)


def test_grow_is_incremental_and_slots_follow_the_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq(3)
    bm.grow(s, 3)
    assert len(s.block_ids) == 1
    bm.grow(s, 4)  # still fits in the first block
    assert len(s.block_ids) == 1
    bm.grow(s, 9)
    assert len(s.block_ids) == 3
    assert bm.slot(s, 5) == s.block_ids[1] * 4 + 1


def test_free_returns_blocks_and_rejects_double_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    s = _seq(6)
    bm.grow(s, 6)
    assert bm.num_free_blocks == 0
    held = list(s.block_ids)
    bm.free(s)
    assert bm.num_free_blocks == 3 and s.block_ids == []
    s.block_ids = held
    with pytest.raises(RuntimeError, match="does not own"):
        bm.free(s)


def test_out_of_blocks_raises():
    bm = BlockManager(num_blocks=2, block_size=2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(_seq(5), 5)


def test_needs_a_real_block_besides_the_null_block():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=1, block_size=16)
