"""AsyncLLMEngine: the LLMEngine step loop in one background thread, asyncio streams in front.

Why this shape:
- LLMEngine is not thread-safe, and a step (tens of ms on CPU, a device round trip on TPU)
  must never run on the event loop. So exactly one thread owns the engine: it builds it,
  applies the commands the event loop sends (add, abort, add_lora, ...) *between* steps,
  runs step(), and hands the step's outputs back in a single `loop.call_soon_threadsafe`.
  HTTP handlers only enqueue commands and await futures and streams; they never wait for a
  step to finish, and a step never waits for them.
- RequestOutputs are cumulative, so a request's stream keeps only the newest one: a slow
  client skips intermediate states instead of growing a queue.
- Abort is the one way resources are released: a stream that is closed before its request
  finished (client disconnect, cancellation, error) sends an abort, which frees the
  request's KV blocks and its adapter reference in the engine.
- A step that raises fails the requests it was running (their streams raise
  EngineStepError) and the loop keeps serving; only an error outside a step (a bug in the
  loop itself) kills the engine, and then every stream and pending call fails with
  EngineDeadError and /health reports it.

This file is the event-loop half; the engine-thread half is engine_loop.EngineLoop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_tpu_lora.config import EngineArgs
from vllm_tpu_lora.engine.engine_loop import (
    SHUTDOWN,
    EngineLoop,
    EngineStepError,
    engine_method,
)
from vllm_tpu_lora.outputs import RequestOutput
from vllm_tpu_lora.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineStepError", "RequestStream"]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class RequestStream:
    """One request's outputs, newest only; iterate it until the request finishes."""

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort_fn = abort
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False
        self.aborted = False

    # -- called on the event loop by the engine's dispatch --
    def put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    # -- consumer side --
    async def get(self) -> RequestOutput:
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._latest is None:
            self.finished = True  # the engine already dropped the request
            raise self._error
        out, self._latest = self._latest, None
        self.finished = out.finished
        return out

    # A plain async iterator, not a generator: nothing hidden that only GC would close.
    # Whoever stops iterating early must call abort() (generate() and the server do);
    # a cancelled wait aborts by itself (a client disconnect cancels the handler).
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            return await self.get()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Idempotent; a no-op once the request finished."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._abort_fn(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine_args: EngineArgs | None, *, llm_engine=None) -> None:
        """Builds its LLMEngine from engine_args in start(); or adopts a built `llm_engine`
        (see from_llm_engine)."""
        self.engine_args = engine_args
        self._prebuilt = llm_engine
        self._worker = EngineLoop(engine_args, post=self._post, on_outputs=self._dispatch,
                                  on_failed=self._fail, on_resolve=_resolve)
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._pending: set[asyncio.Future] = set()  # event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        # Immutable facts about the engine, set once it is built.
        self.model_config = None
        self.max_model_len: int | None = None

    @classmethod
    def from_llm_engine(cls, llm_engine) -> AsyncLLMEngine:
        """Serve an LLMEngine built elsewhere (tests, embedding). Nothing else may touch it
        until shutdown() returns."""
        return cls(None, llm_engine=llm_engine)

    # ---- lifecycle (event loop) ----

    async def start(self, preload_loras: list | None = None) -> None:
        """Build the engine in the engine thread, load `preload_loras` into it, then
        precompile; raise the first error. Adapters are loaded before compiling so that a
        bad one fails start-up in seconds, not after a (on TPU: minutes long) warm-up."""
        self._loop = asyncio.get_running_loop()
        ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._thread_main,
                                        args=(ready, list(preload_loras or [])),
                                        name="llm-engine-loop", daemon=True)
        self._thread.start()
        await ready

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._worker.commands.put(SHUTDOWN)
            self._thread.join(timeout)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._dead!r}")

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of the end of its last loop iteration, plus the server's
        view: streams still open. Never calls into the engine from the event loop."""
        return {**self._worker.stats, "num_open_streams": len(self._streams), "engine_dead": self.is_dead}

    # ---- requests (event loop) ----

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          lora_request: Any = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it, or raises the
        engine's ValueError (nothing was added)."""
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id} already running.")
        stream = RequestStream(request_id, self.abort)
        self._streams[request_id] = stream
        try:
            await self._call(lambda e: self._worker.add(e, request_id, prompt, params,
                                                        lora_request))
        except asyncio.CancelledError:
            stream.abort()  # the add may still be applied: abort follows it in FIFO order
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            stream.finished = True  # rejected: nothing to abort
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLMEngine.generate: cumulative outputs until finished."""
        stream = await self.add_request(request_id, prompt, params, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._streams.pop(rid, None)
        if self._dead is None:
            self._worker.submit(lambda e: self._worker.abort(e, ids))

    # ---- adapters (event loop) ----

    async def add_lora(self, lora_request: Any, load_inplace: bool = False) -> bool:
        return await self._call(lambda e: engine_method(e, "add_lora")(
            lora_request, load_inplace=load_inplace))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Free the adapter; if running requests still use it, it is freed once they end."""
        return await self._call(lambda e: self._worker.remove_lora(e, lora_int_id))

    async def reset_prefix_cache(self) -> bool:
        return await self._call(lambda e: engine_method(e, "reset_prefix_cache")())

    async def list_loras(self) -> set[int]:
        return await self._call(lambda e: set(engine_method(e, "list_loras")()))

    async def pin_lora(self, lora_int_id: int) -> bool:
        return await self._call(lambda e: engine_method(e, "pin_lora")(lora_int_id))

    # ---- plumbing (event loop side) ----

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) in the engine thread between steps; return or raise its result."""
        self.check_health()
        fut = self._loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self._worker.submit(fn, fut)
        return await fut

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.error is not None:
                stream.fail(out.error)  # failed on its own (e.g. its adapter): an error
            elif stream is not None:
                stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.fail(exc)

    def _fail_everything(self, exc: BaseException) -> None:
        self._fail(list(self._streams), exc)
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(exc)

    def _post(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    # ---- the engine thread ----

    def _thread_main(self, ready: asyncio.Future, preload_loras: list) -> None:
        try:
            if self._prebuilt is not None:
                engine = self._prebuilt
                for lora in preload_loras:
                    engine_method(engine, "add_lora")(lora)
                self._worker.publish_stats(engine)
            else:
                engine = self._worker.build(preload_loras)
            self.model_config = engine.config.model_config
            self.max_model_len = engine.max_model_len
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._post(_resolve, ready, None, e)
            return
        self._post(_resolve, ready, True, None)
        try:
            self._worker.serve(engine)
        except BaseException as e:  # noqa: BLE001 - a bug in the loop: the engine is dead
            logger.exception("engine loop died")
            self._dead = e
            self._post(self._fail_everything, EngineDeadError(f"engine loop died: {e!r}"))


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

