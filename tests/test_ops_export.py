"""Lower the Pallas kernels for TPU (Mosaic) on this CPU-only host with jax.export,
for the shapes the runner uses, and show that illegal block shapes are rejected."""

import functools

import jax
import jax.numpy as jnp
import pytest

from tests.test_ops_vmem import CONFIGS, realistic_shapes
from tests.test_ops_vmem import RANKS as REALISTIC_RANKS
from vllm_tpu_lora.ops import bgmv_pallas
from vllm_tpu_lora.ops.bgmv_xla import padded_num_tokens
from vllm_tpu_lora.ops.block_sizes import pallas_token_blocks
from vllm_tpu_lora.ops.kernel_shapes import shape_blocks
from vllm_tpu_lora.ops.pallas_export import (
    KernelShape,
    export_for_tpu,
    export_shape,
    kernel_call,
    kernel_shapes,
)

TOKEN_BUCKETS = [16, 32, 64, 128, 256, 512]
FEATURES = [256, 512, 1024, 1536, 2816]
RANKS = [8, 16, 64]
SLOTS = [1, 2, 4, 8]
DTYPES = ["bfloat16", "float32"]

# Covering set, not the full product (~1,400 lowerings): every width x rank x dtype
# at one (T, N), plus every token bucket x slot bucket at one width.
SHAPES = kernel_shapes([128], [4], FEATURES, RANKS, DTYPES) + kernel_shapes(
    TOKEN_BUCKETS, SLOTS, [1536], [16], DTYPES
)


def _id(s: KernelShape) -> str:
    return f"{s.op}-T{s.num_tokens}-N{s.num_slots}-F{s.features}-R{s.rank}-{s.dtype}"


def test_kernel_shapes_lists_ops_and_skips_slot_bucket_zero():
    shapes = kernel_shapes([16, 16], [0, 2], [256], [8])
    assert shapes == [
        KernelShape("shrink", 16, 2, 256, 8, "bfloat16"),
        KernelShape("expand", 16, 2, 256, 8, "bfloat16"),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lower_for_tpu(dtype):
    """One test per dtype looping over its shapes: a lowering takes ~50 ms, a pytest
    item would cost as much again."""
    shapes = [s for s in SHAPES if s.dtype == dtype]
    assert len(shapes) >= 60
    for shape in shapes:
        exported = export_shape(shape)
        assert exported.platforms == ("tpu",), _id(shape)
        # The kernel really became a Mosaic custom call, not an XLA fallback.
        assert "tpu_custom_call" in exported.mlir_module(), _id(shape)


def test_feature_tiling_lowers():
    """D / O split into 128-multiple tiles (the accumulator path) is TPU-legal too."""
    fn, args = kernel_call(KernelShape("shrink", 64, 4, 2816, 16, "float32"))
    export_for_tpu(functools.partial(fn, block_d=1408), args)
    fn, args = kernel_call(KernelShape("expand", 64, 4, 2816, 16, "float32"))
    export_for_tpu(functools.partial(fn, block_o=256), args)


ILLEGAL = [  # (op, block, tile): each breaks the (8, 128)-or-full-dim rule once
    ("shrink", 8, 64),  # D tile 64 is neither a multiple of 128 nor D
    ("shrink", 4, 256),  # token block 4 is neither a multiple of 8 nor T_pad
    ("expand", 8, 64),
    ("expand", 4, 256),
]


@pytest.mark.parametrize("op,block,tile", ILLEGAL)
def test_mosaic_rejects_illegal_block_shapes(op, block, tile):
    """The unvalidated pallas_call lets the bad tile through to the TPU lowering,
    which must refuse it; the public kernels refuse it earlier with their own error."""
    t_pad, d, r, n = 64, 256, 16, 4
    slots = jax.ShapeDtypeStruct((t_pad // block,), jnp.int32)
    if op == "shrink":
        raw, checked, args = (
            bgmv_pallas.shrink_pallas_call,
            bgmv_pallas.shrink_kernel,
            (
                jax.ShapeDtypeStruct((t_pad, d), jnp.float32),
                jax.ShapeDtypeStruct((n, r, d), jnp.float32),
            ),
        )
        tile_kw = "block_d"
    else:
        raw, checked, args = (
            bgmv_pallas.expand_pallas_call,
            bgmv_pallas.expand_kernel,
            (
                jax.ShapeDtypeStruct((t_pad, r), jnp.float32),
                jax.ShapeDtypeStruct((n, d, r), jnp.float32),
            ),
        )
        tile_kw = "block_o"
    raw_fn = functools.partial(raw, block=block, interpret=False, **{tile_kw: tile})
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        export_for_tpu(raw_fn, (slots, *args))
    checked_fn = functools.partial(checked, block=block, **{tile_kw: tile})
    with pytest.raises(ValueError, match=f"must divide|token block {block}"):
        export_for_tpu(checked_fn, (slots, *args))


# ---- realistic configurations: Llama-3-8B, Qwen2.5-7B, Gemma-2-9B, ranks 8-256, bf16 ----


def _realistic_kernels():
    """Representative shapes of every distinct kernel of the three realistic configs
    (tests/test_ops_vmem.py lists all their shapes: 7 LoRA linears, packed qkv and
    gate_up slices, token buckets 16-512, slot buckets 1-8, ranks 8-256, bf16).

    A kernel's body depends only on (op, width, rank, dtype, blocks); the buckets pick
    the token block (block_sizes.PALLAS_STEP_BLOCKS) and T_pad, i.e. the grid length
    and the array shapes. So every distinct
    (op, width, rank, dtype, blocks) is lowered at the smallest and at the largest
    T_pad its shapes have, and every T_pad (all 24 bucket pairs) once per op at the
    configs' widest width and largest rank: 432 lowerings (~33 ms each here) for the
    1,584 distinct shapes, each distinct kernel body and grid length at least once."""
    shapes = [s for name in CONFIGS for s in realistic_shapes(name)]
    groups: dict[tuple, list[KernelShape]] = {}
    for s in dict.fromkeys(shapes):
        groups.setdefault((s.op, s.features, s.rank, s.dtype, _blocks(s)), []).append(s)
    chosen = []
    for group in groups.values():
        by_rows = sorted(group, key=_t_pad)
        chosen += [by_rows[0], by_rows[-1]]
    widest = max(s.features for s in shapes)
    chosen += [s for s in shapes if s.features == widest and s.rank == max(REALISTIC_RANKS)]
    return list(dict.fromkeys(chosen)), groups


def _blocks(s: KernelShape):
    return shape_blocks(s)


def _t_pad(s: KernelShape) -> int:
    return padded_num_tokens(s.num_tokens, s.num_slots, _blocks(s).token_block)


def test_realistic_configs_lower_for_tpu():
    """jax.export lowering for TPU of every distinct kernel of the realistic configs
    (see _realistic_kernels for what is covered)."""
    chosen, groups = _realistic_kernels()
    # 4 shrink + 7 expand widths, 6 ranks, each at every token block a step may use
    assert len(groups) == 11 * len(REALISTIC_RANKS) * len(pallas_token_blocks("bfloat16"))
    assert {(s.num_tokens, s.num_slots) for s in chosen} >= {
        (t, n) for t in TOKEN_BUCKETS for n in SLOTS
    }
    for shape in chosen:
        exported = export_shape(shape)
        mlir = exported.mlir_module()
        assert "tpu_custom_call" in mlir, _id(shape)
        # They all fit Mosaic's default scoped VMEM: no explicit limit is passed
        # (jax writes vmem_limit_bytes as the custom call's scoped_memory_configs).
        assert "scoped_memory_configs" not in mlir, _id(shape)


def test_explicit_vmem_limit_reaches_the_tpu_custom_call():
    """An untileable width at rank 512 (f32) needs more than the default scoped VMEM:
    the kernel lowers with the explicit limit of block_sizes.kernel_blocks."""
    shape = KernelShape("shrink", 16, 1, 4100, 512, "float32")
    limit = _blocks(shape).vmem_limit_bytes
    assert limit is not None
    mlir = export_shape(shape).mlir_module().replace("\\22", '"')  # MLIR escapes quotes
    assert f'"scoped_memory_configs": [{{"memory_space":1, "offset": 0, "size": {limit}}}]' in mlir


def test_kernel_refuses_blocks_over_the_vmem_ceiling():
    fn, args = kernel_call(KernelShape("expand", 16, 1, 16388, 512, "float32"))
    with pytest.raises(ValueError, match="expand_kernel: blocks .* more than the 48 MiB allowed"):
        export_for_tpu(fn, args)
