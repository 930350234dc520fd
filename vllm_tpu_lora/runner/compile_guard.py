"""Counts XLA compilations and graph captures after warm-up; in checking mode either is
an error (a capture re-runs the model's Python, and usually compiles a new graph).
Compilations are counted by the runtime: torch_xla's CompileTime metric, or JAX's own
compile events on the jax runtime.

On a TPU a compile in the serving loop stalls every request for seconds, so after
`precompile()` none may happen. Tests run with VLLM_TPU_LORA_CHECK_RECOMPILATION=1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from vllm_tpu_lora import platform
from vllm_tpu_lora.config import check_recompilation_enabled


class RecompilationError(RuntimeError):
    pass


class CompileGuard:
    """Counts the compilations that happen *inside* watched regions, so several engines in
    one process (tests) don't charge each other's warm-ups."""

    def __init__(self, capture=None, compile_count: Callable[[], int] = platform.compile_count
                 ) -> None:
        self.capture = capture  # a graph capture: late captures count like compiles
        self.compile_count = compile_count
        self.strict = check_recompilation_enabled()
        self.armed = False
        self.compilations_after_warmup = 0
        self.captures_after_warmup = 0

    def arm(self) -> None:
        """Warm-up is over: from now on every compile counts."""
        self.armed = True

    def _captures(self) -> int:
        return self.capture.captures if self.capture is not None else 0

    @contextlib.contextmanager
    def watch(self, where: str):
        before, captures_before = self.compile_count(), self._captures()
        yield
        new = self.compile_count() - before
        recaptured = self._captures() - captures_before
        if not self.armed or (new <= 0 and recaptured <= 0):
            return
        self.compilations_after_warmup += max(new, recaptured)
        self.captures_after_warmup += recaptured
        if self.strict:
            raise RecompilationError(
                f"{new} XLA compilation(s) and {recaptured} graph capture(s) after warm-up "
                f"in {where}; every graph key must be captured at precompile "
                "(VLLM_TPU_LORA_CHECK_RECOMPILATION=1)"
            )
