"""Both backends on the XLA device (PJRT CPU here; Pallas in interpret mode) and the
Pallas kernels as plain JAX functions, all against the float32 loop reference.

Each distinct shape costs an XLA compile (~0.3-2 s on CPU), so instead of the full
cross product (tested in CPU eager torch in test_ops_ref.py) this file uses a
covering subset: every T, R, N, dtype and index distribution appears at least once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from vllm_tpu_lora import ops, platform
from vllm_tpu_lora.ops import bgmv_pallas, bgmv_xla
from vllm_tpu_lora.ops.bgmv_ref import bgmv_expand_slice_ref, bgmv_shrink_ref
from vllm_tpu_lora.ops.block_sizes import pallas_token_blocks, token_block
from vllm_tpu_lora.ops.testing import assert_close, make_case

F32, BF16 = torch.float32, torch.bfloat16
D, OUT, O_TOTAL, OFFSET = 256, 384, 640, 128
# (T, R, N, dtype, distribution): covers every value of every swept dimension.
CASES = [
    (1, 8, 1, F32, "identical"),
    (7, 16, 2, BF16, "skewed"),
    (16, 64, 4, F32, "distinct"),
    (133, 8, 8, BF16, "uniform"),
    (512, 16, 8, F32, "skewed"),
    (133, 64, 2, F32, "identical"),
]
IMPLS = ["xla-onehot", "xla-segment", "pallas"]


def _case_id(c):
    return f"T{c[0]}-R{c[1]}-N{c[2]}-{'f32' if c[3] == F32 else 'bf16'}-{c[4]}"


@functools.cache
def _case_and_ref(t, r, n, dtype, dist):
    case = make_case(t, D, OUT, r, n, dtype, dist, seed=7 * t + r + n)
    wide = torch.randn(t, O_TOTAL, generator=torch.Generator().manual_seed(t)).to(dtype)
    refs = (
        bgmv_shrink_ref(case.x, case.lora_a, case.idx, case.scale),
        bgmv_expand_slice_ref(case.y, case.lora_b, case.idx, case.base, 0, OUT),
        bgmv_expand_slice_ref(case.y, case.lora_b, case.idx, wide, OFFSET, OUT),
    )
    return case, wide, refs


def _run_impl(impl, case, wide, n, dtype):
    """(shrink y [T,R], expand [T,OUT], expand_slice [T,O_TOTAL]) computed on the XLA device."""
    dev = platform.xla_device()
    x, a, b, idx, s, base, y = (v.to(dev) for v in case)
    wide = wide.to(dev)
    if impl == "xla-onehot":
        return (
            bgmv_xla.onehot_shrink(x, a, idx, s),
            bgmv_xla.onehot_expand(y, b, idx, base),
            bgmv_xla.onehot_expand(y, b, idx, wide, OFFSET, OUT),
        )
    mod, backend = (bgmv_xla, "xla") if impl == "xla-segment" else (bgmv_pallas, "pallas")
    lay = ops.make_segment_layout(idx, n, backend=backend, dtype=dtype)  # the step's block
    ys_in = bgmv_xla.to_segment_order(y, lay)
    return (
        bgmv_xla.to_token_order(mod.segment_shrink(x, a, lay, s), lay),
        mod.segment_expand(ys_in, b, lay, base),
        mod.segment_expand(ys_in, b, lay, wide, OFFSET, OUT),
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,r,n,dtype,dist", CASES, ids=[_case_id(c) for c in CASES])
def test_backends_on_xla_device(impl, t, r, n, dtype, dist):
    case, wide, refs = _case_and_ref(t, r, n, dtype, dist)
    outs = _run_impl(impl, case, wide, n, dtype)
    platform.sync()  # one graph for shrink, expand and expand_slice
    for out, ref in zip(outs, refs, strict=True):
        assert out.dtype == dtype
        assert_close(out, ref, dtype)
    pad = case.idx < 0  # padding tokens: exact zeros / base passed through unchanged
    assert (outs[0].cpu()[pad] == 0).all()
    assert torch.equal(outs[1].cpu()[pad], case.base[pad])


# Steps with many rows per adapter, where the Pallas kernels run a larger token block
# than the base one (block_sizes.PALLAS_STEP_BLOCKS): f32 16, bf16 32 and 64.
STEP_BLOCK_CASES = [
    (64, 16, 4, F32, "skewed", 16),
    (128, 8, 2, BF16, "distinct", 32),
    (256, 16, 1, BF16, "identical", 64),
]


@pytest.mark.parametrize("t,r,n,dtype,dist,block", STEP_BLOCK_CASES,
                         ids=[_case_id(c) for c in STEP_BLOCK_CASES])
def test_pallas_larger_step_blocks(t, r, n, dtype, dist, block):
    assert token_block(dtype, "pallas", t, n) == block > token_block(dtype, "pallas")
    case, wide, refs = _case_and_ref(t, r, n, dtype, dist)
    outs = _run_impl("pallas", case, wide, n, dtype)
    platform.sync()
    for out, ref in zip(outs, refs, strict=True):
        assert_close(out, ref, dtype)
    pad = case.idx < 0
    assert (outs[0].cpu()[pad] == 0).all()


def test_pallas_token_block_follows_rows_per_slot():
    """The step's Pallas token block never shrinks for more tokens nor grows for more
    slots, is one of the blocks the VMEM checks cover, and leaves the xla path alone."""
    tokens, slots = [2**i for i in range(4, 13)], [1, 2, 4, 8, 16, 32]
    for dtype in (F32, BF16, torch.float16):
        base, allowed = token_block(dtype, "pallas"), set(pallas_token_blocks(dtype))
        grid = [[token_block(dtype, "pallas", t, s) for t in tokens] for s in slots]
        for row in grid:
            assert row == sorted(row) and set(row) <= allowed
        for fewer, more in zip(grid, grid[1:]):
            assert all(a >= b for a, b in zip(fewer, more))
        assert grid[-1][0] == base == min(allowed)  # 16 tokens over 32 slots: decode
        assert {b for row in grid for b in row} == allowed  # every block is reachable
        assert token_block(dtype, "xla", 4096, 1) == token_block(dtype, "xla")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_dispatch_api(backend):
    t, r, n, dtype, dist = 133, 16, 4, F32, "skewed"
    case, wide, (y_ref, out_ref, slice_ref) = _case_and_ref(t, r, n, dtype, dist)
    dev = platform.xla_device()
    x, a, b, idx, s, base, y = (v.to(dev) for v in case)
    got = [
        ops.bgmv_shrink(x, a, idx, s, backend=backend),
        ops.bgmv_expand(y, b, idx, base, backend=backend),
        ops.bgmv_expand_slice(y, b, idx, wide.to(dev), OFFSET, OUT, backend=backend),
    ]
    lay = ops.make_segment_layout(idx, n, backend=backend, dtype=dtype)
    ys = ops.segment_shrink(x, a, lay, s, backend=backend)
    got.append(ops.segment_expand(ys, b, lay, base, backend=backend))
    # Chained shrink -> expand through the layout equals expand of the reference shrink.
    chain_ref = bgmv_expand_slice_ref(y_ref, case.lora_b, case.idx, case.base, 0, OUT)
    platform.sync()
    for out, ref in zip(got, [y_ref, out_ref, slice_ref, chain_ref], strict=True):
        assert_close(out, ref, dtype)
    assert (ys.cpu()[~lay.row_valid.cpu()] == 0).all()  # segment padding rows exactly zero


def test_pallas_feature_tiles_on_xla_device():
    """block_d < D exercises the shrink accumulator, block_o < O the expand O grid."""
    case, wide, (y_ref, out_ref, _) = _case_and_ref(16, 64, 4, F32, "distinct")
    dev = platform.xla_device()
    x, a, b, idx, s, base, y = (v.to(dev) for v in case)
    lay = bgmv_xla.make_segment_layout(idx, 4, 8)
    ys = bgmv_pallas.segment_shrink(x, a, lay, s, block_d=128)
    out = bgmv_pallas.segment_expand(bgmv_xla.to_segment_order(y, lay), b, lay, base, block_o=128)
    platform.sync()
    assert_close(bgmv_xla.to_token_order(ys, lay), y_ref, F32)
    assert (ys.cpu()[~lay.row_valid.cpu()] == 0).all()
    assert_close(out, out_ref, F32)


def test_new_indices_and_weights_do_not_recompile():
    """After the first step, a new adapter mix (same shapes) must compile nothing."""
    dev = platform.xla_device()

    def step(dist, seed):
        case = make_case(64, D, OUT, 16, 4, F32, dist, seed=seed)
        x, a, b, idx, s, base, _ = (v.to(dev) for v in case)
        outs = []
        for backend in ("xla", "pallas"):
            lay = ops.make_segment_layout(idx, 4, 8)
            ys = ops.segment_shrink(x, a, lay, s, backend=backend)
            outs.append(ops.segment_expand(ys, b, lay, base, backend=backend))
        platform.sync()
        return case, outs

    step("uniform", 1)
    before = platform.compile_count()
    case, outs = step("skewed", 2)
    assert platform.compile_count() == before
    y_ref = bgmv_shrink_ref(case.x, case.lora_a, case.idx, case.scale)
    ref = bgmv_expand_slice_ref(y_ref, case.lora_b, case.idx, case.base, 0, OUT)
    for out in outs:
        assert_close(out, ref, F32)


def test_resolve_backend():
    assert ops.resolve_backend("auto") == ("pallas" if platform.is_tpu() else "xla")
    assert ops.resolve_backend("pallas") == "pallas"
    with pytest.raises(ValueError, match="'triton'"):
        ops.resolve_backend("triton")
    with pytest.raises(ValueError, match="'cuda'"):
        ops.bgmv_shrink(
            torch.zeros(1, 8),
            torch.zeros(1, 8, 8),
            torch.zeros(1, dtype=torch.int32),
            torch.ones(1),
            backend="cuda",
        )


# ---- the kernels as plain JAX functions (jax's own CPU backend, interpret mode) ----


@pytest.mark.parametrize(
    "t,r,n,dtype,dist,block,tile",
    [
        (133, 16, 4, F32, "skewed", 8, 128),
        (7, 64, 8, BF16, "distinct", 16, None),
        (512, 8, 2, F32, "uniform", 8, None),
    ],
)
def test_pallas_kernels_in_jax(t, r, n, dtype, dist, block, tile):
    case, _, (y_ref, out_ref, _) = _case_and_ref(t, r, n, dtype, dist)
    lay = bgmv_xla.make_segment_layout(case.idx, n, block)
    jdt = jnp.float32 if dtype == F32 else jnp.bfloat16

    def j(t_):
        return jnp.asarray(t_.float().numpy()).astype(jdt)

    slots = jnp.asarray(lay.block_slot.numpy())
    ys = bgmv_pallas.shrink_kernel(
        slots, j(case.x[lay.perm.long()]), j(case.lora_a), block=block, block_d=tile, interpret=True
    )
    zs = bgmv_pallas.expand_kernel(
        slots,
        j(bgmv_xla.to_segment_order(case.y, lay)),
        j(case.lora_b),
        block=block,
        block_o=tile,
        interpret=True,
    )
    ys = torch.from_numpy(np.array(ys.astype(jnp.float32)))
    zs = torch.from_numpy(np.array(zs.astype(jnp.float32)))
    # Padding blocks are written as exact zeros by the kernel itself.
    pad_rows = (lay.block_slot < 0).repeat_interleave(block)
    assert (ys[pad_rows] == 0).all() and (zs[pad_rows] == 0).all()
    scale = torch.where(case.idx >= 0, case.scale[case.idx.clamp(min=0).long()], 0.0)
    y = torch.where(lay.token_valid[:, None], ys[lay.dest.long()] * scale[:, None], 0.0)
    assert_close(y, y_ref, dtype)
    z = torch.where(lay.token_valid[:, None], zs[lay.dest.long()], 0.0)
    assert_close(z + case.base.float(), out_ref, dtype)


def test_pallas_kernel_value_errors_name_shapes():
    slots = jnp.zeros((8,), jnp.int32)
    xs, a = jnp.zeros((64, 200)), jnp.zeros((4, 8, 200))
    with pytest.raises(ValueError, match="D tile 100 must divide D=200"):
        bgmv_pallas.shrink_kernel(slots, xs, a, block=8, block_d=100, interpret=True)
    with pytest.raises(ValueError, match="token block 4"):
        bgmv_pallas.shrink_kernel(jnp.zeros((16,), jnp.int32), xs, a, block=4, interpret=True)
    with pytest.raises(ValueError, match=r"lora_b \(4, 200, 16\)"):
        bgmv_pallas.expand_kernel(
            slots, jnp.zeros((64, 8)), jnp.zeros((4, 200, 16)), block=8, interpret=True
        )
    assert jax.devices()[0].platform == "cpu"


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_under_torch_compile_openxla(backend):
    """The runner may trace with torch.compile(backend="openxla", fullgraph=True): the
    Pallas path must not graph-break (call_jax is hidden behind a torch custom op)."""
    case, _, (y_ref, _, _) = _case_and_ref(16, 64, 4, F32, "distinct")
    ref = bgmv_expand_slice_ref(y_ref, case.lora_b, case.idx, case.base, 0, OUT)
    dev = platform.xla_device()
    x, a, b, idx, s, base, _ = (v.to(dev) for v in case)

    def step(x, a, b, idx, s, base):
        lay = ops.make_segment_layout(idx, 4, backend=backend)
        ys = ops.segment_shrink(x, a, lay, s, backend=backend)
        return ops.segment_expand(ys, b, lay, base, backend=backend)

    compiled = torch.compile(step, backend="openxla", fullgraph=True, dynamic=False)
    out = compiled(x, a, b, idx, s, base)
    platform.sync()
    assert_close(out, ref, F32)


def test_float16_runs_the_pallas_kernels_in_float32(monkeypatch):
    """Mosaic on TPU v5e cannot load float16 vectors (every float16 kernel failed to
    compile there, benchmarks/tpu_kernels.py), so float16 activations reach the kernels
    as float32, with float32's blocks, and come back as float16."""
    from vllm_tpu_lora.ops.block_sizes import kernel_blocks
    from vllm_tpu_lora.ops.kernel_shapes import KernelShape
    from vllm_tpu_lora.ops.pallas_export import kernel_call

    f16 = torch.float16
    assert token_block(f16, "pallas") == token_block(F32, "pallas")
    assert kernel_blocks("shrink", 4096, 64, f16) == kernel_blocks("shrink", 4096, 64, F32)
    _, args = kernel_call(KernelShape("expand", 16, 2, 1024, 16, "float16"))
    assert {str(a.dtype) for a in args[1:]} == {"float32"}  # what a TPU compiles

    seen = []
    real = bgmv_pallas._call_jax
    monkeypatch.setattr(bgmv_pallas, "_call_jax",
                        lambda fn, a: seen.append([t.dtype for t in a[1:]]) or real(fn, a))
    case = make_case(40, D, OUT, 16, 3, f16, "skewed", seed=3)
    y_ref = bgmv_shrink_ref(case.x, case.lora_a, case.idx, case.scale)
    dev = platform.xla_device()
    x, a, b, idx, s, base, _ = (v.to(dev) for v in case)
    lay = bgmv_xla.make_segment_layout(idx, 3, token_block(f16, "pallas"))
    ys = bgmv_pallas.segment_shrink(x, a, lay, s)
    out = bgmv_pallas.segment_expand(ys, b, lay, base)
    y, out = bgmv_xla.to_token_order(ys, lay).cpu(), out.cpu()
    assert seen == [[F32, F32], [F32, F32]]
    assert y.dtype == out.dtype == f16
    out_ref = bgmv_expand_slice_ref(y, case.lora_b, case.idx, case.base, 0, OUT)
    assert_close(y, y_ref, f16)
    assert_close(out, out_ref, f16)


def test_pallas_kernels_follow_torch_xla_matmul_precision(monkeypatch):
    """On a TPU, "default" multiplies float32 in one bfloat16 pass (~1e-2 relative error
    measured on v5e); a model traced at "highest" must get float32 LoRA products too."""
    import torch_xla.backends

    precisions = []
    real = bgmv_pallas._call_jax
    monkeypatch.setattr(bgmv_pallas, "_call_jax",
                        lambda fn, a: precisions.append(fn.keywords["precision"]) or real(fn, a))
    case = make_case(16, D, OUT, 8, 2, F32, "uniform", seed=5)
    dev = platform.xla_device()
    x, a, _, idx, s, _, _ = (v.to(dev) for v in case)
    lay = bgmv_xla.make_segment_layout(idx, 2, token_block(F32, "pallas"))
    before = torch_xla.backends.get_mat_mul_precision()
    try:
        for p in ("highest", "default"):
            torch_xla.backends.set_mat_mul_precision(p)
            bgmv_pallas.segment_shrink(x, a, lay, s).cpu()
    finally:
        torch_xla.backends.set_mat_mul_precision(before)
    assert precisions == ["highest", "default"]

    # The precision reaches the dot itself (interpret mode lowers it to stablehlo).
    slots, xs, w = jnp.zeros((2,), jnp.int32), jnp.zeros((16, 128)), jnp.zeros((2, 8, 128))
    text = {p: jax.jit(functools.partial(bgmv_pallas.shrink_kernel, block=8, interpret=True,
                                         precision=p)).lower(slots, xs, w).as_text()
            for p in ("default", "highest")}
    assert "HIGHEST" in text["highest"] and "HIGHEST" not in text["default"]
    with pytest.raises(ValueError, match="unknown matmul precision 'fast'"):
        bgmv_pallas.shrink_kernel(slots, xs, w, block=8, interpret=True, precision="fast")
