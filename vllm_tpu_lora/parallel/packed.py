"""Column-parallel packed linears (qkv_proj = [q | k | v], gate_up_proj = [gate | up]).

The problem: a packed layer is ONE matmul whose output is the concatenation of several
slices. Cutting its output columns into N contiguous blocks would hand device 0 all of q
and device N-1 all of v. What each device must hold is its own heads of q, k and v.

The approach, in two steps:
1. At load (on the host, before the weights reach a device) the columns of weight_t
   [in, out] (and of the bias) are reordered into per-device blocks:
   [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]. A plain 1-D column sharding of dim 1 then gives
   device i exactly the block [q_i | k_i | v_i], and the layer stays one matmul. When a
   model has fewer kv heads than devices, k_i / v_i is the kv head that device i's
   query heads use, so those columns appear once per device that needs them.
2. In the forward pass the device-local output block is split into its slices inside a
   manual-sharding region (the mesh's `manual`: torch_xla's enable/disable_manual_sharding,
   or shard_map on the jax runtime),
   and each slice leaves the region as an ordinary logical tensor, [T, q_size] sharded by
   heads, [T, kv_size] sharded (or replicated) by kv heads, with no data movement.

Why the slices are handed to the model instead of a re-concatenated [q | k | v] tensor:
the model's split of a concatenation along a sharded dimension is not a local operation
for XLA's SPMD partitioner (it runs before any algebraic simplification and emitted
all-to-all + collective-permute for every layer when tried). So `layers.linear.split_packed`
asks layers with `slices_natively` for their slices; the model code itself is unchanged
otherwise and has no notion of devices. `forward()` still returns the packed output,
in the original column order, for any other caller.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_tpu_lora.layers.linear import TransposedLinear
from vllm_tpu_lora.parallel.layout import SliceShard


def reorder_columns(t: torch.Tensor, slices: list[SliceShard], dim: int) -> torch.Tensor:
    """[.. s_0 | s_1 | ..] along `dim` -> [.. s_0@dev0 | s_1@dev0 | .. | s_0@dev1 | ..]."""
    parts = t.split([s.size for s in slices], dim=dim)
    blocks = []
    for device in range(slices[0].tp):
        for part, s in zip(parts, slices):
            offset, size = s.columns_of(device)
            blocks.append(part.narrow(dim, offset, size))
    return torch.cat(blocks, dim=dim).contiguous()


class ColumnParallelPackedLinear(nn.Module):
    """A packed TransposedLinear with columns in per-device blocks (see module docstring)."""

    slices_natively = True

    def __init__(self, base: TransposedLinear, slices: list[SliceShard], tpm) -> None:
        super().__init__()
        sizes = [s.size for s in slices]
        if list(base.output_sizes) != sizes:
            raise ValueError(f"packed layer has output slices {base.output_sizes}, the "
                             f"tensor-parallel layout expects {sizes}")
        self.weight_t = nn.Parameter(reorder_columns(base.weight_t.data, slices, 1),
                                     requires_grad=False)
        self.bias = None if base.bias is None else nn.Parameter(
            reorder_columns(base.bias.data, slices, 0), requires_grad=False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.output_sizes = sizes
        self.slices = slices
        self.tpm = tpm

    def forward_slices(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = x @ self.weight_t
        if self.bias is not None:
            y = y + self.bias
        last = y.dim() - 1

        def split(local):
            return local.split([s.local_size for s in self.slices], dim=-1)

        return self.tpm.manual(split, [y], [(last, None)],
                               [(y.dim(), last, s.groups) for s in self.slices])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.forward_slices(x), dim=-1)


def replace_packed_linears(model: nn.Module, layouts: dict[str, list[SliceShard]],
                           tpm) -> list[str]:
    """Swap every packed TransposedLinear named in `layouts` (by last name component, also
    inside a LoRA layer's base_layer) for its column-parallel form; return their names."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, TransposedLinear):
            continue
        owner = name[: -len(".base_layer")] if name.endswith(".base_layer") else name
        slices = layouts.get(owner.rsplit(".", 1)[-1])
        if slices is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, ColumnParallelPackedLinear(module, slices, tpm))
        replaced.append(name)
    return replaced
