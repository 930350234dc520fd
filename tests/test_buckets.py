import pytest

from vllm_tpu_lora.runner import buckets


def test_pow2_ladder_ends_exactly_at_max():
    assert buckets.pow2_ladder(16, 256) == [16, 32, 64, 128, 256]
    assert buckets.pow2_ladder(16, 48) == [16, 32, 48]
    assert buckets.pow2_ladder(8, 8) == [8]


def test_token_and_request_ladders_clamp_their_minimum():
    assert buckets.token_buckets(8) == [8]
    assert buckets.request_buckets(4) == [4]
    assert buckets.request_buckets(32) == [8, 16, 32]


def test_slot_buckets_start_with_the_base_only_graph():
    assert buckets.slot_buckets(0) == [0]
    assert buckets.slot_buckets(1) == [0, 1]
    assert buckets.slot_buckets(4) == [0, 1, 2, 4]
    assert buckets.slot_buckets(6) == [0, 1, 2, 4, 6]


def test_pick_is_the_smallest_bucket_that_fits():
    ladder = [16, 32, 48]
    assert [buckets.pick(ladder, n) for n in (1, 16, 17, 33, 48)] == [16, 16, 32, 48, 48]
    with pytest.raises(ValueError, match="exceeds"):
        buckets.pick(ladder, 49)


def test_kv_window_buckets_start_at_the_minimum_window():
    # block_size 16: windows of 256, 512, ... tokens, the last one max_model_len's.
    assert buckets.kv_block_buckets(24, 16) == [16, 24]
    assert buckets.kv_block_buckets(128, 16) == [16, 32, 64, 128]
    assert buckets.kv_block_buckets(16, 16) == [16]  # the tests' engines: one window
    assert buckets.kv_block_buckets(7, 16) == [7]
    assert buckets.kv_block_buckets(40, 4) == [40]  # 256 tokens of 4-token blocks: 64
    # A ragged kernel (TPU) reads each sequence's own blocks: one window.
    assert buckets.kv_block_buckets(128, 16, ragged_kernel=True) == [128]


def test_query_blocks_hold_any_step_of_their_bucket():
    """Every way to cut T tokens into at most max_num_seqs sequences fits the bucket's
    query blocks (one sequence per block); decode-sized buckets use single-row blocks and
    larger ones grow their blocks up to 16 rows."""
    from vllm_tpu_lora.runner.input_batch import query_block_shape

    for seqs in (8, 16, 32):
        shapes = []
        for t in (16, 32, 64, 128, 256, 512):
            nqb, q = query_block_shape(t, seqs)
            shapes.append(q)
            assert (q == 1) == (t <= seqs) and q in (1, 2, 4, 8, 16)
            # The most blocks a step needs: k sequences, each one token past a multiple of
            # q (a partial block apiece), the rest of the tokens in full blocks.
            worst = max((t - k) // q + k for k in range(1, min(seqs, t) + 1))
            assert worst <= nqb, (t, seqs, nqb, q)
        assert shapes == sorted(shapes)


@pytest.mark.parametrize("max_tokens,max_seqs,max_loras,skipped",
                         [(64, 32, 128, 7), (256, 8, 32, 10), (32, 8, 8, 0)])
def test_warm_up_skips_exactly_the_slot_buckets_no_step_reaches(max_tokens, max_seqs, max_loras,
                                                                skipped):
    """Every step (sequences <= tokens, adapters <= sequences and max_loras) lands on a
    (token, slot) bucket pair that warm-up compiles, and every pair it skips is one that
    no step lands on."""
    t_ladder, s_ladder = buckets.token_buckets(max_tokens), buckets.slot_buckets(max_loras)
    reached = {(buckets.pick(t_ladder, tokens), buckets.pick(s_ladder, adapters))
               for seqs in range(1, max_seqs + 1) for tokens in range(seqs, max_tokens + 1)
               for adapters in range(0, min(seqs, max_loras) + 1)}
    compiled = {(t, s) for t in t_ladder for s in s_ladder
                if buckets.slots_reachable(t, s, s_ladder, max_seqs)}
    assert reached == compiled
    assert len(t_ladder) * len(s_ladder) - len(compiled) == skipped
