"""LoRA ops with backend dispatch: "xla" (plain torch ops), "pallas" (Pallas kernel via
call_jax) or "auto" (pallas on TPU, xla elsewhere). This is the op-level meaning of
"auto"; the engine's lora_backend="auto" is resolved by lora/punica.py
`resolve_lora_backend`, which picks the xla backend (on a TPU its onehot strategy) at
every size.

Named dims: T tokens, D in-features, O out-features, R rank, N slots.

Per forward step a caller builds ONE `make_segment_layout(idx, N)` and passes it to
every layer's `segment_shrink` / `segment_expand`; the `bgmv_*` functions are
self-contained compositions for callers that hold only `idx`.
"""

from __future__ import annotations

import torch

from vllm_tpu_lora.ops import bgmv_xla
from vllm_tpu_lora.ops.bgmv_xla import SegmentLayout, padded_num_tokens
from vllm_tpu_lora.ops.block_sizes import token_block
from vllm_tpu_lora.ops.kernel_shapes import (
    KernelShape,
    check_kernel_budget,
    lora_layer_kernel_shapes,
)

BACKENDS = ("xla", "pallas")
# Strategy of the xla backend: "onehot" won on XLA CPU except at N=8, R=16 where
# "segment" was ~20-30% faster (benchmarks/benchmark_ops.py; see bgmv_xla's docstring).
XLA_STRATEGY = "onehot"

__all__ = [
    "BACKENDS",
    "KernelShape",
    "SegmentLayout",
    "bgmv_expand",
    "bgmv_expand_slice",
    "bgmv_shrink",
    "check_kernel_budget",
    "lora_layer_kernel_shapes",
    "make_segment_layout",
    "padded_num_tokens",
    "put_slots",
    "resolve_backend",
    "segment_expand",
    "segment_shrink",
    "take_slots",
]


def resolve_backend(backend: str = "auto") -> str:
    """Map "auto" to "pallas" on TPU and "xla" elsewhere; "xla"/"pallas" pass through."""
    if backend == "auto":
        from vllm_tpu_lora import platform

        return "pallas" if platform.is_tpu() else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {backend!r}; expected 'auto', 'xla' or 'pallas'")
    return backend


# How a jax-runtime graph copies a step's slots out of the buffers (take_slots):
SLOT_COPIES = ("gather", "slices", "dma")


def take_slots(buffers: torch.Tensor | list[torch.Tensor], slots: torch.Tensor,
               copy: str = "gather", dim: int = 1) -> torch.Tensor:
    """buffers [N, ...], slots int [S] (each in range) -> [S, ...]: row i = buffers[slots[i]].
    A list of buffers: each one's rows, concatenated along `dim` (a packed layer's slices).

    copy, inside a jax-runtime graph (elsewhere always a gather):
      "gather"  index_select. A TPU lowers a gather over the slot axis as a pass over all
                N slots: in a v5e profile of a decode step, gathering 8 adapters' [16,
                2048] rows took 0.6 us from 8 slots and 3.4 us from 32, ~the whole
                operand at HBM speed.
      "slices"  S dynamic slices, concatenated: they read the S rows alone, but as many
                small ops (a step of 32 of 128 slots: +7.9 ms on a v5e, seventh session).
      "dma"     one Pallas call of S DMAs per take (ops/slot_copy.py; interpreted off a
                TPU), the slices written side by side."""
    from vllm_tpu_lora.torchax_compat import is_torchax_tensor

    parts = list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]
    if copy not in SLOT_COPIES:
        raise ValueError(f"unknown slot copy {copy!r}; expected one of {SLOT_COPIES}")
    if copy != "gather" and is_torchax_tensor(parts[0]):
        from torchax import interop

        if copy == "dma":
            from vllm_tpu_lora import platform
            from vllm_tpu_lora.ops.slot_copy import take_slots_dma

            return interop.call_jax(take_slots_dma, parts, slots.to(torch.int32),
                                    axis=dim - 1, interpret=not platform.is_tpu())
        taken = [interop.call_jax(_sliced_take, p, slots) for p in parts]
    else:
        taken = [p.index_select(0, slots) for p in parts]
    return taken[0] if len(taken) == 1 else torch.cat(taken, dim=dim)


def put_slots(buffers: torch.Tensor, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """buffers[slots[i]] = rows[i], in place (buffers [N, ...]; rows[i] shaped like a slot,
    or flat with a slot's number of elements).

    Inside a jax-runtime graph: one dynamic-update-slice per row, not a scatter. XLA's CPU
    backend runs a scatter as a loop over its elements.

    On torch_xla: one scatter of flat rows into the buffer seen as [N, slot elements].
    Rows shaped into the slot (a reshape of a slice of a flat image) made XLA:CPU's LLVM
    -O2 take 56 s to compile one 4-slot write of 56 buffers, 2.4 s flat; a single row is
    written twice to the same slot, as a one-row scatter fused with its slice took 11 s
    (2 s written twice)."""
    from vllm_tpu_lora.torchax_compat import is_torchax_tensor

    if is_torchax_tensor(buffers):
        from torchax import interop

        shaped = [r.view(buffers.shape[1:]) for r in rows]
        buffers.copy_(interop.call_jax(_sliced_put, buffers, slots, *shaped))
        return
    flat = [r.reshape(-1) for r in rows]
    if len(flat) == 1:
        flat, slots = flat * 2, slots.repeat(2)
    buffers.view(buffers.shape[0], -1).index_copy_(0, slots, torch.stack(flat))


def _sliced_put(buffers, slots, *rows):
    import jax

    for i, row in enumerate(rows):
        buffers = jax.lax.dynamic_update_index_in_dim(buffers, row, slots[i], 0)
    return buffers


def _sliced_take(buffers, slots):
    import jax

    return jax.numpy.concatenate([jax.lax.dynamic_index_in_dim(buffers, slots[i], 0)
                                  for i in range(slots.shape[0])])


def _use_onehot(backend: str) -> bool:
    return resolve_backend(backend) == "xla" and XLA_STRATEGY == "onehot"


def _impl(backend: str):
    if resolve_backend(backend) == "pallas":
        # Imported lazily: jax + pallas cost ~1 s to import and xla users never need them.
        from vllm_tpu_lora.ops import bgmv_pallas

        return bgmv_pallas
    return bgmv_xla


def make_segment_layout(
    idx: torch.Tensor,
    num_slots: int,
    block: int | None = None,
    *,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
) -> SegmentLayout:
    """Semantics: sort tokens by slot into block-aligned segments, on device.

    Shapes: idx int [T] -> SegmentLayout with T_pad = padded_num_tokens(T, N, B)
    rows. B defaults to block_sizes.token_block(dtype, backend, T, N).
    """
    if block is None:
        block = token_block(dtype, resolve_backend(backend), idx.shape[0], num_slots)
    return bgmv_xla.make_segment_layout(idx, num_slots, block)


def segment_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    layout: SegmentLayout,
    scale: torch.Tensor,
    *,
    backend: str = "auto",
    keep_rank_axis: bool = False,
) -> torch.Tensor:
    """Semantics: ys[r] = scale[s] * x[perm[r]] @ lora_a[s].T, s = slot of row r's block.

    Shapes: x [T, D], lora_a [N, R, D], scale [N] -> ys [T_pad, R] (segment layout,
    padding rows zero). keep_rank_axis: see bgmv_xla.onehot_shrink (the other paths
    never merge N and R).
    """
    if _use_onehot(backend):
        # The layout still carries idx, so the one-hot path keeps the same contract.
        y = bgmv_xla.onehot_shrink(x, lora_a, layout.idx, scale, keep_rank_axis=keep_rank_axis)
        return bgmv_xla.to_segment_order(y, layout)
    return _impl(backend).segment_shrink(x, lora_a, layout, scale)


def segment_expand(
    ys: torch.Tensor,
    lora_b: torch.Tensor,
    layout: SegmentLayout,
    base: torch.Tensor,
    offset: int = 0,
    size: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Semantics: out[t, offset:offset+size] = base[t, offset:offset+size] + ys[dest[t]] @ lora_b[idx[t]].T.

    Shapes: ys [T_pad, R], lora_b [N, size, R], base [T, O_total] -> [T, O_total];
    rows with idx < 0 and columns outside the slice are base unchanged.
    """
    if _use_onehot(backend):
        y = bgmv_xla.to_token_order(ys, layout)
        return bgmv_xla.onehot_expand(y, lora_b, layout.idx, base, offset, size)
    return _impl(backend).segment_expand(ys, lora_b, layout, base, offset, size)


def _layout_for(idx: torch.Tensor, num_slots: int, backend: str, dtype) -> SegmentLayout:
    return bgmv_xla.make_segment_layout(idx, num_slots,
                                        token_block(dtype, backend, idx.shape[0], num_slots))


def bgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Semantics: y[t] = scale[idx[t]] * x[t] @ lora_a[idx[t]].T, y[t] = 0 where idx[t] < 0.

    Shapes: x [T, D], lora_a [N, R, D], idx int32 [T], scale [N] -> y [T, R] (x.dtype).
    """
    if _use_onehot(backend):
        return bgmv_xla.onehot_shrink(x, lora_a, idx, scale)
    backend = resolve_backend(backend)
    layout = _layout_for(idx, lora_a.shape[0], backend, x.dtype)
    ys = _impl(backend).segment_shrink(x, lora_a, layout, scale)
    return bgmv_xla.to_token_order(ys, layout)


def bgmv_expand_slice(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    idx: torch.Tensor,
    base: torch.Tensor,
    offset: int,
    size: int,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Semantics: out[t, offset:offset+size] = base[t, offset:offset+size] + y[t] @ lora_b[idx[t]].T.

    Shapes: y [T, R], lora_b [N, size, R], idx int32 [T], base [T, O_total] ->
    [T, O_total] (base.dtype); rows with idx < 0 and other columns unchanged.
    """
    if _use_onehot(backend):
        return bgmv_xla.onehot_expand(y, lora_b, idx, base, offset, size)
    backend = resolve_backend(backend)
    layout = _layout_for(idx, lora_b.shape[0], backend, y.dtype)
    ys = bgmv_xla.to_segment_order(y, layout)
    return _impl(backend).segment_expand(ys, lora_b, layout, base, offset, size)


def bgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    idx: torch.Tensor,
    base: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Semantics: out[t] = base[t] + y[t] @ lora_b[idx[t]].T, out[t] = base[t] where idx[t] < 0.

    Shapes: y [T, R], lora_b [N, O, R], idx int32 [T], base [T, O] -> [T, O] (base.dtype).
    """
    return bgmv_expand_slice(y, lora_b, idx, base, 0, lora_b.shape[1], backend=backend)
