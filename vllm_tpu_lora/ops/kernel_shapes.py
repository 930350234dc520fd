"""The Pallas kernel shapes a runner compiles, and the start-up check that each fits
in VMEM. Pure Python (no jax import): the engine can run the check on any backend.

One shape per op x token bucket x slot bucket x LoRA width x rank x dtype. A packed
LoRA layer (qkv, gate_up) runs a shrink over its input width and an expand for each
output slice (lora/punica.py `_pallas_linear`), so a layer contributes its in_features
to the shrink widths and each of its output slices to the expand widths.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.block_sizes import KernelBlocks, kernel_blocks, token_block

OPS = vmem.KERNEL_OPS


class KernelShape(NamedTuple):
    op: str  # "shrink" (features = D) or "expand" (features = O)
    num_tokens: int  # token bucket T, before segment padding
    num_slots: int  # slot bucket N
    features: int
    rank: int
    dtype: str  # "float32" | "bfloat16" | "float16"


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


def lora_layer_kernel_shapes(
    layers: Iterable[tuple[int, Sequence[int]]],
    token_buckets: Sequence[int],
    slot_buckets: Sequence[int],
    rank: int,
    dtype: str,
) -> list[KernelShape]:
    """The shapes of LoRA layers given as (in_features, output_slices) pairs, e.g.
    `[(l.in_features, l.output_slices) for l in lora_manager.layers.values()]`, with
    the kernels' rank = max_lora_rank (the slot buffers are padded to it)."""
    layers = list(layers)
    ins = sorted({d for d, _ in layers if d is not None})  # None: no shrink (a lookup)
    outs = sorted({o for _, slices in layers for o in slices})
    t, s = list(token_buckets), list(slot_buckets)
    shrinks = [k for k in kernel_shapes(t, s, ins, [rank], [dtype]) if k.op == "shrink"]
    expands = [k for k in kernel_shapes(t, s, outs, [rank], [dtype]) if k.op == "expand"]
    return shrinks + expands


def shape_blocks(shape: KernelShape) -> KernelBlocks:
    """The blocks the kernels run this shape with: the token block of its step (token
    bucket over slot bucket, block_sizes.token_block), then the feature tile for it."""
    block = token_block(shape.dtype, "pallas", shape.num_tokens, shape.num_slots)
    return kernel_blocks(shape.op, shape.features, shape.rank, shape.dtype, block)


def _describe(shape: KernelShape) -> str:
    what = "D" if shape.op == "shrink" else "O"
    return (
        f"{shape.op} kernel (token bucket {shape.num_tokens}, slot bucket {shape.num_slots}, "
        f"{what}={shape.features}, rank {shape.rank}, {shape.dtype})"
    )


def check_kernel_budget(
    shapes: Iterable[KernelShape], ceiling_bytes: int = vmem.VMEM_LIMIT_CEILING_BYTES
) -> None:
    """Refuse a configuration whose Pallas kernels cannot fit in VMEM even with an
    explicit vmem_limit_bytes: ValueError naming the first such shape with its blocks,
    the estimated bytes and the allowed ones. `ceiling_bytes` is the largest limit
    allowed (vmem.VMEM_LIMIT_CEILING_BYTES; tests pass a smaller one)."""
    seen = set()
    for shape in shapes:
        # The buckets matter only through the token block: check each width once per block.
        blocks = shape_blocks(shape)
        key = (shape.op, shape.features, shape.rank, shape.dtype, blocks.token_block)
        if key in seen:
            continue
        seen.add(key)
        needed = vmem.required_limit_bytes(blocks.vmem_bytes)
        if needed > ceiling_bytes:
            raise ValueError(
                f"LoRA {_describe(shape)} cannot fit in TPU VMEM: with token block "
                f"{blocks.token_block} and feature tile {blocks.feature_block} it needs "
                f"~{needed / vmem.MiB:.1f} MiB (estimate {blocks.vmem_bytes} bytes + "
                f"{vmem.VMEM_HEADROOM_BYTES // vmem.MiB} MiB headroom), more than the "
                f"{ceiling_bytes / vmem.MiB:.1f} MiB ({ceiling_bytes} bytes) allowed. "
                "Lower max_lora_rank, use a smaller dtype, or a model whose LoRA widths "
                "are multiples of 128 (those can be tiled)."
            )
