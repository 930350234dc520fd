"""List the Pallas kernel shapes a runner compiles and lower them for TPU on any host.

`jax.export.export(jax.jit(f), platforms=["tpu"])` runs the Pallas -> Mosaic
lowering without a TPU, which is where illegal block shapes are rejected (last two
block dims divisible by (8, 128) or equal to the array dims). It does NOT run the
Mosaic compiler itself (that happens on the TPU), so VMEM overflows or unsupported
matmul shapes can still only surface there.

A runner lists its shapes with `kernel_shapes(...)` (one per op x token bucket x
slot bucket x LoRA module width x rank x dtype) and tests call `export_for_tpu` on
each, so every shape precompiled on a TPU has been lowered in CI.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.export  # not imported by `import jax` in 0.7.1
import jax.numpy as jnp

from vllm_tpu_lora.ops import bgmv_pallas
from vllm_tpu_lora.ops.bgmv_xla import padded_num_tokens
from vllm_tpu_lora.ops.block_sizes import feature_block, token_block

OPS = ("shrink", "expand")


class KernelShape(NamedTuple):
    op: str  # "shrink" (features = D) or "expand" (features = O)
    num_tokens: int  # token bucket T, before segment padding
    num_slots: int  # slot bucket N
    features: int
    rank: int
    dtype: str  # "float32" | "bfloat16"


def kernel_shapes(
    token_buckets: Iterable[int],
    slot_buckets: Iterable[int],
    feature_dims: Iterable[int],
    ranks: Iterable[int],
    dtypes: Iterable[str] = ("bfloat16",),
) -> list[KernelShape]:
    """Every (op, T, N, features, R, dtype) combination, deduplicated, in stable order.
    Slot bucket 0 is skipped: the base-only graph traces no LoRA op."""
    combos = itertools.product(OPS, token_buckets, slot_buckets, feature_dims, ranks, dtypes)
    return list(dict.fromkeys(KernelShape(*c) for c in combos if c[2] > 0))


def kernel_call(shape: KernelShape):
    """(jax function of arrays only, its argument ShapeDtypeStructs) for one shape,
    with the block sizes the torch wrappers would pick (block_sizes.py)."""
    dtype = jnp.dtype(shape.dtype)
    block = token_block(shape.dtype, "pallas")
    t_pad = padded_num_tokens(shape.num_tokens, shape.num_slots, block)
    tile = feature_block(shape.features, shape.dtype)
    n, f, r = shape.num_slots, shape.features, shape.rank
    slots = jax.ShapeDtypeStruct((t_pad // block,), jnp.int32)
    if shape.op == "shrink":
        fn = functools.partial(bgmv_pallas.shrink_kernel, block=block, block_d=tile)
        args = (jax.ShapeDtypeStruct((t_pad, f), dtype), jax.ShapeDtypeStruct((n, r, f), dtype))
    elif shape.op == "expand":
        fn = functools.partial(bgmv_pallas.expand_kernel, block=block, block_o=tile)
        args = (jax.ShapeDtypeStruct((t_pad, r), dtype), jax.ShapeDtypeStruct((n, f, r), dtype))
    else:
        raise ValueError(f"unknown kernel op {shape.op!r}; expected one of {OPS}")
    return fn, (slots, *args)


def export_for_tpu(fn, args) -> jax.export.Exported:
    """Lower `fn(*args)` for TPU (Mosaic) on this host; raises on illegal kernels."""
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)


def export_shape(shape: KernelShape) -> jax.export.Exported:
    return export_for_tpu(*kernel_call(shape))
