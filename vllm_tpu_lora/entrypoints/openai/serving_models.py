"""Which models the server answers to: the base model's names and the loaded adapters.

Handles /v1/models, /v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's bodies
and messages, and resolves a request's `model` to (served name, LoRARequest or None).
An adapter is only listed, and only routable, after the engine accepted it (add_lora
validates and loads it into the host cache); unloading stops routing first, then frees it.

Resolvers (lora/resolvers.py, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True as in vLLM): a
`model` that names neither the base model nor a known adapter is looked up through them in
order, fetched in a thread (never on the event loop or the step), checked against the
served model and loaded like any adapter. Concurrent first requests for one name share
one lookup; a failed one fails only that adapter's requests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from http import HTTPStatus

from vllm_tpu_lora.config import runtime_lora_updating_allowed
from vllm_tpu_lora.entrypoints.openai.protocol import (
    APIError,
    BaseModelPath,
    LoadLoRAAdapterRequest,
    LoRAModulePath,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    not_found,
)
from vllm_tpu_lora.lora.request import LoRARequest
from vllm_tpu_lora.lora.resolvers import check_adapter_name

logger = logging.getLogger(__name__)


class OpenAIServingModels:
    def __init__(self, engine, base_model_paths: list[BaseModelPath], *,
                 lora_modules: list[LoRAModulePath] | None = None,
                 allowed_lora_dirs: list[str] | None = None, max_model_len: int | None = None,
                 resolvers: list | None = None):
        self.engine = engine
        self.base_model_paths = base_model_paths
        self.static_lora_modules = list(lora_modules or [])
        # Resolved once: a root that is itself a symlink confines to where it points.
        self.allowed_lora_dirs = [os.path.realpath(d) for d in allowed_lora_dirs or []]
        self.max_model_len = max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_paths: dict[str, str] = {}  # name -> path as the user gave it (card root)
        self._ids = itertools.count(1)
        self._static: list[LoRARequest] = []
        self._lock = asyncio.Lock()  # load/unload are check-then-act across an await
        self.resolvers = list(resolvers or [])
        self._resolving: dict[str, asyncio.Future] = {}  # name -> the lookup in flight

    @property
    def base_name(self) -> str:
        return self.base_model_paths[0].name

    def is_base_model(self, name: str | None) -> bool:
        return any(m.name == name for m in self.base_model_paths)

    def resolve(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(served model name, adapter) for a request's `model`; 404 if unknown."""
        if name is None or self.is_base_model(name):
            return name or self.base_name, None
        lora = self.lora_requests.get(name)
        if lora is None:
            raise not_found(f"The model `{name}` does not exist.")
        return name, lora

    async def resolve_or_fetch(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """resolve(), and for an unknown name the resolvers (when configured and runtime
        adapter loading is allowed): 400 for a name no resolver may see, 404 when none
        has it."""
        try:
            return self.resolve(name)
        except APIError:
            if not self.resolvers or not runtime_lora_updating_allowed():
                raise
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise APIError(str(e), param="model") from None
        fut = self._resolving.get(name)
        if fut is None:
            fut = self._resolving[name] = asyncio.ensure_future(self._fetch_and_load(name))
            fut.add_done_callback(lambda _: self._resolving.pop(name, None))
        return name, await asyncio.shield(fut)

    async def _fetch_and_load(self, name: str) -> LoRARequest:
        path = None
        for resolver in self.resolvers:
            try:
                path = await asyncio.to_thread(resolver.fetch, name)
            except Exception as e:  # noqa: BLE001 - the store failed: this adapter only
                logger.warning("LoRA resolver %s failed for %r: %r", type(resolver).__name__,
                               name, e)
                raise APIError(f"Loading lora {name} failed: the adapter store failed",
                               HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError",
                               "model") from None
            if path is not None:
                break
        if path is None:
            raise not_found(f"The model `{name}` does not exist.")
        self._check_base_model(name, path)
        async with self._lock:
            if name in self.lora_requests:  # loaded by an operator meanwhile
                return self.lora_requests[name]
            lora = self._new_request(name, path, None)
            try:
                await self.engine.add_lora(lora)
            except (ValueError, OSError, RuntimeError) as e:
                raise adapter_error(e) from None
            self.lora_requests[name] = lora
            self._lora_paths[name] = name  # never the local path or the store's URI
        logger.info("Resolved LoRA adapter %r", name)
        return lora

    def _check_base_model(self, name: str, path: str) -> None:
        """An adapter trained for another model is refused, naming both."""
        with open(os.path.join(path, "adapter_config.json")) as f:
            base = json.load(f).get("base_model_name_or_path")
        if not base:
            return
        served = {m.name for m in self.base_model_paths} | {
            m.model_path for m in self.base_model_paths}
        ok = (base in served or any(os.path.realpath(base) == os.path.realpath(p) or
                                    os.path.basename(base.rstrip("/")) ==
                                    os.path.basename(p.rstrip("/")) for p in served))
        if not ok:
            raise APIError(f"LoRA adapter '{name}' was trained for base model '{base}', but "
                           f"this server serves '{self.base_name}'.", param="model")

    def resolver_stats(self) -> list[dict]:
        """Per resolver (by position and kind, never its URI): lookups, hits, bytes, s."""
        return [{"resolver": f"{i}:{type(r).__name__}", **r.stats.as_dict()}
                for i, r in enumerate(self.resolvers)]

    def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=m.name, root=m.model_path, max_model_len=self.max_model_len)
                 for m in self.base_model_paths]
        cards += [ModelCard(id=name, root=self._lora_paths[name],
                            parent=lora.base_model_name or self.base_name)
                  for name, lora in self.lora_requests.items()]
        return ModelList(data=cards)

    # ---- adapters ----

    def prepare_static_loras(self) -> list[LoRARequest]:
        """--lora-modules as LoRARequests, after the cheap checks (name, path); the engine
        loads them at start-up, before it compiles, and register_static_loras() then makes
        them routable."""
        self._static = []
        for m in self.static_lora_modules:
            try:
                self._check_new_name(m.name, {lora.lora_name for lora in self._static})
                lora = self._new_request(m.name, self._checked_path(m.name, m.path),
                                         m.base_model_name)
            except APIError as e:
                raise ValueError(f"Failed to load LoRA adapter '{m.name}' from "
                                 f"--lora-modules: {e.message}") from None
            self._static.append(lora)
        return list(self._static)

    def register_static_loras(self) -> None:
        for m, lora in zip(self.static_lora_modules, self._static):
            self.lora_requests[m.name] = lora
            self._lora_paths[m.name] = m.path

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.",
                           err_type="InvalidUserInput")
        async with self._lock:
            existing = self.lora_requests.get(name)
            inplace = existing is not None and request.load_inplace
            if inplace:  # same id, new files: the engine swaps once the old drain
                lora = LoRARequest(name, existing.lora_int_id, self._checked_path(name, path),
                                   existing.base_model_name)
            else:
                self._check_new_name(name, self.lora_requests)
                lora = self._new_request(name, self._checked_path(name, path), None)
            try:
                await self.engine.add_lora(lora, load_inplace=inplace)
            except (ValueError, OSError, RuntimeError) as e:
                raise adapter_error(e) from None
            self.lora_requests[name] = lora
            self._lora_paths[name] = path
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _check_new_name(self, name: str, taken) -> None:
        if name in taken:
            raise APIError(f"The lora adapter '{name}' has already been loaded.",
                           err_type="InvalidUserInput")
        if self.is_base_model(name):
            raise APIError(f"The lora adapter name '{name}' is the name of the base model.",
                           err_type="InvalidUserInput")

    def _new_request(self, name: str, real_path: str, base_model_name: str | None) -> LoRARequest:
        lora = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=real_path)
        if base_model_name is not None and self.is_base_model(base_model_name):
            lora.base_model_name = base_model_name
        return lora

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        name = request.lora_name
        if not name:
            raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.",
                           err_type="InvalidUserInput")
        async with self._lock:
            lora = self.lora_requests.get(name)
            if lora is None:
                raise not_found(f"The lora adapter '{name}' cannot be found.")
            # Stop routing first: from here on a request for `name` gets 404; requests
            # already running keep the adapter until they finish (see AsyncLLMEngine).
            del self.lora_requests[name]
            del self._lora_paths[name]
            await self.engine.remove_lora(lora.lora_int_id)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _checked_path(self, name: str, path: str) -> str:
        """The adapter directory's real path; refuses one outside --allowed-lora-dirs, by any
        route (`..`, a symlinked directory, or a symlinked file inside it)."""
        real = os.path.realpath(path)
        if self.allowed_lora_dirs:
            outside = [p for p in [real] + _entries(real) if not self._allowed(p)]
            if outside:
                raise APIError(f"LoRA path '{path}' is outside the allowed LoRA directories "
                               "(--allowed-lora-dirs); refusing to load it.",
                               HTTPStatus.FORBIDDEN, "PermissionDeniedError", "lora_path")
        if not os.path.isdir(real):
            raise not_found(f"Loading lora {name} failed: No adapter found for {path}")
        return real

    def _allowed(self, real: str) -> bool:
        return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep)
                   for root in self.allowed_lora_dirs)


def adapter_error(e: Exception) -> APIError:
    """An engine error about an adapter, as OpenAI's error: 404 when its files are not there."""
    if "No adapter found" in str(e) or isinstance(e, FileNotFoundError):
        return APIError(str(e), HTTPStatus.NOT_FOUND, "NotFoundError")
    return APIError(str(e), HTTPStatus.BAD_REQUEST, "BadRequestError")


def _entries(real_dir: str) -> list[str]:
    """Real paths of the files directly in an adapter directory (what the loader opens)."""
    if not os.path.isdir(real_dir):
        return []
    return [os.path.realpath(os.path.join(real_dir, f)) for f in sorted(os.listdir(real_dir))]
