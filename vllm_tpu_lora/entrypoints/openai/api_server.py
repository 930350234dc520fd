"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncLLMEngine.

    vllm-tpu-lora serve MODEL [--enable-lora --lora-modules name=path ...]
    python -m vllm_tpu_lora.entrypoints.openai.api_server --model MODEL

Start-up order: check the arguments and adapter paths (cheap, fails fast), build and
precompile the engine in its thread, load --lora-modules through the engine, and only then
listen, so /health answering means the server is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

import vllm_tpu_lora
from vllm_tpu_lora.config import EngineArgs, api_key_from_env, runtime_lora_updating_allowed
from vllm_tpu_lora.entrypoints.args import engine_kwargs
from vllm_tpu_lora.entrypoints.openai.cli_args import (
    apply_demo_defaults,
    make_arg_parser,
    model_of,
)
from vllm_tpu_lora.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from vllm_tpu_lora.entrypoints.openai.protocol import (
    APIError,
    BaseModelPath,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from vllm_tpu_lora.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_tpu_lora.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_tpu_lora.entrypoints.openai.serving_engine import as_api_error
from vllm_tpu_lora.entrypoints.openai.serving_models import OpenAIServingModels

logger = logging.getLogger("vllm_tpu_lora.api_server")


def error_json(err: APIError) -> JSONResponse:
    return JSONResponse(err.response().model_dump(), status_code=int(err.status))


# What answers without the API key: liveness, and the Prometheus counters (as vLLM
# leaves them). Everything else needs it: /stats names every adapter and its activity,
# /reset_prefix_cache would let anyone flush every tenant's cached prefixes.
_OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which gets in the way of streaming and of
    disconnect detection). Every path but _OPEN_PATHS needs the key."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"] not in _OPEN_PATHS
                and not authorized(Headers(scope=scope).get("authorization"), self.api_key)):
            await error_json(UNAUTHORIZED)(scope, receive, send)
            return
        await self.app(scope, receive, send)


UNAUTHORIZED = APIError("Unauthorized: missing or invalid API key.", HTTPStatus.UNAUTHORIZED,
                        "AuthenticationError")


def authorized(header: str | None, api_key: str | None) -> bool:
    """An Authorization header value against the server's key (None: no key set)."""
    if not api_key:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {api_key}".encode())


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _run_or_abort(coro, request: Request):
    """Run a handler, cancelling it if the client goes away first (its engine requests are
    then aborted by their streams). Streaming responses take over the watch once they start."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or the server is shutting down)
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # client closed request; nobody reads this
    return task.result()


def _respond(result):
    if isinstance(result, Response):
        return result
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return Response(result.model_dump_json(), media_type="application/json")


def build_app(engine, models: OpenAIServingModels, completion: OpenAIServingCompletion,
              chat: OpenAIServingChat, metrics: ServerMetrics, api_key: str | None) -> FastAPI:
    app = FastAPI(title="vllm_tpu_lora OpenAI-compatible server")

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_json(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        where = [".".join(str(p) for p in e["loc"][1:]) for e in errors]
        message = "; ".join(f"{w or 'body'}: {e['msg']}" for w, e in zip(where, errors))
        return error_json(APIError(message or "Invalid request",
                                   param=where[0] if where and where[0] else None))

    @app.exception_handler(HTTPException)
    async def _http_error(_, exc: HTTPException):
        err = ErrorResponse(error=ErrorInfo(message=str(exc.detail), code=exc.status_code,
                                            type=HTTPStatus(exc.status_code).phrase))
        return JSONResponse(err.model_dump(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _any_error(_, exc: Exception):
        return error_json(as_api_error(exc))

    @app.get("/health")
    async def health():
        if engine.is_dead:
            return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": vllm_tpu_lora.__version__})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def engine_stats():
        """Debug: the engine's stats() snapshot as JSON (what /metrics is built from), and
        each LoRA resolver's lookups, hits and downloads."""
        return JSONResponse({**engine.stats(), "lora_resolvers": models.resolver_stats()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: forget every cached KV block (e.g. after changing an adapter's files
        outside the server's knowledge, or to benchmark cold). Requests in flight continue."""
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(models.show_available_models().model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return _respond(await _run_or_abort(completion.create_completion(body), raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return _respond(await _run_or_abort(chat.create_chat_completion(body), raw))

    # vLLM registers these only when runtime updating is allowed: otherwise they are 404.
    if runtime_lora_updating_allowed():
        logger.warning("LoRA dynamic loading & unloading is enabled in the API server. "
                       "This should ONLY be used for local development!")

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            return Response(await models.load_lora_adapter(body), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return Response(await models.unload_lora_adapter(body), media_type="text/plain")

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    with suppress(OSError):
        with open(value) as f:
            return f.read()
    return value  # not a file: the template itself


@dataclass
class Server:
    """A built server: its app and what the app serves (see build_server)."""
    app: FastAPI
    engine: Any  # AsyncLLMEngine
    models: OpenAIServingModels


async def build_server(args: argparse.Namespace) -> Server:
    """Everything `serve` runs except the listening socket: check the arguments and adapter
    paths, build and precompile the engine, load --lora-modules, build the app. Ray Serve's
    replicas (entrypoints/ray_serve.py) run this same app in-process."""
    from transformers import AutoTokenizer

    from vllm_tpu_lora.engine.async_engine import AsyncLLMEngine

    model = model_of(args)
    engine_args = EngineArgs.from_kwargs(model=model, **engine_kwargs(args))
    config = engine_args.create_engine_config()  # config errors before any compiling
    if args.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = args.served_model_name or [model]
    base_paths = [BaseModelPath(name, model) for name in names]
    engine = AsyncLLMEngine(engine_args)
    models = OpenAIServingModels(engine, base_paths, lora_modules=args.lora_modules,
                                 allowed_lora_dirs=args.allowed_lora_dirs,
                                 max_model_len=config.model_config.max_model_len,
                                 resolvers=_resolvers(args, engine_args.enable_lora))
    static_loras = models.prepare_static_loras()  # before compiling: fails fast
    await engine.start(preload_loras=static_loras)
    models.register_static_loras()
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model_config.tokenizer_path)
        metrics = ServerMetrics(engine, models.resolver_stats if models.resolvers else None)
        common = dict(max_model_len=engine.max_model_len)
        completion = OpenAIServingCompletion(engine, models, tokenizer, metrics, **common)
        chat = OpenAIServingChat(engine, models, tokenizer, metrics, **common,
                                 chat_template=_chat_template(args.chat_template))
        app = build_app(engine, models, completion, chat, metrics,
                        args.api_key or api_key_from_env())
    except BaseException:
        engine.shutdown()
        raise
    return Server(app, engine, models)


async def run_server(args: argparse.Namespace) -> None:
    server = await build_server(args)
    try:
        await _serve_http(server.app, args)
    finally:
        server.engine.shutdown()


async def _serve_http(app: FastAPI, args: argparse.Namespace) -> None:
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    logger.info("serving on http://%s:%d", args.host or "0.0.0.0", args.port)
    await server.serve()
    if not server.started:  # e.g. the port was taken; uvicorn logged why
        raise OSError(f"could not listen on {args.host}:{args.port}")


def _resolvers(args: argparse.Namespace, enable_lora: bool) -> list:
    """--lora-resolver-uri values (and VLLM_LORA_RESOLVER_CACHE_DIR) as resolvers."""
    from vllm_tpu_lora.lora.resolvers import DownloadCache, make_resolvers

    uris = getattr(args, "lora_resolver_uris", None) or []
    if not uris and not os.environ.get("VLLM_LORA_RESOLVER_CACHE_DIR"):
        return []
    if not enable_lora:
        raise ValueError("--lora-resolver-uri needs --enable-lora")
    root = args.lora_resolver_cache_dir or os.path.expanduser("~/.cache/vllm_tpu_lora/lora_resolver")
    return make_resolvers(uris, DownloadCache(root, int(args.lora_resolver_cache_gb * 2**30)))


def run(args: argparse.Namespace) -> int:
    if not (getattr(args, "model_tag", None) or args.model):
        apply_demo_defaults(args)  # no model: serve the bundled demo model and adapters
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    asyncio.run(run_server(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = make_arg_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr: what a stuck server
    (engine thread, loader, event loop) is doing, without stopping it. Only in a process
    that is the server (`python -m ...api_server`): a library must not take a signal from
    its host process (in a test process it crashed XLA's compiler)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)


if __name__ == "__main__":
    _dump_stacks_on_sigusr1()
    sys.exit(main())
