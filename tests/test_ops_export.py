"""Lower the Pallas kernels for TPU (Mosaic) on this CPU-only host with jax.export,
for the shapes the runner uses, and show that illegal block shapes are rejected."""

import functools

import jax
import jax.numpy as jnp
import pytest

from vllm_tpu_lora.ops import bgmv_pallas
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
