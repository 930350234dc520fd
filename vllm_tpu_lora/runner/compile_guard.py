"""Counts XLA compilations after warm-up; in checking mode a new graph is an error.

On a TPU a compile in the serving loop stalls every request for seconds, so after
`precompile()` none may happen. Tests run with VLLM_TPU_LORA_CHECK_RECOMPILATION=1.
"""

from __future__ import annotations

from vllm_tpu_lora import platform
from vllm_tpu_lora.config import check_recompilation_enabled


class RecompilationError(RuntimeError):
    pass


class CompileGuard:
    def __init__(self) -> None:
        self.strict = check_recompilation_enabled()
        self._baseline: int | None = None
        self.compilations_after_warmup = 0

    def arm(self) -> None:
        """Warm-up is over: from now on every compile counts."""
        self._baseline = platform.compile_count()

    @property
    def armed(self) -> bool:
        return self._baseline is not None

    def check(self, where: str) -> None:
        if self._baseline is None:
            return
        now = platform.compile_count()
        new = now - self._baseline
        if new <= 0:
            return
        self._baseline = now
        self.compilations_after_warmup += new
        if self.strict:
            raise RecompilationError(
                f"{new} XLA compilation(s) after warm-up in {where}; every shape must be "
                "precompiled (VLLM_TPU_LORA_CHECK_RECOMPILATION=1)"
            )
