"""Linear layers that know how they are packed.

A packed layer (qkv, gate_up) is one matmul whose output is the concatenation of
several checkpoint tensors; `output_sizes` records the slices so the loader can write
each shard and LoRA can later add one adapter slice per packed module.
"""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        """(offset, size) of output shard `shard` in the packed output."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]
