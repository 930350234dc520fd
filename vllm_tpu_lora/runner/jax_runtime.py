"""The jax runtime: the engine's torch modules run as `jax.jit` graphs through torchax.

Every device tensor is a torchax tensor, a torch tensor whose data is a jax array
(`._elem`). Modules are moved by swapping their parameters and buffers for such tensors
(the module code is unchanged), so everything that reads `layer.lora_a_0` or the KV cache
reads device data, as on torch_xla.

A graph (`JaxGraphCapture`) is captured once per key by tracing the step function under
`jax.jit`: for the trace, every tensor it is given and every weight it reads has its
array swapped for a tracer. What the torch code writes in place (`index_copy_` into the
KV cache, a slot write into the LoRA buffers) swaps a tensor's array, so after the trace
the tensor holds the new value's tracer; the graph returns those, and the replay puts the
results back into the same tensor objects. State passed as `FixedTensors` (the KV cache,
the LoRA buffers) is donated: XLA updates it in place instead of copying it.

Integers: the step's packed inputs, seeds and the sampler's hash are int64, which JAX
truncates to int32 unless x64 is on. It is turned on around this runtime's own traces,
calls and transfers only (`x64`), not for the process, so other JAX users (torch_xla's
Pallas bridge in the same process) keep JAX's defaults.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as pytree

from vllm_tpu_lora import platform
from vllm_tpu_lora.config import compile_threads
from vllm_tpu_lora.ops.pallas_kernels import jax_matmul_precision, x64
from vllm_tpu_lora.runner import map_budget
from vllm_tpu_lora.runner.lazy_capture import split_args
from vllm_tpu_lora.torchax_compat import import_torchax

logger = logging.getLogger(__name__)

# XLA compilations in this process, from JAX's own compile events (one per executable
# built, whether by a captured graph, an eager op or a transfer helper).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = 0
_listening = False
_lock = threading.Lock()


def _on_event(event: str, duration: float, **_: Any) -> None:
    global _compiles
    if event == _COMPILE_EVENT:
        with _lock:  # warm-up compiles in several threads
            _compiles += 1


def jax_compile_count() -> int:
    return _compiles


def _listen_for_compiles() -> None:
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor as numpy (bfloat16 through its bits: numpy has no bfloat16)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


class JaxRuntime:
    name = "jax"
    # A transfer may start on any thread (jax.device_put is thread-safe): the LoRA loader
    # thread moves slot images ahead of their writes (lora/staging.py).
    transfers_from_any_thread = True

    def __init__(self) -> None:
        torchax = import_torchax()
        self.env = torchax.default_env()
        self._tensor = torchax.tensor.Tensor
        self.jax_device = jax.devices()[0]
        platform.set_device_type("TPU" if self.jax_device.platform == "tpu" else "CPU")
        self.device = torch.device("jax:0")
        self.placement = self.jax_device  # where new arrays go: one device, or a mesh
        self.mesh = None
        self._waits, self._waited_ns = 0, 0.0
        _listen_for_compiles()

    def use_mesh(self, mesh) -> None:
        """Tensor parallel: new arrays (weights before they are sharded, step inputs) are
        replicated over `mesh`, so every graph's arguments live on its devices."""
        from jax.sharding import NamedSharding, PartitionSpec

        self.mesh = mesh
        self.placement = NamedSharding(mesh, PartitionSpec())

    # ---- moving data ----

    def wrap(self, array) -> torch.Tensor:
        return self._tensor(array, self.env)

    def to_device(self, x) -> torch.Tensor:
        """A numpy array or CPU torch tensor, on the device."""
        host = x if isinstance(x, np.ndarray) else host_array(x)
        with x64(True):
            return self.wrap(jax.device_put(host, self.placement))

    def to_device_many(self, xs: list) -> list[torch.Tensor]:
        """Several arrays or CPU tensors moved in one device_put: JAX's bookkeeping per
        call (~0.2 ms on a CPU host) is paid once, not per array (slot writes)."""
        hosts = [x if isinstance(x, np.ndarray) else host_array(x) for x in xs]
        with x64(True):
            return [self.wrap(a) for a in jax.device_put(hosts, self.placement)]

    def to_host(self, t: torch.Tensor) -> np.ndarray:
        return np.asarray(t._elem)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        from torchax.ops import mappings

        with x64(True):
            return self.wrap(jax.device_put(jnp.zeros(shape, mappings.t2j_dtype(dtype)),
                                            self.placement))

    def move_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """Every parameter and buffer of `model` as a device tensor, in place (not as
        nn.Parameter: the engine never trains, and a torchax tensor is not a leaf)."""
        moved: dict[int, torch.Tensor] = {}  # tied weights stay one tensor
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None and not isinstance(t, self._tensor):
                        if id(t) not in moved:
                            moved[id(t)] = self.to_device(t)
                        table[name] = moved[id(t)]
        return model

    def zero_(self, tensors: list[torch.Tensor]) -> None:
        with x64(True):
            for t in tensors:
                t._elem = jnp.zeros_like(t._elem, device=t._elem.sharding)

    # ---- graphs ----

    def make_capture(self, weights: Callable[[], list[torch.Tensor]]):
        return JaxGraphCapture(self, weights)

    def eager(self, fn):
        """fn run op by op (enforce_eager): each torch op a jax op, dispatched at once."""
        def run(*args):
            with x64(True), self.env:
                return fn(*args)
        return run

    def launched(self, captured: bool) -> None:
        pass  # jax launches each call asynchronously by itself

    def wait(self, *tensors) -> None:
        start = time.perf_counter_ns()
        jax.block_until_ready([t._elem for t in tensors])
        self._waits += 1
        self._waited_ns += time.perf_counter_ns() - start

    def execution_stats(self) -> tuple[int, float]:
        """(waits, ns the host spent in them): JAX keeps no execution-time metric, so with
        every graph waited for (step_timing's serialized runs) the device time is the time
        the host blocked after each launch; a graph's execution that overlapped its own
        dispatch is counted as host time."""
        return self._waits, self._waited_ns

    def compile_count(self) -> int:
        return jax_compile_count()

    def matmul_precision(self) -> str:
        return jax_matmul_precision()


class _Graph:
    """One key's jitted graph (or, while it compiles in the background, its Future), the
    weights it reads and its outputs' structure and types."""

    __slots__ = ("jitted", "weights", "out_spec", "out_info")

    def __init__(self, jitted, weights: list, out_spec, out_info) -> None:
        self.jitted, self.weights, self.out_spec, self.out_info = (jitted, weights, out_spec,
                                                                   out_info)

    def executable(self):
        if isinstance(self.jitted, Future):
            self.jitted = self.jitted.result()
        return self.jitted


class JaxGraphCapture:
    """Capture once, replay always, as jax.jit graphs; the same contract as
    runner/lazy_capture.LazyGraphCapture (read its docstring), with one addition: the
    persistent tensors a graph reads without being given them (model weights) are named
    by `weights()`, so that they enter the graph as arguments rather than as constants
    baked into it. Tensor arguments other than `FixedTensors` must not be updated in place.
    """

    def __init__(self, runtime: JaxRuntime, weights: Callable[[], list[torch.Tensor]]) -> None:
        self.rt = runtime
        self.weights = weights
        self.captures = 0
        self._graphs: list[_Graph] = []  # every graph captured, in order
        # The state arrays the last call donated, released at the next call: on JAX's
        # CPU client dropping a donated array's last reference waits for the program that
        # consumed it, which made every launch block for its whole execution there (2.4 of
        # a 4.9 ms step in benchmarks/benchmark_tp_host.py's model).
        self._donated: list = []
        self._pool: ThreadPoolExecutor | None = None  # set while warm-up compiles
        self._pending: list[_Graph] = []
        self.trace_seconds = 0.0  # tracing and lowering, in the caller's thread
        self.compile_seconds = 0.0  # XLA's compiles, summed over the threads they ran in
        # XLA's CPU executables count against the process's mapping limit (map_budget).
        self.map_budget = map_budget.BUDGET if runtime.jax_device.platform == "cpu" else None
        # Read at start, so that a bad VLLM_TPU_LORA_COMPILE_THREADS is refused there.
        self.compile_threads = compile_threads() or min(8, os.cpu_count() or 1)

    @contextmanager
    def background_compiles(self, threads: int | None = None):
        """Inside: a call with a new key is traced and lowered, its XLA compile goes to a
        thread pool, and the call returns zeros of its outputs' types without running
        (the state it would update is left as it is). XLA compiles without the GIL, so
        warm-up overlaps the compiles with each other and with the next graphs' traces
        (the TPU compiled ~11 s per Llama-3.2-1B graph in series). On exit every compile
        is waited for; one that failed raises there. Calls with known keys also return
        zeros inside, so use it only for warm-up. `threads`: default
        VLLM_TPU_LORA_COMPILE_THREADS, else min(8, CPU cores)."""
        threads = threads or self.compile_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="xla-compile")
        try:
            yield
        finally:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True)
            pending, self._pending = self._pending, []
            for graph in pending:
                graph.executable()  # raises what the compile raised

    def compile(self, fn: Callable) -> Callable:
        graphs: dict[Any, _Graph] = {}

        def run(*args):
            tensors, state, key = split_args(args)
            graph = graphs.get(key)
            if graph is None:
                graph = graphs[key] = self._capture(fn, args, tensors, state)
            if self._pool is not None:
                return self._zeros_like_outputs(graph)
            donated = [t._elem for t in state]
            with x64(True):
                outs, new_state = graph.executable()([t._elem for t in tensors], donated,
                                                     graph.weights)
            for t, a in zip(state, new_state):
                t._elem = a
            self._donated = donated  # the previous call's are released here
            return pytree.tree_unflatten([self.rt.wrap(o) for o in outs], graph.out_spec)

        return run

    def _capture(self, fn: Callable, args: tuple, tensors: list, state: list) -> _Graph:
        self.captures += 1
        given = {id(t) for t in tensors} | {id(t) for t in state}
        weights = [w for w in dict.fromkeys(self.weights()) if id(w) not in given]
        out_spec = []
        pins = _layout_pins(self.rt.mesh, state)

        def pure(arg_arrays, state_arrays, weight_arrays):
            swapped = [*tensors, *state, *weights]
            saved = [t._elem for t in swapped]
            try:
                for t, a in zip(swapped, [*arg_arrays, *state_arrays, *weight_arrays]):
                    t._elem = a
                with self.rt.env:
                    out = fn(*args)
                out_leaves, spec = pytree.tree_flatten(out)
                out_spec.append(spec)
                changed = [i for i, (t, a) in enumerate(zip(tensors, arg_arrays))
                           if t._elem is not a]
                if changed:
                    raise TypeError(f"a captured graph updated tensor argument(s) {changed} in "
                                    "place; pass state it updates as FixedTensors (not read_only)")
                return pins([o.jax() for o in out_leaves], [t._elem for t in state])
            finally:
                for t, a in zip(swapped, saved):
                    t._elem = a

        # Named per capture (the HLO module "jit_<fn>_<n>"): a device profile tells the
        # graphs apart by it.
        pure.__name__ = f"{getattr(fn, '__name__', 'graph')}_{self.captures}"
        weight_arrays = [w._elem for w in weights]
        # Traced and compiled ahead of time: the executable is called as it is, so a call
        # whose shapes differ fails instead of silently compiling another graph.
        start = time.perf_counter()
        with x64(True):
            lowered = jax.jit(pure, donate_argnums=(1,)).lower(
                [t._elem for t in tensors], [t._elem for t in state], weight_arrays)
        self.trace_seconds += time.perf_counter() - start
        graph = _Graph(None, weight_arrays, out_spec[0], lowered.out_info[0])
        if self._pool is None:
            graph.jitted = self._compile(lowered, pure.__name__)
        else:
            graph.jitted = self._pool.submit(self._compile, lowered, pure.__name__)
            self._pending.append(graph)
        self._graphs.append(graph)  # only once it has (or will have) an executable
        return graph

    def _compile(self, lowered, name: str):
        budget = self.map_budget
        started = budget.starting() if budget is not None else None
        # Each compile's start and end with the process's memory (DEBUG): a process that
        # dies inside a compile thread (a SIGSEGV at the end of a 128-slot warm-up on the
        # v5e) names the graphs that were in flight and how big it had grown.
        debug = logger.isEnabledFor(logging.DEBUG)
        if debug:
            logger.debug("compile of %s started (rss %d MB)", name, _rss_mb())
        start = time.perf_counter()
        try:
            with x64(True):
                compiled = lowered.compile()
        finally:
            if budget is not None:
                budget.finished(started)
        elapsed = time.perf_counter() - start
        if debug:
            logger.debug("compile of %s done in %.1f s (rss %d MB)", name, elapsed, _rss_mb())
        with _lock:
            self.compile_seconds += elapsed
        return compiled

    @property
    def executables(self) -> list:
        """Every graph's executable, in capture order (tests read their HLO)."""
        return [g.executable() for g in self._graphs]

    def _zeros_like_outputs(self, graph: _Graph):
        """A graph's outputs as zeros, moved rather than computed (a jnp.zeros of a new
        shape would compile)."""
        with x64(True):
            outs = [jax.device_put(np.zeros(o.shape, o.dtype), self.rt.placement)
                    for o in graph.out_info]
        return pytree.tree_unflatten([self.rt.wrap(o) for o in outs], graph.out_spec)


def _rss_mb() -> int:
    """This process's resident memory in MB (-1 where /proc does not say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except (OSError, ValueError, IndexError):
        return -1


def _layout_pins(mesh, state: list):
    """Tensor parallel: a graph's updated state leaves laid out as it came in (so it is
    donated in place and the next call matches the compiled input layout) and its outputs
    replicated (a forward's output is the sampler graph's input, whichever bucket made
    it). One device: nothing to pin."""
    if mesh is None:
        return lambda outs, new_state: (outs, new_state)
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())
    layouts = [t._elem.sharding for t in state]

    def pin(outs, new_state):
        wsc = jax.lax.with_sharding_constraint
        return ([wsc(o, replicated) for o in outs],
                [wsc(a, s) for a, s in zip(new_state, layouts)])
    return pin
