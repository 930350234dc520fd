"""Counts XLA compilations after warm-up; in checking mode a new graph is an error.

On a TPU a compile in the serving loop stalls every request for seconds, so after
`precompile()` none may happen. Tests run with VLLM_TPU_LORA_CHECK_RECOMPILATION=1.
"""

from __future__ import annotations

import contextlib

from vllm_tpu_lora import platform
from vllm_tpu_lora.config import check_recompilation_enabled


class RecompilationError(RuntimeError):
    pass


class CompileGuard:
    """Counts the compilations that happen *inside* watched regions, so several engines in
    one process (tests) don't charge each other's warm-ups."""

    def __init__(self) -> None:
        self.strict = check_recompilation_enabled()
        self.armed = False
        self.compilations_after_warmup = 0

    def arm(self) -> None:
        """Warm-up is over: from now on every compile counts."""
        self.armed = True

    @contextlib.contextmanager
    def watch(self, where: str):
        before = platform.compile_count()
        yield
        new = platform.compile_count() - before
        if not self.armed or new <= 0:
            return
        self.compilations_after_warmup += new
        if self.strict:
            raise RecompilationError(
                f"{new} XLA compilation(s) after warm-up in {where}; every shape must be "
                "precompiled (VLLM_TPU_LORA_CHECK_RECOMPILATION=1)"
            )
