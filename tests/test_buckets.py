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
