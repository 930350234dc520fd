"""The float32 loop reference against hand-computed numbers, the segment layout's
invariants, and both xla strategies against the reference in CPU eager torch
(the full sweep is cheap there; the XLA-device sweep is in test_ops_kernels.py)."""

import functools
import itertools

import pytest
import torch

from vllm_tpu_lora.ops import bgmv_xla
from vllm_tpu_lora.ops.bgmv_ref import bgmv_expand_ref, bgmv_expand_slice_ref, bgmv_shrink_ref
from vllm_tpu_lora.ops.testing import DISTRIBUTIONS, assert_close, make_case

NAN = float("nan")


def _hand_inputs():
    """T=3, D=2, R=2, O=2, N=3; slot 2 is unused and all NaN."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    lora_a = torch.tensor(
        [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [2.0, 0.0]], [[NAN, NAN], [NAN, NAN]]]
    )
    lora_b = torch.tensor(
        [[[1.0, 2.0], [3.0, 4.0]], [[0.0, 1.0], [1.0, 0.0]], [[NAN, NAN], [NAN, NAN]]]
    )
    idx = torch.tensor([1, -1, 0], dtype=torch.int32)
    scale = torch.tensor([2.0, 0.5, NAN])
    return x, lora_a, lora_b, idx, scale


def test_ref_shrink_by_hand():
    x, lora_a, _, idx, scale = _hand_inputs()
    # token 0: 0.5 * [[1,1],[2,0]] @ [1,2] = 0.5 * [3, 2]; token 1 padding; token 2: 2 * I @ [5,6]
    expected = torch.tensor([[1.5, 1.0], [0.0, 0.0], [10.0, 12.0]])
    torch.testing.assert_close(bgmv_shrink_ref(x, lora_a, idx, scale), expected)


def test_ref_expand_by_hand():
    _, _, lora_b, idx, _ = _hand_inputs()
    y = torch.tensor([[1.5, 1.0], [7.0, 7.0], [10.0, 12.0]])  # row 1 ignored (idx -1)
    base = torch.ones(3, 2)
    # token 0: 1 + [[0,1],[1,0]] @ [1.5,1] = [2, 2.5]; token 2: 1 + [[1,2],[3,4]] @ [10,12]
    expected = torch.tensor([[2.0, 2.5], [1.0, 1.0], [35.0, 79.0]])
    torch.testing.assert_close(bgmv_expand_ref(y, lora_b, idx, base), expected)


def test_ref_expand_slice_by_hand():
    _, _, lora_b, idx, _ = _hand_inputs()
    y = torch.tensor([[1.5, 1.0], [0.0, 0.0], [10.0, 12.0]])
    out = bgmv_expand_slice_ref(y, lora_b, idx, torch.zeros(3, 5), offset=2, size=2)
    expected = torch.tensor([[0.0, 0.0, 1.0, 1.5, 0.0], [0.0] * 5, [0.0, 0.0, 34.0, 78.0, 0.0]])
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="does not fit"):
        bgmv_expand_slice_ref(y, lora_b, idx, torch.zeros(3, 3), offset=2, size=2)


@pytest.mark.parametrize("strategy", ["onehot", "segment"])
def test_xla_strategies_by_hand(strategy):
    x, lora_a, lora_b, idx, scale = _hand_inputs()
    if strategy == "onehot":
        y = bgmv_xla.onehot_shrink(x, lora_a, idx, scale)
        out = bgmv_xla.onehot_expand(y, lora_b, idx, torch.ones(3, 2))
    else:
        layout = bgmv_xla.make_segment_layout(idx, 3, block=2)
        ys = bgmv_xla.segment_shrink(x, lora_a, layout, scale)
        y = bgmv_xla.to_token_order(ys, layout)
        out = bgmv_xla.segment_expand(ys, lora_b, layout, torch.ones(3, 2))
    torch.testing.assert_close(y, torch.tensor([[1.5, 1.0], [0.0, 0.0], [10.0, 12.0]]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.5], [1.0, 1.0], [35.0, 79.0]]))


def test_segment_layout_by_hand():
    idx = torch.tensor([1, -1, 0, 1, 1], dtype=torch.int32)
    lay = bgmv_xla.make_segment_layout(idx, num_slots=3, block=2)
    # slot 0: rows 0-1 = [token 2, pad]; slot 1: rows 2-5 = [0, 3, 4, pad]; rows 6-7 pad.
    assert lay.perm.tolist() == [2, 0, 0, 3, 4, 0, 0, 0]
    assert lay.row_valid.tolist() == [True, False, True, True, True, False, False, False]
    assert lay.dest.tolist() == [2, 0, 0, 3, 4]
    assert lay.block_slot.tolist() == [0, 1, 1, -1]
    assert lay.token_valid.tolist() == [True, False, True, True, True]
    assert lay.block == 2


@pytest.mark.parametrize("num_tokens", [1, 7, 16, 133, 512])
@pytest.mark.parametrize("num_slots", [1, 2, 4, 8])
@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_segment_layout_invariants(num_tokens, num_slots, block, dist):
    idx = make_case(num_tokens, 8, 8, 8, num_slots, torch.float32, dist).idx
    lay = bgmv_xla.make_segment_layout(idx, num_slots, block)
    t_pad = bgmv_xla.padded_num_tokens(num_tokens, num_slots, block)
    assert lay.perm.shape == (t_pad,) and lay.block_slot.shape == (t_pad // block,)
    valid = idx >= 0
    # dest and perm are inverse on real tokens; every real token appears exactly once.
    assert torch.equal(lay.perm[lay.dest[valid].long()], torch.nonzero(valid).flatten().int())
    assert int(lay.row_valid.sum()) == int(valid.sum())
    # Each real row sits in a block of its token's slot; valid blocks form a prefix.
    row_slot = lay.block_slot.repeat_interleave(block)
    assert torch.equal(row_slot[lay.row_valid], idx[lay.perm[lay.row_valid].long()])
    nvalid = int((lay.block_slot >= 0).sum())
    assert (lay.block_slot[:nvalid] >= 0).all() and (lay.block_slot[nvalid:] == -1).all()
    # Within a slot, tokens keep their original order (stable sort).
    for s in range(num_slots):
        rows = lay.perm[lay.row_valid & (row_slot == s)]
        assert torch.equal(rows, torch.sort(rows).values)


SWEEP = list(itertools.product([1, 7, 16, 133, 512], [8, 16, 64], [1, 2, 4, 8], DISTRIBUTIONS))


@functools.cache
def _case_and_ref(t, r, n, dist, dtype):
    """Cached: both strategies check the same case against one reference run."""
    case = make_case(t, 32, 24, r, n, dtype, dist, seed=t + r + n)
    y_ref = bgmv_shrink_ref(case.x, case.lora_a, case.idx, case.scale)
    out_ref = bgmv_expand_slice_ref(case.y, case.lora_b, case.idx, case.base, 0, 24)
    return case, y_ref, out_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("strategy", ["onehot", "segment"])
def test_xla_strategies_sweep_cpu_eager(strategy, dtype):
    """Full T x R x N x distribution sweep in CPU eager torch (one test per strategy
    and dtype, so the reference loops dominate and pytest overhead does not)."""
    for t, r, n, dist in SWEEP:
        case, y_ref, out_ref = _case_and_ref(t, r, n, dist, dtype)
        if strategy == "onehot":
            y = bgmv_xla.onehot_shrink(case.x, case.lora_a, case.idx, case.scale)
            out = bgmv_xla.onehot_expand(case.y, case.lora_b, case.idx, case.base)
        else:
            lay = bgmv_xla.make_segment_layout(case.idx, n, 8)
            ys_out = bgmv_xla.segment_shrink(case.x, case.lora_a, lay, case.scale)
            y = bgmv_xla.to_token_order(ys_out, lay)
            ys = bgmv_xla.to_segment_order(case.y, lay)
            # Padding rows of the segment layout are exact zeros (part of the contract).
            assert (ys_out[~lay.row_valid] == 0).all() and (ys[~lay.row_valid] == 0).all()
            out = bgmv_xla.segment_expand(ys, case.lora_b, lay, case.base)
        assert_close(y, y_ref, dtype)
        assert_close(out, out_ref, dtype)
        # Padding rows are exact: zero shrink output, base passed through bit for bit.
        pad = case.idx < 0
        assert (y[pad] == 0).all() and torch.equal(out[pad], case.base[pad])


def test_expand_slice_leaves_other_columns():
    case = make_case(16, 32, 24, 8, 4, torch.float32, "skewed")
    base = torch.randn(16, 64)
    out_ref = bgmv_expand_slice_ref(case.y, case.lora_b, case.idx, base, 20, 24)
    lay = bgmv_xla.make_segment_layout(case.idx, 4, 8)
    out_seg = bgmv_xla.segment_expand(
        bgmv_xla.to_segment_order(case.y, lay), case.lora_b, lay, base, offset=20, size=24
    )
    out_hot = bgmv_xla.onehot_expand(case.y, case.lora_b, case.idx, base, offset=20, size=24)
    for out in (out_seg, out_hot):
        assert_close(out, out_ref, torch.float32)
        assert torch.equal(out[:, :20], base[:, :20]) and torch.equal(out[:, 44:], base[:, 44:])


def test_shape_errors_name_shapes():
    case = make_case(4, 32, 24, 8, 2, torch.float32, "uniform")
    with pytest.raises(ValueError, match=r"\(4, 31\)"):
        bgmv_xla.onehot_shrink(case.x[:, :31], case.lora_a, case.idx, case.scale)
    lay = bgmv_xla.make_segment_layout(case.idx, 2, 8)
    with pytest.raises(ValueError, match="does not fit"):
        bgmv_xla.segment_expand(torch.zeros(8, 8), case.lora_b, lay, case.base, offset=8)
