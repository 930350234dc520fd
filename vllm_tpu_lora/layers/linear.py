"""Linear layers that know how they are packed.

A packed layer (qkv, gate_up) is one matmul whose output is the concatenation of
several checkpoint tensors; `output_sizes` records the slices so the loader can write
each shard and LoRA can later add one adapter slice per packed module.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        """(offset, size) of output shard `shard` in the packed output."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]


class TransposedLinear(nn.Module):
    """A linear layer holding its weight as [in, out].

    XLA's CPU backend materialises the transpose of an [out, in] weight on every call of
    `x @ W.T` (9x slower than `x @ W_t` at 32 tokens here), so the runner swaps every
    nn.Linear for this one after loading. The model code is unchanged.
    """

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight_t.shape
        if output_sizes is not None:
            self.output_sizes = list(output_sizes)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> TransposedLinear:
        return cls(linear.weight.detach().t().contiguous(),
                   None if linear.bias is None else linear.bias.detach(),
                   getattr(linear, "output_sizes", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def split_packed(layer: nn.Module, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The output slices of a packed linear: `layer(x).split(sizes, dim=-1)`.

    A layer with `slices_natively` (the tensor-parallel packed layer, parallel/packed.py,
    or a LoRA layer around one) returns its slices itself: there the packed output is
    never one tensor, because splitting a concatenation along a sharded dimension would
    move data between devices.
    """
    if getattr(layer, "slices_natively", False):
        return layer.forward_slices(x)
    return list(layer(x).split(sizes, dim=-1))


def pretranspose_linears(model: nn.Module) -> None:
    """Replace every nn.Linear in `model` by a TransposedLinear, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, TransposedLinear.from_linear(module))
