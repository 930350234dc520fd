"""What differs between the two runtimes the one runner drives, and nothing else.

- torch_xla: torch tensors on an XLA device, graphs captured lazily and replayed by hash
  (runner/lazy_capture.py), Pallas kernels through torch_xla's `call_jax`.
- jax: the same torch modules on torchax tensors (torch views of jax arrays), each graph a
  `jax.jit` function with the state it updates donated (runner/jax_runtime.py), Pallas
  kernels called natively. Runs where torch_xla cannot: current JAX, current torch.

A runtime moves modules and arrays to its device and back, makes the capture that turns a
step function into a replayed graph, and counts its own compilations. Scheduling, input
preparation, bucket keys, the LoRA manager and the sampler's math are the runner's, shared.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_tpu_lora import platform
from vllm_tpu_lora.config import RUNTIMES


def resolve_runtime(name: str = "auto") -> str:
    """"auto": the jax runtime where torch_xla is not installed and on a TPU (where
    torch_xla 2.9's libtpu cannot share the machine with current JAX; see the README);
    torch_xla elsewhere, the stack the CPU numbers were tuned on."""
    if name not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {name!r}")
    if name != "auto":
        return name
    if not platform.torch_xla_available() or platform.is_tpu():
        return "jax"
    return "torch_xla"


def make_runtime(name: str):
    name = resolve_runtime(name)
    if name == "jax":
        from vllm_tpu_lora.runner.jax_runtime import JaxRuntime

        return JaxRuntime()
    return TorchXLARuntime()


class TorchXLARuntime:
    name = "torch_xla"
    # Transfers stay on the engine thread: a lazy tensor made on another thread would
    # join whatever graph that thread's XLA context is tracing.
    transfers_from_any_thread = False

    def __init__(self) -> None:
        self.device = platform.xla_device()

    def move_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def to_device(self, x) -> torch.Tensor:
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x)
        return x.to(self.device)

    def to_device_many(self, xs: list) -> list[torch.Tensor]:
        return [self.to_device(x) for x in xs]

    def to_host(self, t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy()

    def make_capture(self, weights=None):
        """A capture for graphs over this runtime's tensors (weights: read by the jax
        runtime; torch_xla keeps persistent tensors in the graph by itself)."""
        from vllm_tpu_lora.runner.lazy_capture import LazyGraphCapture

        return LazyGraphCapture()

    def eager(self, fn):
        """fn run op by op (enforce_eager): traced lazily, cut and launched by `launched`."""
        return fn

    def launched(self, captured: bool) -> None:
        """After a graph call: lazy mode cuts the trace here and launches it."""
        if not captured:
            platform.sync()

    def wait(self, *tensors) -> None:
        """Block until every launched execution (the ones producing `tensors`) is done."""
        platform.wait_device_ops()

    def zero_(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            t.zero_()
        platform.sync()

    def compile_count(self) -> int:
        return platform.compile_count()

    def execution_stats(self) -> tuple[int, float]:
        """(graph executions, their device ns) so far: torch_xla's ExecuteTime metric."""
        import torch_xla.debug.metrics as met

        data = met.metric_data("ExecuteTime")
        return (int(data[0]), float(data[1])) if data else (0, 0.0)

    def matmul_precision(self) -> str:
        import torch_xla.backends

        return torch_xla.backends.get_mat_mul_precision()
