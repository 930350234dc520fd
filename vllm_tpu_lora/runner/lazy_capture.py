"""Capture once, replay always, without dynamo: one lazy trace per graph key, then replay
by graph hash (what torch_xla's dynamo bridge does underneath `openxla`, minus dynamo's
bytecode tracing and AOT functionalisation, which tripled warm-up on XLA CPU).

Contract of a captured function `fn(*args)`:
- Its graph is a function of the key: the pytree structure of `args`, the shapes and
  dtypes of their tensors, their non-tensor leaves (e.g. the LoRA-slot bucket), and the
  persistent tensors it reads but is not given (model weights), which must never change.
- Every tensor that changes between calls is passed in `args`: the step's inputs, and the
  state the graph updates in place (the KV cache) or that is written between steps (LoRA
  slot buffers). In-place updates of arguments are replayed (donated buffers, no copy).
  State whose shapes never change goes in as `FixedTensors`, keyed once.

At replay the function's Python code does not run: the cached executable is launched
with the new argument buffers in the traced input order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vllm_tpu_lora import platform


class _Graph:
    """One key's captured graph."""

    def __init__(self, graph_hash, input_plan, mutated: list[int], out_spec) -> None:
        self.graph_hash = graph_hash
        self.input_plan = input_plan  # per graph input: (arg index, None) or (None, buffer)
        self.mutated = mutated  # indices of tensor args the graph updates in place
        self.out_spec = out_spec


def _xlac():
    platform.xla_device()  # torch_xla imported with PJRT_DEVICE decided
    import torch_xla

    return torch_xla._XLAC


class FixedTensors:
    """Tensors given to every call whose number, shapes and dtypes never change, only their
    contents (the KV cache, the LoRA slot buffers): one argument whose part of the graph
    key is computed once. Walking them per call cost ~1 µs per tensor, so host time per
    step grew with layers x LoRA modules (4 layers x 7 linears: 64 tensors, ~50 µs).
    The captured function reads `value`, the structure as given.

    read_only: the graph only reads them (the LoRA slot buffers in the forward, written
    between steps by their own graph). They are then plain arguments, not donated state:
    on the jax runtime a donated buffer the graph passes through unchanged still costs a
    donation and a new output array per call (~1 us each on XLA CPU, 224 slot buffers
    at 16 layers x 7 linears), and a read-only one updated in place is refused."""

    __slots__ = ("value", "tensors", "key", "read_only")

    def __init__(self, value, read_only: bool = False) -> None:
        self.value = value
        self.read_only = read_only
        leaves, spec = pytree.tree_flatten(value)
        self.tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if len(self.tensors) != len(leaves):
            raise TypeError("FixedTensors holds tensors only")
        self.key = (FixedTensors, read_only, spec,
                    tuple((tuple(t.shape), t.dtype) for t in self.tensors))


def split_args(args: tuple) -> tuple[list, list, tuple]:
    """A call's arguments as (tensor args, the tensors of its FixedTensors, graph key):
    the key is the pytree structure, each tensor's shape and dtype, each FixedTensors' key
    and the non-tensor leaves (both captures key their graphs this way). Read-only
    FixedTensors count as tensor args."""
    leaves, spec = pytree.tree_flatten(args)
    tensors, fixed, key_parts = [], [], []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            key_parts.append((tuple(x.shape), x.dtype))
        elif isinstance(x, FixedTensors):
            (tensors if x.read_only else fixed).extend(x.tensors)
            key_parts.append(x.key)
        else:
            key_parts.append(x)
    return tensors, fixed, (spec, tuple(key_parts))


class LazyGraphCapture:
    def __init__(self) -> None:
        self.captures = 0  # every trace: first captures and later ones alike

    def background_compiles(self):
        """torch_xla compiles each graph as it is traced (`_xla_warm_up_cache`)."""
        return contextlib.nullcontext()

    def compile(self, fn: Callable) -> Callable:
        graphs: dict[Any, _Graph] = {}

        def run(*args):
            tensors, fixed, key = split_args(args)
            tensors += fixed  # in-place updates of either are replayed alike
            graph = graphs.get(key)
            if graph is None:
                graph = graphs[key] = self._capture(fn, args, tensors)
            return _replay(graph, tensors)

        return run

    def _capture(self, fn: Callable, args: tuple, tensors: list[torch.Tensor]) -> _Graph:
        import torch_xla
        from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

        xlac = _xlac()
        self.captures += 1
        # Materialise everything first, so every argument is a device-data node that
        # carries its own tensor id (how graph inputs are matched to arguments).
        torch_xla.sync(reset_scope=False)
        # ...and finished: graph inputs kept by value must not be in-flight placeholders.
        platform.wait_device_ops()
        arg_of = {xlac._xla_get_tensor_id(t): i for i, t in enumerate(tensors)}
        saved = [t.clone() for t in tensors]  # lazy: restores args updated in place
        mutated: list[int] = []
        try:
            out = fn(*args)
            out_leaves, out_spec = pytree.tree_flatten(out)
            if not all(isinstance(x, torch.Tensor) for x in out_leaves):
                raise TypeError("a captured graph must return tensors only")
            mutated = [i for i, need in
                       enumerate(xlac._check_tensor_need_materialization(tensors)) if need]
            roots = [tensors[i] for i in mutated] + out_leaves
            ids, values = xlac._get_tensors_xla_device_data_node(roots)
            plan = [(arg_of[i], None) if i in arg_of else (None, v) for i, v in zip(ids, values)]
            # Arguments updated in place (the KV cache) are donated while the graph is
            # compiled: the executable then aliases them to their new contents and every
            # replay consumes the old buffer. Undonated, XLA copied every layer's whole
            # cache each step (a 16k-slot cache: decode 38 -> 23 ms at the LoRA benchmark's
            # shape). The flag sits on the buffer the trace read (`values`), as the
            # argument itself is a pending in-place update at this point.
            for i, v in zip(ids, values):
                if i in arg_of and arg_of[i] in mutated:
                    xlac._set_buffer_donation(v, True)
            with alias_with_buffer_donor_config():
                graph_hash = xlac._get_graph_hash(roots)
                xlac._xla_warm_up_cache(roots, [])  # compiles (or finds) the executable
        finally:
            # Nothing of the trace may run: undo its in-place updates, drop its IR (also
            # when the trace failed, so the next graph does not inherit half a step).
            needs = xlac._check_tensor_need_materialization(tensors)
            for i, need in enumerate(needs):
                if need:
                    tensors[i].copy_(saved[i])
            xlac._clear_pending_irs(str(platform.xla_device()))
        return _Graph(graph_hash, plan, mutated, out_spec)


def _replay(graph: _Graph, tensors: list[torch.Tensor]):
    xlac = _xlac()
    inputs = [tensors[a] if a is not None else buf for a, buf in graph.input_plan]
    results = xlac._run_cached_graph(graph.graph_hash, inputs)
    n = len(graph.mutated)
    for i, res in zip(graph.mutated, results[:n]):
        xlac._replace_xla_tensor(tensors[i], res)
    return pytree.tree_unflatten(list(results[n:]), graph.out_spec)
