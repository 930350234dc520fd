"""Rotary position embedding (neox/HF "rotate_half" layout), incl. llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_params(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from an HF config dict, old (rope_theta/rope_scaling) or new
    (rope_parameters) style."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else dict(scaling, rope_type=kind)
    return float(theta), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_ff = scaling.get("low_freq_factor", 1.0)
    high_ff = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen = old_len / low_ff
    high_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between
    # is interpolated smoothly (Llama 3.1 context extension).
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exps)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"Unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, H, D]; k [T, Hkv, D] -> rotated (q, k)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()[:, None, :].to(q.dtype)
        sin = emb.sin()[:, None, :].to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
