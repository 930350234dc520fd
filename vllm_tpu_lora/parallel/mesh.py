"""Device meshes for tensor parallelism, and the sharding annotations built on them.

XLA's SPMD mode runs one program over every device of the process, and torch_xla
requires every Mesh to name all of them. With D devices and tensor parallel size N the
devices form D // N replicas of one N-device tensor-parallel group (replicas repeat the
same work; with D == N there is one). Device `r * N + i` is position i of replica r.

A tensor dim split into `groups` shards (groups divides N) uses the mesh
[replica, model=groups, rep=N // groups]: position i holds shard i // (N // groups), which
is `SliceShard.group_of(i)`; axes of size 1 are left out so that the common specs read
as the plain 1-D `model` sharding.
"""

from __future__ import annotations

import functools

import numpy as np

from vllm_tpu_lora import platform  # noqa: F401  (sets PJRT_DEVICE before torch_xla)


class TPMesh:
    def __init__(self, tp: int, num_devices: int) -> None:
        self.tp = tp
        self.replicas = num_devices // tp
        self.num_devices = num_devices

    @functools.cache  # noqa: B019  (a handful of meshes per engine, kept for its lifetime)
    def mesh(self, groups: int):
        import torch_xla.distributed.spmd as xs

        sizes = [(self.replicas, "replica"), (groups, "model"), (self.tp // groups, "rep")]
        kept = [(s, n) for s, n in sizes if s > 1] or [(1, "model")]
        shape, names = zip(*kept)
        return xs.Mesh(np.arange(self.num_devices), tuple(shape), tuple(names))

    def spec(self, ndim: int, dim: int | None, groups: int | None = None):
        """(mesh, partition spec) splitting `dim` into `groups` shards (default N);
        dim=None or groups == 1: replicated."""
        groups = self.tp if groups is None else groups
        spec = [None] * ndim
        if dim is not None and groups > 1:
            spec[dim] = "model"
        return self.mesh(groups), tuple(spec)

    def mark(self, t, dim: int | None, groups: int | None = None) -> None:
        """Shard tensor `t` in place (a parameter, buffer or cache keeps its identity)."""
        import torch_xla.distributed.spmd as xs

        mesh, spec = self.spec(t.dim(), dim, groups)
        xs.mark_sharding(t, mesh, spec)
