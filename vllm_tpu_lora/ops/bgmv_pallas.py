"""Pallas TPU kernels for the LoRA ops on the segment layout, bridged into torch_xla.

The runner's segment layout (built once per step on the host, lora/step_layout.py)
sorts tokens by adapter and pads each adapter's run to the token block B, so every
token block belongs to exactly one adapter. The kernels grid over token blocks and
scalar-prefetch `block_slot`, the DEVICE slot of each block: each BlockSpec index_map
fetches that block's adapter straight from the full stacked buffers [max_loras, ...]
(no per-op copy of the active adapters), and FLOPs are T_pad*R*D, not N*T*R*D.
Unreferenced slots are never loaded, so NaN in them cannot leak.

What the grid order really re-fetches (Pallas skips a DMA when a block index repeats
from one grid step to the next):
- shrink, grid (T_pad/B, D/block_d), D innermost: when D fits one tile (block_d = D,
  the case for widths up to MAX_FEATURE_TILE unless the rank is large, see VMEM
  below) the adapter's [R, D] block index repeats across the consecutive token
  blocks of one adapter, so it streams once per adapter; when D is tiled, the index
  changes every step and the adapter's tiles are re-fetched for each of its token
  blocks (R*D per block: small next to the x blocks at ranks <= 64, comparable to
  them or larger at rank 256-512).
- expand, grid (O/block_o, T_pad/B), token blocks innermost: per O tile, each adapter's
  [block_o, R] tile is fetched once per run of its blocks, i.e. once per adapter per tile.
Trailing padding blocks (block_slot = -1) re-point their index maps at the last valid
block (no new DMA) and write zeros under pl.when.

VMEM: the blocks come from block_sizes.kernel_blocks (the largest feature tile whose
estimate fits Mosaic's default scoped limit, ops/vmem.py); a kernel whose blocks need
more passes an explicit vmem_limit_bytes, computed from its actual blocks, and one
needing more than vmem.VMEM_LIMIT_CEILING_BYTES is refused with a ValueError.

`interpret=True` runs the same kernels on any backend (PJRT CPU); Mosaic on TPU.
Only the matmuls are kernels; the permutation gathers and the scatter back stay
torch ops and reuse the XLA backend's code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.bgmv_xla import (
    SegmentLayout,
    check_shrink_shapes,
    expand_slice_size,
    scatter_back,
)
from vllm_tpu_lora.ops.block_sizes import kernel_blocks


def _fetch_block(i, nvalid_ref):
    # Padding blocks come after all valid ones: point them at the last valid block
    # so the pipeline sees an unchanged block index and issues no DMA.
    return jnp.maximum(jnp.minimum(i, nvalid_ref[0] - 1), 0)


def _fetch_slot(i, slot_ref, nvalid_ref):
    return jnp.maximum(slot_ref[_fetch_block(i, nvalid_ref)], 0)  # -1 (no tokens) -> 0


def _nt_dot(a, b):
    """a [M, K] @ b [N, K].T with float32 accumulation (MXU-native NT matmul)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _check_tiles(name, rows, block, features, tile, what):
    if block <= 0 or rows % block or (block % 8 and block != rows):
        raise ValueError(
            f"{name}: token block {block} must divide T_pad={rows} and be a multiple of 8"
        )
    if tile <= 0 or features % tile or (tile % 128 and tile != features):
        raise ValueError(
            f"{name}: {what} tile {tile} must divide {what}={features} and be a multiple "
            f"of 128 (or equal {what})"
        )


def _vmem_limit(name, op, block, tile, rank, dtype) -> int | None:
    """The explicit vmem_limit_bytes these blocks need (None: Mosaic's default suffices,
    so the compiler parameters stay as before); refuses blocks that need more than
    the ceiling. Computed from the blocks actually used, so an explicit tile (tests,
    benchmarks) gets the limit it needs too."""
    estimate = vmem.kernel_vmem_bytes(op, block, tile, rank, dtype)
    limit = vmem.explicit_vmem_limit(estimate)
    if limit is not None and limit > vmem.VMEM_LIMIT_CEILING_BYTES:
        raise ValueError(
            f"{name}: blocks (token {block}, feature tile {tile}) at rank {rank} "
            f"{vmem.dtype_name(dtype)} need ~{limit // vmem.MiB} MiB of VMEM, more than "
            f"the {vmem.VMEM_LIMIT_CEILING_BYTES // vmem.MiB} MiB allowed"
        )
    return limit


def _shrink_kernel(slot_ref, nvalid_ref, x_ref, w_ref, o_ref, acc_ref):
    i, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(slot_ref[i] >= 0)  # padding blocks skip the matmul and store zeros
    def _accumulate():
        acc_ref[...] += _nt_dot(x_ref[...], w_ref[...].astype(x_ref.dtype))

    @pl.when(k == pl.num_programs(1) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block", "block_d", "interpret"))
def shrink_kernel(block_slot, xs, lora_a, *, block, block_d=None, interpret=False):
    """Semantics: ys[r] = xs[r] @ lora_a[block_slot[r // B]].T, 0 in blocks with slot -1.

    Shapes: block_slot int32 [T_pad/B], xs [T_pad, D] (segment layout), lora_a
    [N, R, D] -> ys [T_pad, R] (xs.dtype). Grid (T_pad/B, D/block_d); D is the
    reduction axis, accumulated in a float32 VMEM scratch. block_d defaults to the
    VMEM-budgeted tile of block_sizes.kernel_blocks.
    """
    (t_pad, d), d_w = xs.shape, lora_a.shape[2]
    if block_d is None:
        block_d = kernel_blocks("shrink", d, lora_a.shape[1], xs.dtype).feature_block
    if d_w != d or block_slot.shape != (t_pad // max(block, 1),):
        raise ValueError(
            f"shrink_kernel: xs {xs.shape}, lora_a {lora_a.shape}, block_slot "
            f"{block_slot.shape} do not match [T_pad, D], [N, R, D], [T_pad/{block}]"
        )
    _check_tiles("shrink_kernel", t_pad, block, d, block_d, "D")
    limit = _vmem_limit("shrink_kernel", "shrink", block, block_d, lora_a.shape[1], xs.dtype)
    return shrink_pallas_call(
        block_slot,
        xs,
        lora_a,
        block=block,
        block_d=block_d,
        interpret=interpret,
        vmem_limit_bytes=limit,
    )


def shrink_pallas_call(block_slot, xs, lora_a, *, block, block_d, interpret, vmem_limit_bytes=None):
    """The unvalidated pallas_call behind shrink_kernel (tests feed it illegal tiles
    to show that Mosaic itself rejects them). vmem_limit_bytes None keeps Mosaic's
    default scoped VMEM limit."""
    (t_pad, d), rank = xs.shape, lora_a.shape[1]
    nvalid = jnp.sum(block_slot >= 0, dtype=jnp.int32).reshape(1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(t_pad // block, d // block_d),
        in_specs=[
            pl.BlockSpec((block, block_d), lambda i, k, s, v: (_fetch_block(i, v), k)),
            pl.BlockSpec((None, rank, block_d), lambda i, k, s, v: (_fetch_slot(i, s, v), 0, k)),
        ],
        out_specs=pl.BlockSpec((block, rank), lambda i, k, s, v: (i, 0)),
        scratch_shapes=[pltpu.VMEM((block, rank), jnp.float32)],
    )
    return pl.pallas_call(
        _shrink_kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, rank), xs.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="lora_segment_shrink",
    )(block_slot.astype(jnp.int32), nvalid, xs, lora_a)


def _expand_kernel(slot_ref, nvalid_ref, y_ref, w_ref, o_ref):
    i = pl.program_id(1)

    @pl.when(slot_ref[i] >= 0)
    def _compute():
        o_ref[...] = _nt_dot(y_ref[...], w_ref[...].astype(y_ref.dtype)).astype(o_ref.dtype)

    @pl.when(slot_ref[i] < 0)
    def _zero():
        o_ref[...] = jnp.zeros_like(o_ref)


@functools.partial(jax.jit, static_argnames=("block", "block_o", "interpret"))
def expand_kernel(block_slot, ys, lora_b, *, block, block_o=None, interpret=False):
    """Semantics: zs[r] = ys[r] @ lora_b[block_slot[r // B]].T, 0 in blocks with slot -1.

    Shapes: block_slot int32 [T_pad/B], ys [T_pad, R] (segment layout), lora_b
    [N, O, R] -> zs [T_pad, O] (ys.dtype). Grid (O/block_o, T_pad/B): token blocks
    innermost, so one adapter's [block_o, R] tile is fetched once per run of blocks.
    block_o defaults to the VMEM-budgeted tile of block_sizes.kernel_blocks.
    """
    (t_pad, rank), (o, rank_w) = ys.shape, lora_b.shape[1:]
    if block_o is None:
        block_o = kernel_blocks("expand", o, rank, ys.dtype).feature_block
    if rank_w != rank or block_slot.shape != (t_pad // max(block, 1),):
        raise ValueError(
            f"expand_kernel: ys {ys.shape}, lora_b {lora_b.shape}, block_slot "
            f"{block_slot.shape} do not match [T_pad, R], [N, O, R], [T_pad/{block}]"
        )
    _check_tiles("expand_kernel", t_pad, block, o, block_o, "O")
    limit = _vmem_limit("expand_kernel", "expand", block, block_o, rank, ys.dtype)
    return expand_pallas_call(
        block_slot,
        ys,
        lora_b,
        block=block,
        block_o=block_o,
        interpret=interpret,
        vmem_limit_bytes=limit,
    )


def expand_pallas_call(block_slot, ys, lora_b, *, block, block_o, interpret, vmem_limit_bytes=None):
    """The unvalidated pallas_call behind expand_kernel."""
    (t_pad, rank), o = ys.shape, lora_b.shape[1]
    nvalid = jnp.sum(block_slot >= 0, dtype=jnp.int32).reshape(1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(o // block_o, t_pad // block),
        in_specs=[
            pl.BlockSpec((block, rank), lambda j, i, s, v: (_fetch_block(i, v), 0)),
            pl.BlockSpec((None, block_o, rank), lambda j, i, s, v: (_fetch_slot(i, s, v), j, 0)),
        ],
        out_specs=pl.BlockSpec((block, block_o), lambda j, i, s, v: (i, j)),
    )
    return pl.pallas_call(
        _expand_kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, o), ys.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="lora_segment_expand",
    )(block_slot.astype(jnp.int32), nvalid, ys, lora_b)


# ---- torch side: reach the kernels from the torch_xla graph through call_jax ----


def default_interpret() -> bool:
    """Mosaic on a TPU, the Pallas interpreter everywhere else (PJRT CPU)."""
    from vllm_tpu_lora import platform

    return not platform.is_tpu()


@functools.cache
def _bound(kernel, **static):
    # call_jax caches its traced computation by id(jax_func): hand it one stable
    # function object per static configuration, or it would re-trace every call.
    return functools.partial(kernel, **static)


def _call_jax(fn, args):
    from torch_xla.core import xla_builder

    return xla_builder.call_jax(fn, args)


# The kernels enter torch as custom ops: dynamo (torch.compile, backend="openxla")
# cannot trace into call_jax (it hits a pybind builtin), but it keeps a custom op
# opaque, and the openxla bridge then runs the op on lazy tensors, i.e. call_jax.
@torch.library.custom_op("vllm_tpu_lora::lora_shrink_kernel", mutates_args=())
def _shrink_op(
    block_slot: torch.Tensor,
    xs: torch.Tensor,
    lora_a: torch.Tensor,
    block: int,
    block_d: int,
    interpret: bool,
) -> torch.Tensor:
    fn = _bound(shrink_kernel, block=block, block_d=block_d, interpret=interpret)
    return _call_jax(fn, (block_slot, xs, lora_a))


@_shrink_op.register_fake
def _(block_slot, xs, lora_a, block, block_d, interpret):
    return xs.new_empty((xs.shape[0], lora_a.shape[1]))


@torch.library.custom_op("vllm_tpu_lora::lora_expand_kernel", mutates_args=())
def _expand_op(
    block_slot: torch.Tensor,
    ys: torch.Tensor,
    lora_b: torch.Tensor,
    block: int,
    block_o: int,
    interpret: bool,
) -> torch.Tensor:
    fn = _bound(expand_kernel, block=block, block_o=block_o, interpret=interpret)
    return _call_jax(fn, (block_slot, ys, lora_b))


@_expand_op.register_fake
def _(block_slot, ys, lora_b, block, block_o, interpret):
    return ys.new_empty((ys.shape[0], lora_b.shape[1]))


def segment_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    layout: SegmentLayout,
    scale: torch.Tensor,
    *,
    block_d: int | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Semantics: ys[r] = scale[s] * x[perm[r]] @ lora_a[s].T, s = block_slot[r // B];
    rows without a token are exactly zero.

    Shapes: x [T, D], lora_a [N, R, D], scale [N] -> ys [T_pad, R] (x.dtype), XLA
    tensors. The matmul is `shrink_kernel`; the gather and scaling are torch ops.
    """
    check_shrink_shapes(x, lora_a, scale)
    interpret = default_interpret() if interpret is None else interpret
    if block_d is None:  # the same lookup as the TPU export (pallas_export.kernel_call)
        block_d = kernel_blocks("shrink", x.shape[1], lora_a.shape[1], x.dtype).feature_block
    xs = x.index_select(0, layout.perm)
    ys = _shrink_op(layout.block_slot, xs, lora_a.to(x.dtype), layout.block, block_d, interpret)
    b, t_pad, rank = layout.block, ys.shape[0], ys.shape[1]
    row_scale = scale.index_select(0, layout.block_slot.clamp(min=0)).float()
    ys = (ys.float().view(t_pad // b, b, rank) * row_scale[:, None, None]).view(t_pad, rank)
    # Rows past a slot's token count (inside a valid block) carry a copy of x[0]'s product.
    return torch.where(layout.row_valid[:, None], ys, torch.zeros_like(ys)).to(x.dtype)


def segment_expand(
    ys: torch.Tensor,
    lora_b: torch.Tensor,
    layout: SegmentLayout,
    base: torch.Tensor,
    offset: int = 0,
    size: int | None = None,
    *,
    block_o: int | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Semantics: out[t, offset:offset+size] = base[t, ...] + ys[dest[t]] @ lora_b[idx[t]].T.

    Shapes: ys [T_pad, R] (segment layout), lora_b [N, size, R], base [T, O_total]
    -> [T, O_total] (base.dtype), XLA tensors; rows with idx < 0 and other columns
    unchanged. The matmul is `expand_kernel`; the scatter back is torch ops.
    """
    size = expand_slice_size(lora_b, base, offset, size)
    interpret = default_interpret() if interpret is None else interpret
    if block_o is None:
        block_o = kernel_blocks("expand", size, ys.shape[1], ys.dtype).feature_block
    zs = _expand_op(layout.block_slot, ys, lora_b.to(ys.dtype), layout.block, block_o, interpret)
    return scatter_back(zs, layout, base, offset, size)
