"""Plain per-token loop reference for the LoRA ops (float32, torch on CPU).

This file is the oracle every other backend is tested against, so it is written
for obviousness, not speed: one Python iteration per token, float32 math, no
batching tricks. Tensors may live on any device; they are moved to CPU first.
"""

from __future__ import annotations

import torch


def _cpu_f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32)


def bgmv_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Semantics: y[t] = scale[idx[t]] * x[t] @ lora_a[idx[t]].T, y[t] = 0 where idx[t] < 0.

    Shapes: x [T, D], lora_a [N, R, D], idx int [T], scale [N] -> y float32 [T, R].
    Slots that no token references are never read, so they may hold NaN.
    """
    x, lora_a, scale = _cpu_f32(x), _cpu_f32(lora_a), _cpu_f32(scale)
    idx = idx.detach().cpu().tolist()
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32)
    for t, s in enumerate(idx):
        if s >= 0:
            y[t] = scale[s] * (lora_a[s] @ x[t])
    return y


def bgmv_expand_ref(
    y: torch.Tensor, lora_b: torch.Tensor, idx: torch.Tensor, base: torch.Tensor
) -> torch.Tensor:
    """Semantics: out[t] = base[t] + y[t] @ lora_b[idx[t]].T, out[t] = base[t] where idx[t] < 0.

    Shapes: y [T, R], lora_b [N, O, R], idx int [T], base [T, O] -> out float32 [T, O].
    """
    size = lora_b.shape[1]
    return bgmv_expand_slice_ref(y, lora_b, idx, base, 0, size)


def bgmv_expand_slice_ref(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    idx: torch.Tensor,
    base: torch.Tensor,
    offset: int,
    size: int,
) -> torch.Tensor:
    """Semantics: out[t, offset:offset+size] = base[t, offset:offset+size] + y[t] @ lora_b[idx[t]].T.

    Shapes: y [T, R], lora_b [N, size, R], idx int [T], base [T, O_total]
    -> out float32 [T, O_total]; columns outside the slice and rows with idx < 0
    are copied from base unchanged.
    """
    y, lora_b = _cpu_f32(y), _cpu_f32(lora_b)
    out = _cpu_f32(base).clone()
    if lora_b.shape[1] != size or offset + size > out.shape[1]:
        raise ValueError(
            f"slice [{offset}, {offset + size}) does not fit lora_b {tuple(lora_b.shape)} "
            f"and base {tuple(out.shape)}"
        )
    for t, s in enumerate(idx.detach().cpu().tolist()):
        if s >= 0:
            out[t, offset : offset + size] += lora_b[s] @ y[t]
    return out
