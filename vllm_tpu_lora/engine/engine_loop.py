"""EngineLoop: the one thread that owns an LLMEngine (the AsyncLLMEngine's back half).

LLMEngine is not thread-safe, so nothing else ever touches it. The loop applies queued
commands (callables `fn(engine)`, each with an optional future for its result) *between*
steps, runs step(), and posts results back to the event loop through callbacks the
AsyncLLMEngine supplies; it never waits for the event loop. While no request is unfinished
it blocks on the command queue instead of spinning.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from vllm_tpu_lora.config import EngineArgs

logger = logging.getLogger(__name__)

SHUTDOWN = object()
# Wait this long for commands when requests exist but nothing could be scheduled, instead of
# spinning on step() (e.g. every waiting request needs blocks that running ones hold).
_IDLE_POLL_S = 0.005
_ADAPTER_STATS_S = 0.25


class EngineStepError(RuntimeError):
    """A step failed while this request was running; the request was aborted."""


class EngineLoop:
    def __init__(self, engine_args: EngineArgs, *, post: Callable[..., None],
                 on_outputs: Callable, on_failed: Callable, on_resolve: Callable) -> None:
        """post(fn, *args) runs fn(*args) on the event loop; the on_* callbacks are what it
        runs: on_outputs(outputs), on_failed(request_ids, exc), on_resolve(fut, result, exc)."""
        self.engine_args = engine_args
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self._post, self._on_outputs = post, on_outputs
        self._on_failed, self._on_resolve = on_failed, on_resolve
        self.stats: dict[str, Any] = {}  # replaced whole each iteration: safe to read
        self._live: set[str] = set()  # request ids the engine holds
        self._pending_removals: set[int] = set()
        self._step_failures = 0
        self._adapter_stats_at = 0.0

    def submit(self, fn: Callable[[Any], Any], fut=None) -> None:
        self.commands.put((fn, fut))

    # ---- start-up ----

    def build(self, preload_loras: list):
        """The LLMEngine, with `preload_loras` in its host cache, then precompiled: adapters
        go in before compiling so a bad one fails start-up in seconds, not after a warm-up
        (minutes on TPU). precompile() clears device slots only, not the host cache."""
        from vllm_tpu_lora.engine.llm_engine import LLMEngine  # heavy: torch_xla

        args = self.engine_args
        engine = LLMEngine.from_engine_args(dataclasses.replace(args, precompile=False))
        for lora in preload_loras:
            try:
                engine_method(engine, "add_lora")(lora)
            except ValueError as e:
                raise ValueError(f"Failed to load LoRA adapter '{lora.lora_name}': {e}") from None
        if args.precompile:  # what from_engine_args would have done
            engine.runner.precompile()
            logger.info("precompiled %d graphs in %.1fs", engine.runner.num_graphs,
                        engine.runner.warmup_seconds)
        self.publish_stats(engine)
        return engine

    # ---- the loop ----

    def serve(self, engine) -> None:
        """Run until SHUTDOWN. An exception escaping this is a bug: the engine is dead."""
        while True:
            busy = engine.has_unfinished_requests()
            if not self._apply_commands(engine, block=not busy):
                return
            outputs = []
            if engine.has_unfinished_requests():
                steps_before = engine.num_steps
                outputs = self._step(engine)
                if engine.num_steps == steps_before and not self._step_failures:
                    self._apply_commands(engine, block=True, timeout=_IDLE_POLL_S)
            if self._pending_removals:
                self._retry_removals(engine)
            # Stats first, then outputs: whoever sees a request finish sees stats that
            # already account for it.
            self.publish_stats(engine)
            if outputs:
                self._post(self._on_outputs, outputs)

    def _apply_commands(self, engine, block: bool, timeout: float | None = None) -> bool:
        """Apply every queued command (waiting for the first if `block`). False on SHUTDOWN."""
        try:
            cmd = self.commands.get(timeout=timeout) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is SHUTDOWN:
                return False
            fn, fut = cmd
            try:
                result, error = fn(engine), None
            except Exception as e:  # noqa: BLE001 - goes back to the caller
                result, error = None, e
            if fut is not None:
                self._post(self._on_resolve, fut, result, error)
            elif error is not None:
                logger.warning("engine command failed: %r", error)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self, engine) -> list:
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            self._on_step_error(engine, e)
            return []
        self._step_failures = 0
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        return outputs

    def _on_step_error(self, engine, exc: Exception) -> None:
        self._step_failures += 1
        # The requests the step was running; after a second failure in a row, everything
        # (the failure may come from a request that is not in the running set yet).
        affected = engine.running_request_ids() & self._live
        if not affected or self._step_failures > 1:
            affected = set(self._live)
        logger.error("engine step failed; aborting %d request(s)", len(affected),
                     exc_info=exc)
        engine.abort_request(sorted(affected))  # if this raises, the loop is broken: dead
        self._live -= affected
        self._post(self._on_failed, sorted(affected), EngineStepError(f"engine step failed: {exc!r}"))

    # ---- commands (run in this thread, between steps) ----

    def add(self, engine, request_id, prompt, params, lora_request) -> None:
        engine.add_request(request_id, prompt, params, lora_request=lora_request)
        self._live.add(request_id)

    def abort(self, engine, request_ids: list[str]) -> None:
        engine.abort_request(request_ids)
        self._live.difference_update(request_ids)

    def remove_lora(self, engine, lora_int_id: int) -> bool:
        remove = engine_method(engine, "remove_lora")
        if engine.lora_users(lora_int_id):
            # LLMEngine refuses to remove an adapter that unfinished sequences still use;
            # the server has already stopped routing requests to it, so free it when the
            # last of them ends.
            self._pending_removals.add(lora_int_id)
            return True
        return remove(lora_int_id)

    def _retry_removals(self, engine) -> None:
        for lora_id in list(self._pending_removals):
            if not engine.lora_users(lora_id):
                engine.remove_lora(lora_id)
                self._pending_removals.discard(lora_id)

    def publish_stats(self, engine) -> None:
        # Per-adapter stats cost O(known adapters): refreshed every _ADAPTER_STATS_S while
        # busy, and whenever the engine goes idle (so a finished workload reads exact ones).
        now = time.monotonic()
        fresh = (now - self._adapter_stats_at >= _ADAPTER_STATS_S
                 or not engine.has_unfinished_requests())
        stats = dict(engine.stats(per_adapter=fresh))
        if fresh:
            self._adapter_stats_at = now
        else:
            stats["loras"] = self.stats.get("loras", {})
        stats["num_unfinished_requests"] = engine.get_num_unfinished_requests()
        stats["num_pending_lora_removals"] = len(self._pending_removals)
        self.stats = stats  # one reference swap: readers on the loop see old or new


def engine_method(engine, name: str) -> Callable:
    method = getattr(engine, name, None)
    if method is None:
        raise ValueError(f"This engine does not support LoRA adapters ({name} is missing).")
    return method
