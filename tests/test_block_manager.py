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


# ---- prefix caching ----------------------------------------------------------------------

from vllm_tpu_lora.engine.prefix_hash import block_hashes, root_hash  # noqa: E402


def _filled(bm: BlockManager, tokens: list[int], root: bytes) -> Sequence:
    """A sequence that has computed all of `tokens` and registered its full blocks."""
    s = Sequence("r", 0, tokens, SamplingParams(), seed=0)
    bm.grow(s, len(tokens))
    bm.register_full_blocks(s, block_hashes(s, root, len(tokens) // bm.block_size, bm.block_size))
    return s


def test_hash_chain_depends_on_prefix_weights_and_salt():
    root = root_hash(None, None)
    a = Sequence("a", 0, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), seed=0)
    b = Sequence("b", 0, [9, 9, 9, 9, 5, 6, 7, 8], SamplingParams(), seed=0)
    ha, hb = block_hashes(a, root, 2, 4), block_hashes(b, root, 2, 4)
    assert ha[0] != hb[0] and ha[1] != hb[1]  # same tokens, other parent: another block
    assert block_hashes(Sequence("c", 0, [1, 2, 3, 4, 0], SamplingParams(), seed=0),
                        root, 1, 4) == ha[:1]
    roots = {root, root_hash((1, 1), None), root_hash((1, 2), None), root_hash((2, 1), None),
             root_hash(None, "s"), root_hash((1, 1), "s"), root_hash(None, "(1, 1)"),
             root_hash(None, "None")}
    assert len(roots) == 8  # base, adapter versions and salts never alias
    a2 = Sequence("a", 0, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), seed=0)
    assert block_hashes(a2, root_hash((1, 1), None), 2, 4)[0] != ha[0]


def test_cached_blocks_are_shared_by_reference_and_survive_their_owner():
    bm = BlockManager(num_blocks=10, block_size=4, enable_caching=True)
    root = root_hash(None, None)
    first = _filled(bm, list(range(1, 11)), root)  # 2 full blocks + 2 tokens
    assert bm.num_cached_blocks == 2
    later = Sequence("r2", 0, list(range(1, 9)) + [50, 51], SamplingParams(), seed=0)
    hits = bm.cached_prefix(block_hashes(later, root, 2, 4))
    assert hits == first.block_ids[:2]
    assert bm.can_take(later, hits, 10)
    bm.take(later, hits)
    bm.grow(later, 10)
    assert later.block_ids[:2] == first.block_ids[:2] and later.block_ids[2] != first.block_ids[2]
    shared = first.block_ids[:2]
    free_before = bm.num_free_blocks
    bm.free(first)  # its private tail is free; the shared head is still held by `later`
    assert bm.num_free_blocks == free_before + 1
    bm.free(later)
    assert bm.num_free_blocks == bm.num_usable_blocks  # free, yet still findable
    assert bm.cached_prefix(block_hashes(later, root, 2, 4)) == shared


def test_free_cached_blocks_count_against_the_pool_when_taken():
    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=True)  # 3 usable
    root = root_hash(None, None)
    s = _filled(bm, list(range(1, 9)), root)
    bm.free(s)  # 2 cached blocks, all 3 free
    t = Sequence("t", 0, list(range(1, 9)) + [70] * 8, SamplingParams(), seed=0)
    hits = bm.cached_prefix(block_hashes(t, root, 2, 4))
    assert len(hits) == 2
    assert bm.can_take(t, hits, 12) and not bm.can_take(t, hits, 13)


def test_eviction_is_least_recently_freed_first_and_tail_first():
    bm = BlockManager(num_blocks=7, block_size=2, enable_caching=True)  # 6 usable
    root = root_hash(None, None)
    old = _filled(bm, [1, 2, 3, 4], root)
    new = _filled(bm, [5, 6, 7, 8], root)
    old_blocks, new_blocks = list(old.block_ids), list(new.block_ids)
    bm.free(old)
    bm.free(new)
    # Two plain free blocks go first, then old's tail, old's head, new's tail, new's head.
    grab = Sequence("g", 0, [0] * 12, SamplingParams(), seed=0)
    bm.grow(grab, 4)
    assert bm.num_cached_blocks == 4 and bm.num_cache_evictions == 0
    bm.grow(grab, 6)
    assert grab.block_ids[-1] == old_blocks[1] and bm.num_cache_evictions == 1
    assert bm.cached_prefix(block_hashes(old, root, 2, 2)) == old_blocks[:1]
    bm.grow(grab, 8)
    assert grab.block_ids[-1] == old_blocks[0]
    assert bm.cached_prefix(block_hashes(new, root, 2, 2)) == new_blocks
    bm.grow(grab, 10)
    assert grab.block_ids[-1] == new_blocks[1]


def test_a_taken_block_is_not_evicted_and_duplicates_stay_private():
    bm = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
    root = root_hash(None, None)
    a = _filled(bm, [1, 2, 3, 4], root)
    b = _filled(bm, [1, 2, 3, 4], root)  # same content computed again (same step)
    assert bm.num_cached_blocks == 2  # the first registration wins
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.cached_prefix(block_hashes(b, root, 2, 2)) == a_blocks  # freed, still found
    c = Sequence("c", 0, [1, 2, 3, 4, 9], SamplingParams(), seed=0)
    taken = bm.cached_prefix(block_hashes(c, root, 2, 2))
    bm.take(c, taken)
    filler = Sequence("f", 0, [0] * 8, SamplingParams(), seed=0)
    bm.grow(filler, 2 * bm.num_free_blocks)  # every free block, none of c's
    assert not set(filler.block_ids) & set(taken)
    bm.free(b)
    bm.free(c)
    bm.free(filler)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_reset_forgets_everything_but_holders_keep_their_blocks():
    bm = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
    root = root_hash(None, None)
    s = _filled(bm, [1, 2, 3, 4], root)
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0
    assert bm.cached_prefix(block_hashes(s, root, 2, 2)) == []
    assert len(s.block_ids) == 2
    bm.free(s)
    assert bm.num_free_blocks == bm.num_usable_blocks
