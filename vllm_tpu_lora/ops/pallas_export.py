"""List the Pallas kernel shapes a runner compiles and lower them for TPU on any host.

`jax.export.export(jax.jit(f), platforms=["tpu"])` runs the Pallas -> Mosaic
lowering without a TPU, which is where illegal block shapes are rejected (last two
block dims divisible by (8, 128) or equal to the array dims). It does NOT run the
Mosaic compiler itself (that happens on the TPU), so VMEM overflows or unsupported
matmul shapes can still only surface there.

A runner lists its shapes with `kernel_shapes(...)` (ops/kernel_shapes.py: one per
op x token bucket x slot bucket x LoRA module width x rank x dtype) and tests call
`export_for_tpu` on each, so every shape precompiled on a TPU has been lowered in CI.
VMEM is budgeted separately, by estimate (ops/vmem.py, tests/test_ops_vmem.py).
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.export  # not imported by `import jax` in 0.7.1
import jax.numpy as jnp

from vllm_tpu_lora.ops import bgmv_pallas
from vllm_tpu_lora.ops.bgmv_xla import padded_num_tokens
from vllm_tpu_lora.ops.block_sizes import pallas_compute_dtype
from vllm_tpu_lora.ops.kernel_shapes import OPS, KernelShape, kernel_shapes, shape_blocks

__all__ = ["KernelShape", "export_for_tpu", "export_shape", "kernel_call", "kernel_shapes"]


def kernel_call(shape: KernelShape):
    """(jax function of arrays only, its argument ShapeDtypeStructs) for one shape,
    with the blocks the torch wrappers pick (kernel_shapes.shape_blocks); the kernels
    derive their vmem_limit_bytes from those blocks (ops/vmem.py)."""
    dtype = jnp.dtype(pallas_compute_dtype(shape.dtype))  # float16 runs in float32
    block, tile = shape_blocks(shape)[:2]
    t_pad = padded_num_tokens(shape.num_tokens, shape.num_slots, block)
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


def hbm_operands(exported: jax.export.Exported) -> list[list[int]]:
    """Per Mosaic custom call in the lowered module, the operands pinned to HBM (memory
    space color 0 in its backend config; ops.pallas_kernels.in_hbm)."""
    calls = []
    for config in re.findall(r'custom_call @tpu_custom_call\([^)]*\) \{backend_config = "([^"]*)"',
                             exported.mlir_module()):
        text = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), config)
        colors = json.loads(text)["custom_call_config"].get("input_memory_space_colors", [])
        calls.append([c["operand_index"] for c in colors if c["color"] == 0])
    return calls


def export_shape(shape: KernelShape) -> jax.export.Exported:
    return export_for_tpu(*kernel_call(shape))
