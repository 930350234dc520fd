"""Device meshes for tensor parallelism, per runtime, behind one small interface.

XLA's SPMD partitioner runs one program over every device of the mesh. With D devices and
tensor parallel size N the devices form D // N replicas of one N-device tensor-parallel
group (replicas repeat the same work; with D == N there is one). Device `r * N + i` is
position i of replica r.

A tensor dim split into `groups` shards (groups divides N; always N or the model's number
of kv groups) puts shard i // (N // groups) on position i, which is
`SliceShard.group_of(i)`. What the layers need from a mesh:
- `mark(t, dim, groups)`: lay a weight, cache or buffer out that way, in place;
- `constrain(t, dim, groups)`: pin an activation's layout inside a graph;
- `manual(fn, args, in_dims, out_dims)`: run `fn` on each device's local blocks
  (shard_map): what the packed linears and the attention kernel do per device
  (in_dims: (dim, groups) per argument; out_dims: (ndim, dim, groups) per output).
`dim=None` (or groups == 1) means replicated. torch_xla (`XlaTPMesh`) uses its SPMD mode
(`mark_sharding`, enable/disable_manual_sharding); the jax runtime (`JaxTPMesh`) uses
`NamedSharding`, `with_sharding_constraint` and `shard_map` inside the jitted step.
"""

from __future__ import annotations

import functools

import numpy as np

from vllm_tpu_lora import platform  # noqa: F401  (sets PJRT_DEVICE before torch_xla)

Dims = tuple  # (dim | None, groups | None) per tensor
OutDims = tuple  # (ndim, dim | None, groups | None) per output


class XlaTPMesh:
    """torch_xla SPMD. torch_xla requires every Mesh to name all devices: a split into
    `groups` uses the mesh [replica, model=groups, rep=N // groups] (axes of size 1 left
    out, so that common specs read as the plain 1-D `model` sharding)."""

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
        import torch_xla.distributed.spmd as xs

        mesh, spec = self.spec(t.dim(), dim, groups)
        xs.mark_sharding(t, mesh, spec)

    def constrain(self, t, dim: int | None, groups: int | None = None):
        self.mark(t, dim, groups)  # on a lazy tensor: an annotation inside the graph
        return t

    def manual(self, fn, args: list, in_dims: list[Dims], out_dims: list[OutDims]) -> list:
        import torch_xla.distributed.spmd as xs

        local = []
        for a, (dim, groups) in zip(args, in_dims):
            mesh, spec = self.spec(a.dim(), dim, groups)
            local.append(xs.enable_manual_sharding(a, spec, mesh=mesh).global_tensor)
        out = []
        for o, (_, dim, groups) in zip(fn(*local), out_dims):
            mesh, spec = self.spec(o.dim(), dim, groups)
            full = list(o.shape)
            if dim is not None:
                full[dim] *= self.tp if groups is None else groups
            out.append(xs.disable_manual_sharding(o, spec, tuple(full), mesh=mesh).global_tensor)
        return out


class JaxTPMesh:
    """The jax runtime: one mesh [replica, model=G, rep=N // G] over the first D devices,
    G the model's kv groups (every split in the layout is into N or G shards). A split
    into G shards is the `model` axis, into N shards `model` x `rep` (model major, so
    position i holds shard i // (N // groups) either way)."""

    def __init__(self, tp: int, num_devices: int, kv_groups: int) -> None:
        import jax

        self.tp, self.kv_groups = tp, kv_groups
        self.replicas = num_devices // tp
        self.num_devices = num_devices
        devices = np.array(jax.devices()[:num_devices]).reshape(
            self.replicas, kv_groups, tp // kv_groups)
        self.mesh = jax.sharding.Mesh(devices, ("replica", "model", "rep"))

    def _axes(self, groups: int | None):
        groups = self.tp if groups is None else groups
        if groups == 1:
            return None
        if groups == self.tp:
            return ("model", "rep") if self.tp != self.kv_groups else "model"
        if groups == self.kv_groups:
            return "model"
        raise ValueError(f"no mesh axis splits a dim into {groups} shards (tp {self.tp}, "
                         f"kv groups {self.kv_groups})")

    def pspec(self, ndim: int, dim: int | None, groups: int | None = None):
        from jax.sharding import PartitionSpec

        spec = [None] * ndim
        if dim is not None:
            spec[dim] = self._axes(groups)
        return PartitionSpec(*spec)

    def sharding(self, ndim: int, dim: int | None, groups: int | None = None):
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, self.pspec(ndim, dim, groups))

    def mark(self, t, dim: int | None, groups: int | None = None) -> None:
        import jax

        t._elem = jax.device_put(t._elem, self.sharding(t.dim(), dim, groups))

    def constrain(self, t, dim: int | None, groups: int | None = None):
        import jax
        from torchax import interop

        s = self.sharding(t.dim(), dim, groups)
        return interop.call_jax(lambda x: jax.lax.with_sharding_constraint(x, s), t)

    def manual(self, fn, args: list, in_dims: list[Dims], out_dims: list[OutDims]) -> list:
        from torchax import interop

        in_specs = tuple(self.pspec(a.dim(), d, g) for a, (d, g) in zip(args, in_dims))
        out_specs = [self.pspec(n, d, g) for n, d, g in out_dims]
        return interop.call_jax(_shard_map(interop.jax_view(lambda *xs: list(fn(*xs))),
                                           self.mesh, in_specs, out_specs), *args)


def _shard_map(f, mesh, in_specs, out_specs):
    """shard_map without its replication check (a kv head block replicated over the `rep`
    axis is equal on those devices by construction, which the check cannot see)."""
    try:
        from jax import shard_map  # JAX >= 0.7
        kw = {"check_vma": False}
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map
        kw = {"check_rep": False}
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)
