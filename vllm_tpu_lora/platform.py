"""The one place that knows which device we run on, and torch_xla's helpers.

PJRT_DEVICE must be decided before torch_xla is imported, so every module that needs
torch_xla imports it through here. torch_xla itself is imported only when a torch_xla
function is called: the jax runtime (runner/jax_runtime.py) runs where torch_xla is not
installed, and sets PJRT_DEVICE to the platform JAX found, so `is_tpu()` answers for both.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os


def _tpu_present() -> bool:
    # A TPU VM exposes accelerator device nodes; libtpu is the runtime that drives them.
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        try:
            import libtpu  # noqa: F401

            return True
        except ImportError:
            pass
    # Without torch_xla only the jax runtime can run, and JAX knows its platform (a
    # sandboxed TPU host may show no device node, and JAX may bundle its libtpu).
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None and importlib.util.find_spec("jax"):
        import jax

        return jax.default_backend() == "tpu"
    return False


if "PJRT_DEVICE" not in os.environ:
    os.environ["PJRT_DEVICE"] = "TPU" if _tpu_present() else "CPU"

logger = logging.getLogger(__name__)


def device_type() -> str:
    return os.environ["PJRT_DEVICE"].upper()


def is_tpu() -> bool:
    return device_type() == "TPU"


def set_device_type(name: str) -> None:
    """What the jax runtime found (JAX picks its platform itself): "TPU" or "CPU"."""
    os.environ["PJRT_DEVICE"] = name.upper()


def torch_xla_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


def xla_device():
    import torch_xla

    return torch_xla.device()


def sync() -> None:
    """Cut the lazy graph here and launch it."""
    import torch_xla

    torch_xla.sync()


def wait_device_ops() -> None:
    """Block until every launched XLA execution has finished."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


def optimization_barrier(tensors: list) -> None:
    """An XLA optimization barrier over `tensors` (in place): the compiler may not move or
    merge computation across it. Inside a jax-runtime graph the tensors are torchax
    tensors and the barrier is JAX's."""
    from vllm_tpu_lora.torchax_compat import is_torchax_tensor

    if tensors and is_torchax_tensor(tensors[0]):
        import jax

        arrays = jax.lax.optimization_barrier([t._elem for t in tensors])
        for t, a in zip(tensors, arrays):
            t._elem = a
        return
    import torch_xla.core.xla_model as xm

    xm.optimization_barrier_(tensors)


_cache_initialized = False


def trace_scope(name: str, like):
    """A named scope for profiles: inside a jax-runtime graph (`like` a torchax tensor)
    the ops traced in it carry `name` in their HLO metadata, so a device profile can tell
    them apart (benchmarks/profile_step.py). Elsewhere nothing."""
    from vllm_tpu_lora.torchax_compat import is_torchax_tensor

    if is_torchax_tensor(like):
        import jax

        return jax.named_scope(name)
    return contextlib.nullcontext()


def enable_persistent_cache(path: str) -> bool:
    """torch_xla's persistent compilation cache, where the runtime can use it.

    Only on TPU: PJRT CPU cannot deserialize executables ("Deserializing serialized
    executable not supported"), so on CPU every start compiles afresh. torch_xla takes it
    only before the process's first XLA computation (an engine made after any tensor work
    on the TPU found it asserting "Computation cache has already been initialized"); after
    that the engine runs without it, with a warning. Later calls are no-ops.
    """
    global _cache_initialized
    if _cache_initialized or not is_tpu():
        return _cache_initialized
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        logger.warning(
            "persistent compilation cache not enabled: this process ran XLA computations "
            "before its first engine; graphs compile afresh")
        return False
    xr.initialize_cache(path, readonly=False)
    _cache_initialized = True
    return True


def jax_device_count(num_devices: int) -> int:
    """JAX's device count for tensor parallelism over `num_devices` (the jax runtime).
    On CPU, before JAX starts its backend, the process gets `num_devices` virtual CPU
    devices (JAX's `jax_num_cpu_devices`)."""
    import jax

    if os.environ.get("PJRT_DEVICE", "CPU") == "CPU" and not _jax_backend_started():
        jax.config.update("jax_num_cpu_devices", num_devices)
    count = jax.device_count()
    kind = jax.devices()[0].platform.upper()
    if num_devices > count:
        hint = " (start the process with more virtual CPU devices)" if kind == "CPU" else ""
        raise ValueError(f"tensor_parallel_size ({num_devices}) is larger than the number of "
                         f"{kind} devices ({count}){hint}.")
    if count % num_devices:
        raise ValueError(f"The number of {kind} devices ({count}) must be a multiple of "
                         f"tensor_parallel_size ({num_devices}).")
    return count


def _jax_backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def enable_spmd(num_devices: int) -> int:
    """Run every later XLA computation of this process as one SPMD program over all devices
    (torch_xla's `use_spmd`); return the device count. For tensor parallelism.

    Must run before any XLA tensor is created: tensors made earlier on the plain device
    get replicated to every device. On CPU without CPU_NUM_DEVICES, and before the XLA
    runtime starts, the process gets `num_devices` virtual CPU devices.
    """
    import torch_xla
    import torch_xla.runtime as xr

    if (device_type() == "CPU" and "CPU_NUM_DEVICES" not in os.environ
            and not torch_xla._XLAC._xla_runtime_is_initialized()):
        os.environ["CPU_NUM_DEVICES"] = str(num_devices)
    count = xr.global_runtime_device_count()
    if num_devices > count:
        hint = " (set CPU_NUM_DEVICES before the process starts XLA)" if device_type() == "CPU" else ""
        raise ValueError(f"tensor_parallel_size ({num_devices}) is larger than the number of "
                         f"{device_type()} devices ({count}){hint}.")
    if count % num_devices:
        raise ValueError(f"The number of {device_type()} devices ({count}) must be a multiple of "
                         f"tensor_parallel_size ({num_devices}).")
    if not xr.is_spmd():
        xr.use_spmd()
    return count


def compile_count() -> int:
    """Number of torch_xla graph compilations in this process so far."""
    import torch_xla.debug.metrics as xla_metrics

    data = xla_metrics.metric_data("CompileTime")
    return int(data[0]) if data else 0
