"""Scale-out on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint, each
request routed to a replica that already holds its adapter.

    vllm-tpu-lora serve-ray MODEL --num-replicas 2 --enable-lora --lora-modules a=/p ...
    app = build_openai_app(args)          # for your own Serve applications

Shape:
- `EngineReplica` (N replicas): each builds exactly the app `serve` runs
  (api_server.build_server: engine, adapters, handlers, errors, streaming) and serves it
  in-process: `http()` feeds one HTTP request to the app through ASGI and streams the
  response back. Nothing of the protocol is re-implemented here.
- `OpenAIIngress` (one replica, no CPU): the HTTP face. It forwards each request to a
  replica with the request's `model` as Serve's multiplexed model id (the base model is
  its own id), so Serve's multiplexing routes it to a replica that already loaded that
  adapter; `max_num_models_per_replica` is the engine's host cache (`max_cpu_loras`) plus
  the base model. Adapter loads/unloads and prefix-cache resets are broadcast to every
  replica; adapters loaded at runtime are also named in each forwarded request, so a
  replica that replaced a dead one learns them on first use.
- Replica failure: Serve replaces a dead replica; a request whose replica died before
  answering is retried on another (safe: greedy and seeded sampling are deterministic),
  one that dies mid-stream ends with an in-band error event.

This module imports neither torch nor the engine at import time: the ingress process
stays small, and only replicas build engines.
"""

import argparse
import asyncio
import json
import logging
import os
from typing import Any

# Real annotations, not strings (no `from __future__ import annotations`): Serve rebuilds
# the ingress routes' signatures elsewhere, where a string "Request" would not resolve.
from fastapi import Request

logger = logging.getLogger(__name__)

APP_NAME = "vllm_tpu_lora"
# Forwarded to every replica (a joined cluster's workers do not share this process's env).
_ENV_PREFIXES = ("VLLM_", "PJRT_", "XLA_", "TPU_", "HF_", "TRANSFORMERS_")
_BROADCAST_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache")
_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# A request whose replica died before answering is retried this many times.
_RETRIES = 4


def replica_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


def models_per_replica(args: argparse.Namespace) -> int:
    """Serve's per-replica model cache: the engine's host cache of adapters, plus the base."""
    max_cpu = args.max_cpu_loras or args.max_loras
    return max_cpu + 1


# ---- the replica: the `serve` app, in-process ----

class _ASGICall:
    """One HTTP request through an ASGI app without a socket; `messages()` yields the
    app's response messages. Closing it early tells the app the client went away."""

    def __init__(self, app, request: dict) -> None:
        self.app = app
        self.scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request["method"], "scheme": "http", "path": request["path"],
            "raw_path": request["path"].encode(), "query_string": request["query"],
            "root_path": "", "headers": [(k.encode(), v.encode()) for k, v in request["headers"]],
            "client": ("127.0.0.1", 0), "server": ("ray-serve-replica", 0)}
        self.body = request["body"]
        self.disconnected = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnected.wait()  # what the app's disconnect watchers wait for
        return {"type": "http.disconnect"}

    async def messages(self):
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        task = asyncio.ensure_future(self.app(self.scope, self.receive, queue.put))
        task.add_done_callback(lambda _: queue.put_nowait(done))
        try:
            while True:
                msg = await queue.get()
                if msg is done:
                    task.result()  # the app raised: let it surface
                    return
                yield msg
                if msg["type"] == "http.response.body" and not msg.get("more_body"):
                    return
        finally:
            self.disconnected.set()
            if not task.done():
                try:  # let the app abort its engine requests, then stop waiting
                    await asyncio.wait_for(asyncio.shield(task), timeout=5)
                except Exception:  # noqa: BLE001 - best effort (a timeout, or the app's error)
                    task.cancel()


class EngineReplicaBase:
    """One engine behind the `serve` app (Ray Serve deployment; see build_openai_app)."""

    async def __init__(self, args: argparse.Namespace) -> None:
        from vllm_tpu_lora.entrypoints.openai.api_server import build_server

        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        self.server = await build_server(args)
        self.models = self.server.models

    async def http(self, request: dict, runtime_adapter: dict | None = None):
        """Serve one HTTP request. Yields {"status", "headers", "body", "more"} with the
        body's first chunk (a plain response: all of it, more=False), then further chunks.
        Nothing is yielded before the app has produced body bytes, so a replica that dies
        before that can be retried elsewhere. runtime_adapter: {"lora_name", "lora_path"}
        of an adapter loaded at runtime that this replica may not know yet (it replaced one
        that died)."""
        from ray import serve

        if runtime_adapter and runtime_adapter["lora_name"] not in self.models.lora_requests:
            await self._learn(runtime_adapter)
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            await self.hold(model_id)
        head = None
        async for msg in _ASGICall(self.server.app, request).messages():
            if msg["type"] == "http.response.start":
                head = {"status": msg["status"], "body": b"",
                        "headers": [(k.decode(), v.decode()) for k, v in msg["headers"]]}
            elif msg["type"] == "http.response.body":
                more = bool(msg.get("more_body"))
                if head is not None:
                    head["body"] += msg.get("body", b"")
                    if not more or head["body"]:
                        yield {**head, "more": more}
                        head = None
                elif msg.get("body"):
                    yield msg["body"]

    async def _learn(self, adapter: dict) -> None:
        from vllm_tpu_lora.entrypoints.openai.protocol import APIError, LoadLoRAAdapterRequest

        try:
            await self.models.load_lora_adapter(LoadLoRAAdapterRequest(**adapter))
        except APIError as e:  # the request itself will get the error (e.g. 404)
            logger.warning("could not load runtime adapter %s: %s", adapter, e.message)

    async def load_adapter(self, model_id: str) -> str:
        """Serve's multiplexed loader (wrapped by build_openai_app): make `model_id` host-
        resident in this engine, so routing by model id follows where adapters are."""
        lora = self.models.lora_requests.get(model_id)
        if lora is not None:
            await self.server.engine.add_lora(lora)
        return model_id

    def stats(self) -> dict[str, Any]:
        from ray import serve

        ctx = serve.get_replica_context()
        return {"replica": ctx.replica_tag, "pid": os.getpid(), **self.server.engine.stats()}

    def check_health(self) -> None:
        self.server.engine.check_health()  # a dead engine loop: Serve replaces the replica

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.engine.shutdown()


# ---- the ingress: the HTTP face ----

class IngressBase:
    """OpenAIIngress's behaviour (build_openai_app adds the FastAPI routes)."""

    def __init__(self, replicas, affinity: bool, api_key: str | None = None) -> None:
        self.replicas = replicas
        self.affinity = affinity
        # The replicas check the key on what is forwarded; what the ingress answers
        # itself (/stats: every replica's adapters and activity) it checks here.
        self.api_key = api_key
        self.runtime_adapters: dict[str, dict] = {}  # loaded through this ingress

    async def replica_stats(self) -> dict:
        """Each live replica's engine stats; replicas that did not answer (dying, starting)
        are counted, not listed."""
        results = await self.replicas.broadcast("stats").results_async(
            timeout_s=30, return_exceptions=True)
        live = [r for r in results if isinstance(r, dict)]
        return {"replicas": sorted(live, key=lambda r: r["replica"]),
                "unreachable": len(results) - len(live)}

    async def forward(self, request):
        body = await request.body()
        req = {"method": request.method, "path": request.url.path,
               "query": request.url.query.encode(), "body": body,
               "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                           for k, v in request.headers.raw]}
        if req["path"] in _BROADCAST_PATHS and req["method"] == "POST":
            return await self._broadcast(req)
        model = _model_of(body) if req["path"] in _ROUTED_PATHS else None
        handle = self.replicas.options(stream=True)
        if self.affinity and model:
            handle = handle.options(multiplexed_model_id=model)
        runtime = self.runtime_adapters.get(model) if model else None
        return await _forward_with_retries(handle, req, runtime)

    async def _broadcast(self, req: dict):
        """Every replica applies an adapter load/unload (or cache reset); the answer is the
        first failure if any, else the first success."""
        from fastapi.responses import Response

        responses = await self.replicas.broadcast("respond", req).results_async(
            timeout_s=600, return_exceptions=True)
        failed = [r for r in responses if isinstance(r, BaseException) or r[0] >= 400]
        answer = failed[0] if failed else responses[0]
        if isinstance(answer, BaseException):
            return _error_response(503, f"a replica failed: {answer!r}")
        if not failed and req["path"] != "/reset_prefix_cache":
            self._remember(req["path"], req["body"])
        elif failed and req["path"] == "/v1/load_lora_adapter" and len(failed) < len(responses):
            await self._undo_partial_load(req)
        status, headers, content = answer
        return Response(content, status_code=status,
                        headers={k: v for k, v in headers if k.lower() != "content-length"})

    def _remember(self, path: str, body: bytes) -> None:
        data = json.loads(body)
        if path == "/v1/load_lora_adapter":
            self.runtime_adapters[data["lora_name"]] = {
                "lora_name": data["lora_name"], "lora_path": data["lora_path"]}
        else:
            self.runtime_adapters.pop(data.get("lora_name"), None)

    async def _undo_partial_load(self, req: dict) -> None:
        # Some replicas loaded it, some refused: unload it everywhere (unless it was an
        # in-place reload of a known adapter), so the replicas agree again.
        data = json.loads(req["body"])
        if data.get("load_inplace"):
            return
        undo = {**req, "path": "/v1/unload_lora_adapter",
                "body": json.dumps({"lora_name": data.get("lora_name")}).encode()}
        await self.replicas.broadcast("respond", undo).results_async(
            timeout_s=120, return_exceptions=True)


def _model_of(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None  # the replica answers the parse error in OpenAI's shape
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def _error_response(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "ServiceUnavailableError",
                                   "param": None, "code": status}, "object": "error"},
                        status_code=status)


def _replica_died_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


async def _forward_with_retries(handle, req: dict, runtime: dict | None):
    """Forward to a replica; retry while replicas die before the response starts."""
    from fastapi.responses import Response, StreamingResponse

    died = _replica_died_errors()
    for attempt in range(_RETRIES + 1):
        gen = handle.http.remote(req, runtime)
        try:
            head = await gen.__anext__()
            break
        except died as e:
            gen.cancel()
            logger.warning("replica died before answering (attempt %d): %r", attempt + 1, e)
            if attempt == _RETRIES:
                return _error_response(503, f"every replica tried died: {e!r}")
            await asyncio.sleep(min(0.5 * 2 ** attempt, 4.0))
    headers = {k: v for k, v in head["headers"] if k.lower() != "transfer-encoding"}
    if not head["more"]:  # a plain response, whole
        return Response(head["body"], status_code=head["status"], headers=headers)

    async def body():
        yield head["body"]
        try:
            async for chunk in gen:
                yield chunk
        except died as e:  # mid-stream: the status is sent, so report it in-band
            logger.warning("replica died mid-response: %r", e)
            err = {"error": {"message": f"the replica serving this request died: {e!r}",
                             "type": "ServiceUnavailableError", "param": None, "code": 503}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            gen.cancel()  # client gone or done: the replica aborts what is left

    return StreamingResponse(body(), status_code=head["status"], headers=headers)


# ---- building the application ----

def build_openai_app(args: argparse.Namespace, *, num_replicas: int = 1,
                     adapter_affinity: bool = True, replica_num_cpus: float = 1.0,
                     replica_resources: dict | None = None):
    """The Serve application (ingress + engine replicas) for `serve`'s arguments."""
    from fastapi import FastAPI
    from ray import serve

    env = {"env_vars": replica_env()}

    # Short graceful shutdown: a stopping server aborts what is in flight (as `serve` does).
    quick_exit = dict(graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=5)

    @serve.deployment(num_replicas=num_replicas, max_ongoing_requests=1024,
                      health_check_period_s=2, health_check_timeout_s=30, **quick_exit,
                      ray_actor_options={"num_cpus": replica_num_cpus,
                                         "resources": dict(replica_resources or {}),
                                         "runtime_env": env})
    class EngineReplica(EngineReplicaBase):
        @serve.multiplexed(max_num_models_per_replica=models_per_replica(args))
        async def multiplexed_adapter(self, model_id: str) -> str:
            return await self.load_adapter(model_id)

        async def hold(self, model_id: str) -> None:
            await self.multiplexed_adapter(model_id)

        async def respond(self, request: dict) -> tuple[int, list, bytes]:
            """A whole response (for broadcasts)."""
            status, headers, chunks = 500, [], []
            async for item in self.http(request):
                if isinstance(item, dict):
                    status, headers = item["status"], item["headers"]
                    item = item["body"]
                chunks.append(item)
            return status, headers, b"".join(chunks)

    app = FastAPI(title="vllm_tpu_lora on Ray Serve")

    @serve.deployment(max_ongoing_requests=4096, **quick_exit,
                      ray_actor_options={"num_cpus": 0, "runtime_env": env})
    @serve.ingress(app)
    class OpenAIIngress(IngressBase):
        @app.get("/stats")
        async def stats(self, request: Request):
            """Each replica's engine stats (adapter residency, loads): routing, observed."""
            from vllm_tpu_lora.entrypoints.openai.api_server import (
                UNAUTHORIZED,
                authorized,
                error_json,
            )

            if not authorized(request.headers.get("authorization"), self.api_key):
                return error_json(UNAUTHORIZED)
            return await self.replica_stats()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def everything_else(self, request: Request, path: str):
            return await self.forward(request)

    from vllm_tpu_lora.config import api_key_from_env

    return OpenAIIngress.bind(EngineReplica.bind(args), adapter_affinity,
                              args.api_key or api_key_from_env())


def run(args: argparse.Namespace) -> int:
    """serve-ray: start (or join) Ray, run the app, serve until SIGTERM / Ctrl-C, then shut
    down what this command started."""
    import signal

    import ray
    from ray import serve

    from vllm_tpu_lora.entrypoints.openai.cli_args import model_of

    model_of(args)  # argument errors before any cluster starts
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    started_ray = not args.ray_address
    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    stopping = {"now": False}

    def _stop(signum, _frame) -> None:
        stopping["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        serve.start(http_options={"host": args.host or "0.0.0.0", "port": args.port})
        app = build_openai_app(args, num_replicas=args.num_replicas,
                               adapter_affinity=args.adapter_affinity,
                               replica_num_cpus=args.replica_num_cpus,
                               replica_resources=args.replica_resources)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("serving on http://%s:%d with %d replica(s)", args.host or "0.0.0.0",
                    args.port, args.num_replicas)
        import time

        while not stopping["now"]:
            time.sleep(0.2)
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()
        else:  # a shared cluster: remove only what this command deployed
            serve.delete(APP_NAME)
    return 0
