"""LoRA ops as plain torch ops that trace into one static-shape XLA graph.

Two strategies, both without data-dependent shapes or host syncs (no .item()):

* one-hot ("onehot", the default of the xla backend): every token is multiplied by
  every slot's adapter in ONE dense matmul ([T, D] @ [D, N*R]) and the wanted
  product is selected with a one-hot mask. Gather-free; FLOPs N*T*R*D. On XLA CPU
  (benchmarks/benchmark_ops.py, T=256, D=O=1024) it won at N <= 2 and at rank 64
  (1.5-3x: the segment path materialises a [T_pad/B, R, D] weight gather per op)
  and lost ~20-30% only at N=8, R=16; on TPU, N*R <= 128..256 lanes costs the MXU
  no more than R lanes.
* segment ("segment"): tokens are sorted by slot ON DEVICE and each slot's run is
  padded to a token block B, so a whole block shares one adapter and one batched
  matmul does the work: FLOPs T_pad*R*D with T_pad <= T + min(N, T)*B. The layout
  depends only on the LoRA indices, so a caller builds it once per forward step
  (`make_segment_layout`) and reuses it for every layer. The Pallas kernels
  (bgmv_pallas.py) run on this layout.

NaN safety: slots that no token references may hold garbage (even NaN). 0 * NaN is
NaN, so masking is always done with torch.where / gathers, never by multiplying
with a 0/1 mask, and tokens with idx < 0 get exactly zero contribution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_tpu_lora.ops.block_sizes import padded_num_tokens  # noqa: F401  (re-exported)


class SegmentLayout(NamedTuple):
    """Tokens sorted by LoRA slot, each slot's run padded to a multiple of `block`.

    T_pad = roundup(T + min(N, T) * (block - 1), block) is a static function of
    (T, N, block), so the graph shape never depends on the index values. Valid
    blocks form a prefix; trailing blocks are padding (block_slot == -1).
    """

    perm: torch.Tensor  # int32 [T_pad]: token feeding each padded row (padding rows -> 0)
    row_valid: torch.Tensor  # bool [T_pad]: row holds a real token with idx >= 0
    dest: torch.Tensor  # int32 [T]: padded row of each token (0 for idx < 0)
    token_valid: torch.Tensor  # bool [T]: idx >= 0
    idx: torch.Tensor  # int32 [T]: slot of each token (-1 = none); used by one-hot
    block_slot: torch.Tensor  # int32 [T_pad // block]: slot of each block, -1 = padding
    block: int  # token block B (static)


def make_segment_layout(idx: torch.Tensor, num_slots: int, block: int) -> SegmentLayout:
    """Semantics: sort tokens by idx into block-aligned segments (computed on device).

    Shapes: idx int [T] (values in [-1, N)), num_slots N, block B -> SegmentLayout
    with T_pad = padded_num_tokens(T, N, B) rows. Slot n's tokens occupy rows
    [seg_start[n], seg_start[n] + count[n]) in their original order.
    """
    if idx.dim() != 1:
        raise ValueError(f"idx must be [T], got {tuple(idx.shape)}")
    if block <= 0 or num_slots <= 0:
        raise ValueError(f"need block > 0 and num_slots > 0, got {block=} {num_slots=}")
    dev, i32 = idx.device, torch.int32
    num_tokens = idx.shape[0]
    t_pad = padded_num_tokens(num_tokens, num_slots, block)
    idx = idx.to(i32)
    token_valid = idx >= 0
    # [T, N] one-hot; idx = -1 matches no slot, so padding tokens count nowhere.
    onehot = (idx[:, None] == torch.arange(num_slots, device=dev, dtype=i32)[None, :]).to(i32)
    counts = onehot.sum(0, dtype=i32)
    padded = (counts + (block - 1)) // block * block
    seg_end = torch.cumsum(padded, 0, dtype=i32)
    seg_start = seg_end - padded
    # Rank of each token among the tokens of its own slot (stable: keeps token order).
    rank = ((torch.cumsum(onehot, 0, dtype=i32) - 1) * onehot).sum(1, dtype=i32)
    dest = (seg_start[None, :] * onehot).sum(1, dtype=i32) + rank
    # Scatter token ids into their rows; idx < 0 tokens go to an overflow row t_pad
    # that is cut off, which keeps the scatter static-shaped.
    target = torch.where(token_valid, dest, torch.full_like(dest, t_pad)).long()
    row_token = torch.full((t_pad + 1,), -1, dtype=i32, device=dev)
    row_token = row_token.scatter(0, target, torch.arange(num_tokens, device=dev, dtype=i32))
    row_token = row_token[:t_pad]
    # Block b belongs to the slot whose segment contains row b*B: count segment ends <= b*B.
    starts = torch.arange(0, t_pad, block, device=dev, dtype=i32)
    block_slot = (seg_end[None, :] <= starts[:, None]).sum(1, dtype=i32)
    block_slot = torch.where(block_slot < num_slots, block_slot, torch.full_like(block_slot, -1))
    return SegmentLayout(
        perm=row_token.clamp(min=0),
        row_valid=row_token >= 0,
        dest=dest,
        token_valid=token_valid,
        idx=idx,
        block_slot=block_slot,
        block=block,
    )


def check_shrink_shapes(x: torch.Tensor, lora_a: torch.Tensor, scale: torch.Tensor) -> None:
    if x.dim() != 2 or lora_a.dim() != 3 or x.shape[1] != lora_a.shape[2]:
        raise ValueError(
            f"shrink needs x [T, D] and lora_a [N, R, D], got {tuple(x.shape)} and "
            f"{tuple(lora_a.shape)}"
        )
    if scale.shape != (lora_a.shape[0],):
        raise ValueError(f"scale must be [N={lora_a.shape[0]}], got {tuple(scale.shape)}")


def expand_slice_size(
    lora_b: torch.Tensor, base: torch.Tensor, offset: int, size: int | None
) -> int:
    size = lora_b.shape[1] if size is None else size
    if lora_b.dim() != 3 or lora_b.shape[1] != size or offset < 0 or offset + size > base.shape[1]:
        raise ValueError(
            f"expand slice [{offset}, {offset}+{size}) does not fit lora_b "
            f"{tuple(lora_b.shape)} (want [N, size, R]) and base {tuple(base.shape)}"
        )
    return size


def scatter_back(
    zs: torch.Tensor, layout: SegmentLayout, base: torch.Tensor, offset: int, size: int
) -> torch.Tensor:
    """base[:, offset:offset+size] += zs[dest] for valid tokens (zs in segment layout)."""
    delta = zs.index_select(0, layout.dest)
    # where, not a multiply: a padding token's row must add exactly zero.
    delta = torch.where(layout.token_valid[:, None], delta, torch.zeros_like(delta))
    cols = base[:, offset : offset + size] + delta.to(base.dtype)
    return torch.slice_scatter(base, cols, dim=1, start=offset, end=offset + size)


def segment_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, layout: SegmentLayout, scale: torch.Tensor
) -> torch.Tensor:
    """Semantics: ys[r] = scale[s] * x[perm[r]] @ lora_a[s].T with s the slot of row r's block.

    Shapes: x [T, D], lora_a [N, R, D], scale [N] -> ys [T_pad, R] in segment
    layout (x.dtype); padding rows are exactly zero.
    """
    check_shrink_shapes(x, lora_a, scale)
    b, t_pad = layout.block, layout.perm.shape[0]
    nb, rank, d = t_pad // b, lora_a.shape[1], lora_a.shape[2]
    slot = layout.block_slot.clamp(min=0)  # padding blocks read slot 0, masked below
    xs = x.index_select(0, layout.perm).view(nb, b, d)
    w = lora_a.index_select(0, slot).to(x.dtype)  # [NB, R, D]: one adapter per block
    ys = torch.bmm(xs, w.transpose(1, 2))  # [NB, B, R]
    ys = (ys.float() * scale.index_select(0, slot).float()[:, None, None]).to(x.dtype)
    ys = ys.reshape(t_pad, rank)
    return torch.where(layout.row_valid[:, None], ys, torch.zeros_like(ys))


def segment_expand(
    ys: torch.Tensor,
    lora_b: torch.Tensor,
    layout: SegmentLayout,
    base: torch.Tensor,
    offset: int = 0,
    size: int | None = None,
) -> torch.Tensor:
    """Semantics: out[t, offset:offset+size] = base[t, ...] + ys[dest[t]] @ lora_b[idx[t]].T.

    Shapes: ys [T_pad, R] (segment layout), lora_b [N, size, R], base [T, O_total]
    -> out [T, O_total] (base.dtype); rows with idx < 0 and other columns unchanged.
    """
    size = expand_slice_size(lora_b, base, offset, size)
    b, t_pad, rank = layout.block, ys.shape[0], ys.shape[1]
    slot = layout.block_slot.clamp(min=0)
    w = lora_b.index_select(0, slot).to(ys.dtype)  # [NB, size, R]
    zs = torch.bmm(ys.view(t_pad // b, b, rank), w.transpose(1, 2)).reshape(t_pad, size)
    return scatter_back(zs, layout, base, offset, size)


def onehot_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor,
    *, keep_rank_axis: bool = False,
) -> torch.Tensor:
    """Semantics: y[t] = scale[idx[t]] * x[t] @ lora_a[idx[t]].T, 0 where idx[t] < 0.

    Shapes: x [T, D], lora_a [N, R, D], idx int [T], scale [N] -> y [T, R] (x.dtype).
    One matmul against all N adapters ([T, D] @ [D, N*R]), then a one-hot select.
    keep_rank_axis: contract with an einsum that keeps lora_a's N and R axes apart. For a
    lora_a sharded on R across devices (fully_sharded_loras): merging N and R would make
    XLA's SPMD partitioner gather lora_a. 15-30% slower on XLA CPU at N*R >= 128, so
    not the default.
    """
    check_shrink_shapes(x, lora_a, scale)
    n, rank, d = lora_a.shape
    onehot = idx.to(torch.int32)[:, None] == torch.arange(n, device=x.device, dtype=torch.int32)
    # Zero unreferenced slots first: their NaN would survive the 0-weight select below.
    used = onehot.any(0)
    a = torch.where(used[:, None, None], lora_a, torch.zeros_like(lora_a)).to(x.dtype)
    if keep_rank_axis:
        xa = torch.einsum("td,nrd->tnr", x, a).float()
    else:
        xa = (x @ a.reshape(n * rank, d).T).view(-1, n, rank).float()
    sel = torch.where(onehot, scale.float()[None, :], torch.zeros_like(scale.float())[None, :])
    y = (xa * sel[:, :, None]).sum(1)
    valid = (idx >= 0)[:, None]
    return torch.where(valid, y, torch.zeros_like(y)).to(x.dtype)


def onehot_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    idx: torch.Tensor,
    base: torch.Tensor,
    offset: int = 0,
    size: int | None = None,
) -> torch.Tensor:
    """Semantics: out[t, offset:offset+size] = base[t, ...] + y[t] @ lora_b[idx[t]].T.

    Shapes: y [T, R], lora_b [N, size, R], idx int [T], base [T, O_total] -> [T, O_total].
    y is spread into a [T, N*R] block-one-hot matrix, then one matmul with all slots.
    """
    size = expand_slice_size(lora_b, base, offset, size)
    n, _, rank = lora_b.shape
    onehot = idx.to(torch.int32)[:, None] == torch.arange(n, device=y.device, dtype=torch.int32)
    b = torch.where(onehot.any(0)[:, None, None], lora_b, torch.zeros_like(lora_b)).to(y.dtype)
    # where, not a multiply: a padding token (no one-hot match) gets an exactly zero
    # row even if its y is NaN, and b is finite, so its delta is exactly zero.
    spread = torch.where(onehot[:, :, None], y[:, None, :], torch.zeros_like(y)[:, None, :])
    delta = spread.reshape(-1, n * rank) @ b.permute(0, 2, 1).reshape(n * rank, size)
    cols = base[:, offset : offset + size] + delta.to(base.dtype)
    return torch.slice_scatter(base, cols, dim=1, start=offset, end=offset + size)


def to_token_order(ys: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Segment layout [T_pad, R] -> token order [T, R]; rows with idx < 0 are zero."""
    y = ys.index_select(0, layout.dest)
    return torch.where(layout.token_valid[:, None], y, torch.zeros_like(y))


def to_segment_order(y: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Token order [T, R] -> segment layout [T_pad, R]; padding rows are zero."""
    ys = y.index_select(0, layout.perm)
    return torch.where(layout.row_valid[:, None], ys, torch.zeros_like(ys))
