"""Head-parallel attention: each device attends with its own query heads and kv heads.

The attention kernel is wrapped in a manual-sharding region (torch_xla's
enable/disable_manual_sharding, i.e. shard_map): inside, the kernel sees device-local
tensors, q [T, H / N, D] and the KV cache's local heads, exactly as on one chip with a
smaller model; the output [T, H * D] leaves sharded by heads, ready for the
row-parallel o_proj. Why wrap at all: torch_xla's ragged_paged_attention on TPU is a
Pallas custom call that XLA's SPMD partitioner cannot split, so it would gather the
whole KV cache onto every device. The same wrapper is used on CPU around the reference
attention (which XLA could partition by itself), so CI runs the code path a TPU runs.

Installed from outside on each attention module's `attn` callable (models stay plain).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from vllm_tpu_lora.parallel.mesh import TPMesh


class HeadParallelAttention:
    def __init__(self, fn, tpm: TPMesh, kv_groups: int) -> None:
        self.fn, self.tpm, self.kv_groups = fn, tpm, kv_groups

    def _enter(self, t, dim: int | None, groups: int | None = None):
        import torch_xla.distributed.spmd as xs

        mesh, spec = self.tpm.spec(t.dim(), dim, groups)
        return xs.enable_manual_sharding(t, spec, mesh=mesh).global_tensor

    def __call__(self, q, kv_cache: tuple, meta, block_size: int, scale: float, **options):
        """options (sliding_window, soft_cap) act per head: passed through unchanged."""
        import torch_xla.distributed.spmd as xs

        q_local = self._enter(q, 1)
        kv_local = tuple(self._enter(c, 1, self.kv_groups) for c in kv_cache)
        meta_local = dataclasses.replace(meta, **{
            f.name: self._enter(getattr(meta, f.name), None) for f in dataclasses.fields(meta)})
        out = self.fn(q_local, kv_local, meta_local, block_size, scale, **options)  # [T, H/N*D]
        mesh, spec = self.tpm.spec(out.dim(), out.dim() - 1)
        full = (*out.shape[:-1], out.shape[-1] * self.tpm.tp)
        return xs.disable_manual_sharding(out, spec, full, mesh=mesh).global_tensor


def shard_attention(model: nn.Module, tpm: TPMesh, kv_groups: int) -> int:
    """Wrap every attention module's kernel; return how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        fn = getattr(module, "attn", None)
        if callable(fn) and not isinstance(fn, (nn.Module, HeadParallelAttention)):
            module.attn = HeadParallelAttention(fn, tpm, kv_groups)
            wrapped += 1
    return wrapped
