"""Head-parallel attention: each device attends with its own query heads and kv heads.

The attention kernel is wrapped in a manual-sharding region (the mesh's `manual`:
torch_xla's enable/disable_manual_sharding, or shard_map on the jax runtime): inside, the
kernel sees device-local tensors, q [T, H / N, D] and the KV cache's local heads, exactly as on one chip with a
smaller model; the output [T, H * D] leaves sharded by heads, ready for the
row-parallel o_proj. Why wrap at all: torch_xla's ragged_paged_attention on TPU is a
Pallas custom call that XLA's SPMD partitioner cannot split, so it would gather the
whole KV cache onto every device (JAX's, on the jax runtime, likewise). The same wrapper is used on CPU around the reference
attention (which XLA could partition by itself), so CI runs the code path a TPU runs.

Installed from outside on each attention module's `attn` callable (models stay plain).
"""

from __future__ import annotations

import dataclasses

from torch import nn


class HeadParallelAttention:
    def __init__(self, fn, tpm, kv_groups: int) -> None:
        self.fn, self.tpm, self.kv_groups = fn, tpm, kv_groups

    def __call__(self, q, kv_cache: tuple, meta, block_size: int, scale: float, **options):
        """options (sliding_window, soft_cap) act per head: passed through unchanged."""
        names = [f.name for f in dataclasses.fields(meta)]
        n_kv = len(kv_cache)

        def local(q_local, *rest):
            kv_local, fields = tuple(rest[:n_kv]), rest[n_kv:]
            meta_local = dataclasses.replace(meta, **dict(zip(names, fields)))
            return [self.fn(q_local, kv_local, meta_local, block_size, scale, **options)]

        args = [q, *kv_cache, *(getattr(meta, n) for n in names)]
        in_dims = [(1, None)] + [(1, self.kv_groups)] * n_kv + [(None, None)] * len(names)
        (out,) = self.tpm.manual(local, args, in_dims, [(2, 1, None)])  # [T, H * D] by heads
        return out


def shard_attention(model: nn.Module, tpm, kv_groups: int) -> int:
    """Wrap every attention module's kernel; return how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        fn = getattr(module, "attn", None)
        if callable(fn) and not isinstance(fn, (nn.Module, HeadParallelAttention)):
            module.attn = HeadParallelAttention(fn, tpm, kv_groups)
            wrapped += 1
    return wrapped
