"""Pallas TPU kernels for the LoRA ops, called from torch code: the torch half.

The kernels themselves (grid order, what they re-fetch, VMEM) are in
ops/pallas_kernels.py, which imports no torch; this module calls them from torch code,
with the permutation gathers and the scatter back as torch ops that reuse the XLA
backend's code. On the torch_xla runtime they are torch custom ops reached through
torch_xla's call_jax; on the jax runtime (torchax tensors) the kernel is called natively
inside the jitted step (torchax's call_jax).
`interpret=True` runs the same kernels on any backend (PJRT CPU); Mosaic on TPU.
"""

from __future__ import annotations

import functools

import torch

from vllm_tpu_lora.ops.bgmv_xla import (
    SegmentLayout,
    check_shrink_shapes,
    expand_slice_size,
    scatter_back,
)
from vllm_tpu_lora.ops.block_sizes import kernel_blocks, pallas_compute_dtype
from vllm_tpu_lora.ops.grouped_lora import grouped_delta, grouped_delta_one
from vllm_tpu_lora.ops.indexed_lora import indexed_lora
from vllm_tpu_lora.ops.pallas_kernels import (  # noqa: F401  (re-exported for callers/tests)
    expand_kernel,
    expand_pallas_call,
    jax_matmul_precision,
    shrink_kernel,
    shrink_pallas_call,
    traced_without_x64,
)
from vllm_tpu_lora.torchax_compat import is_torchax_tensor


def default_interpret() -> bool:
    """Mosaic on a TPU, the Pallas interpreter everywhere else (PJRT CPU)."""
    from vllm_tpu_lora import platform

    return not platform.is_tpu()


@functools.cache
def _bound(kernel, **static):
    # call_jax caches its traced computation by id(jax_func): hand it one stable
    # function object per static configuration, or it would re-trace every call.
    return functools.partial(kernel, **static)


def _matmul_precision() -> str:
    """The precision torch_xla traces the model's own matmuls with
    (torch_xla.backends.set_mat_mul_precision): the kernels follow it, so a float32
    engine set to "highest" does not get one-pass bfloat16 LoRA products on a TPU."""
    import torch_xla.backends

    return torch_xla.backends.get_mat_mul_precision()


def _run_kernel(kernel, op, static: dict, *tensors):
    """The kernel on these tensors: natively on the jax runtime, else the custom op."""
    if is_torchax_tensor(tensors[0]):
        from torchax import interop

        fn = _bound(kernel, **static, precision=jax_matmul_precision())
        return interop.call_jax(traced_without_x64(fn), *tensors)
    return op(*tensors, **static)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return getattr(torch, pallas_compute_dtype(dtype))


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
    # Read here, inside the op dynamo keeps opaque: dynamo cannot trace torch_xla's getter.
    precision = _matmul_precision()
    fn = _bound(shrink_kernel, block=block, block_d=block_d, interpret=interpret, precision=precision)
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
    # Read here, inside the op dynamo keeps opaque: dynamo cannot trace torch_xla's getter.
    precision = _matmul_precision()
    fn = _bound(expand_kernel, block=block, block_o=block_o, interpret=interpret, precision=precision)
    return _call_jax(fn, (block_slot, ys, lora_b))


@_expand_op.register_fake
def _(block_slot, ys, lora_b, block, block_o, interpret):
    return ys.new_empty((ys.shape[0], lora_b.shape[1]))


@torch.library.custom_op("vllm_tpu_lora::lora_grouped_kernel", mutates_args=())
def _grouped_op(
    token_slot: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    interpret: bool,
) -> torch.Tensor:
    precision = _matmul_precision()
    fn = _bound(grouped_delta_one, interpret=interpret, precision=precision)
    return _call_jax(fn, (x, token_slot, lora_a, lora_b))


@_grouped_op.register_fake
def _(token_slot, x, lora_a, lora_b, interpret):
    return x.new_empty((x.shape[0], lora_b.shape[2]))


def grouped_linear(
    x: torch.Tensor,
    token_slot: torch.Tensor,
    token_valid: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    *,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Semantics: delta[t] = concat_i(x[t] @ lora_a[i][s].T @ lora_b[i][s]) for the device
    slot s = token_slot[t] where token_valid[t], else 0 (ops/grouped_lora.py's fused
    kernel: tokens sorted by slot, slot groups filling 128 lanes).

    Shapes: x [T, D], lora_a[i] [N, R, D], lora_b[i] [N, R, O_i] (rank-first) ->
    [T, sum O_i] (x.dtype). On the jax runtime every slice in one call (one sort of the
    tokens); on torch_xla a custom op per slice."""
    interpret = default_interpret() if interpret is None else interpret
    cdt = _compute_dtype(x.dtype)
    slot = torch.where(token_valid, token_slot.to(torch.int32),
                       torch.full_like(token_slot, -1, dtype=torch.int32))
    xs = x.to(cdt)
    if is_torchax_tensor(x):
        from torchax import interop

        fn = _bound(grouped_delta, interpret=interpret, precision=jax_matmul_precision())
        weights = [(a.to(cdt), b.to(cdt)) for a, b in zip(lora_a, lora_b)]
        return interop.call_jax(traced_without_x64(fn), xs, slot, weights).to(x.dtype)
    deltas = [_grouped_op(slot, xs, a.to(cdt), b.to(cdt), interpret)
              for a, b in zip(lora_a, lora_b)]
    return torch.cat(deltas, dim=1).to(x.dtype)


def indexed_linear(
    x: torch.Tensor,
    token_lora_idx: torch.Tensor,
    active_slots: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    count: torch.Tensor | None = None,
    *,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Semantics: delta[t] = concat_i(x[t] @ lora_a[i][s].T @ lora_b[i][s]) for the device
    slot s = active_slots[token_lora_idx[t]], 0 where token_lora_idx[t] = -1
    (ops/indexed_lora.py: each adapter the step uses read once at its slot by the kernel).
    count int32 [1]: the step's adapters, listed first in active_slots (None: the kernel's
    wrapper finds the used positions on the device).

    Shapes: x [T, D], lora_a[i] [N, R, D], lora_b[i] [N, R, O_i] (rank-first) ->
    [T, sum O_i] (x.dtype). The jax runtime only (torchax tensors): every slice in one
    kernel call."""
    if not is_torchax_tensor(x):
        raise NotImplementedError("indexed_linear runs on the jax runtime only (torchax "
                                  "tensors); torch_xla graphs use the onehot strategy")
    from torchax import interop

    interpret = default_interpret() if interpret is None else interpret
    cdt = _compute_dtype(x.dtype)
    fn = _bound(indexed_lora, interpret=interpret, precision=jax_matmul_precision())
    # The buffers go in as they are (the kernel casts a group at a time: a cast here
    # would read every slot); float16, which a TPU kernel may not cast, goes in as cdt.
    def kept(w):
        return w if w.dtype in (torch.float32, torch.bfloat16) else w.to(cdt)

    weights = [(kept(a), kept(b)) for a, b in zip(lora_a, lora_b)]
    extra = () if count is None else (count.to(torch.int32),)
    return interop.call_jax(traced_without_x64(fn), x.to(cdt), weights,
                            token_lora_idx.to(torch.int32),
                            active_slots.to(torch.int32), *extra).to(x.dtype)


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
    tensors. The matmul is `shrink_kernel` (in float32 for float16 activations,
    block_sizes.PALLAS_COMPUTE_DTYPE); the gather and scaling are torch ops.
    """
    check_shrink_shapes(x, lora_a, scale)
    interpret = default_interpret() if interpret is None else interpret
    if block_d is None:  # the same lookup as the TPU export (pallas_export.kernel_call)
        block_d = kernel_blocks("shrink", x.shape[1], lora_a.shape[1], x.dtype,
                                layout.block).feature_block
    cdt = _compute_dtype(x.dtype)
    xs = x.index_select(0, layout.perm).to(cdt)
    ys = _run_kernel(shrink_kernel, _shrink_op,
                     dict(block=layout.block, block_d=block_d, interpret=interpret),
                     layout.block_slot, xs, lora_a.to(cdt))
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
    unchanged. The matmul is `expand_kernel` (float32 for float16, as in segment_shrink);
    the scatter back is torch ops.
    """
    size = expand_slice_size(lora_b, base, offset, size)
    interpret = default_interpret() if interpret is None else interpret
    if block_o is None:
        block_o = kernel_blocks("expand", size, ys.shape[1], ys.dtype, layout.block).feature_block
    cdt = _compute_dtype(ys.dtype)
    zs = _run_kernel(expand_kernel, _expand_op,
                     dict(block=layout.block, block_o=block_o, interpret=interpret),
                     layout.block_slot, ys.to(cdt), lora_b.to(cdt))
    return scatter_back(zs, layout, base, offset, size)
