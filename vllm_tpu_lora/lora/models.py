"""A loaded LoRA adapter, in our model's module names and slice layout (host tensors).

`peft_loader.load_peft_adapter` builds these; the LoRA manager copies them into the
preallocated per-slot device buffers (DESIGN.md §4), zero-padding each slice to max_lora_rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRASliceWeights:
    """One adapted output slice: delta = scale * x @ lora_a.T @ lora_b.T."""

    lora_a: torch.Tensor  # [r, in_features]   (as PEFT's lora_A.weight)
    lora_b: torch.Tensor  # [out_slice, r]     (as PEFT's lora_B.weight)
    # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, after rank_pattern/alpha_pattern.
    # Kept apart from the weights (not folded into lora_b) so the kernel's per-slot scale
    # and PEFT's own `scaling` stay comparable.
    scale: float
    # lora_bias=True adapters: lora_B's bias [out_slice] (like B, multiplied by the scale).
    bias: torch.Tensor | None = None
    # DoRA: the magnitude vector m [out_slice]; the output channel's rescale is
    # m / ||W + scale * B A|| (row norms of the merged weight).
    magnitude: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAModel:
    name: str
    int_id: int
    path: str
    rank: int  # max rank over all adapted slices
    # Our module name (e.g. "model.layers.0.self_attn.qkv_proj") -> one entry per output slice
    # of that module (q/k/v for qkv_proj, gate/up for gate_up_proj, one for o/down_proj).
    # None = that slice is not adapted (its delta is zero). Modules with no adapted slice at all
    # are absent.
    modules: dict[str, list[LoRASliceWeights | None]]

    def num_params(self) -> int:
        return sum(s.lora_a.numel() + s.lora_b.numel()
                   for slices in self.modules.values() for s in slices if s is not None)
