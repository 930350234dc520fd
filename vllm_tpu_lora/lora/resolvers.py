"""Adapters by name from where tenants keep them (vLLM's LoRA resolvers).

A request naming an adapter the server does not know is resolved through the configured
resolvers, in order: each maps the name to a local PEFT adapter directory (downloading it
first if it lives elsewhere), or says it does not have it. Built-ins, by URI:

- a directory (`/path` or `file:///path`): `<dir>/<name>/` (vLLM's filesystem resolver
  is this one over `VLLM_LORA_RESOLVER_CACHE_DIR`);
- `s3://BUCKET/PREFIX`: any S3-compatible store (endpoint from the SDK's standard
  `AWS_ENDPOINT_URL`, credentials from its standard chain); `<prefix>/<name>/*` is
  downloaded into a bounded local cache (LRU by bytes);
- `hf-cache://` (or `hf-cache:///CACHE_DIR`): adapters already in the local Hugging Face
  cache, by repo id (`org/name`), offline.

Custom resolvers register under the entry-point group `vllm_tpu_lora.lora_resolvers`
(URI scheme -> class taking the URI and the cache); the built-ins are registered there
too. `fetch` blocks (the server runs it in a thread): it never runs on the step.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

ENTRY_POINT_GROUP = "vllm_tpu_lora.lora_resolvers"
# One path component (or an HF-style "org/name"): what can never leave a prefix/directory.
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME = re.compile(rf"^{_PART}(/{_PART})?$")


def check_adapter_name(name: str) -> None:
    """Refuse, before any resolver sees it, a name that could leave a directory or prefix
    (`..`, absolute paths, backslashes, control characters) or is not a plain name."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name.split("/"):
        raise ValueError(f"Invalid LoRA adapter name {name!r}: use letters, digits, '.', '_' "
                         "and '-' (optionally 'org/name'), starting with a letter or digit")


@dataclass
class ResolverStats:
    lookups: int = 0
    hits: int = 0
    download_bytes: int = 0
    download_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits,
                "download_bytes": self.download_bytes,
                "download_seconds": self.download_seconds}


class LoRAResolver:
    """Maps an adapter name to a local adapter directory, or None."""

    def __init__(self, uri: str, cache: DownloadCache | None = None) -> None:
        self.uri, self.cache = uri, cache
        self.stats = ResolverStats()

    def fetch(self, name: str) -> str | None:
        with self.stats.lock:
            self.stats.lookups += 1
        path = self._fetch(name)
        if path is not None:
            with self.stats.lock:
                self.stats.hits += 1
        return path

    def _fetch(self, name: str) -> str | None:
        raise NotImplementedError


def _is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


class DirectoryResolver(LoRAResolver):
    def __init__(self, uri: str, cache: DownloadCache | None = None) -> None:
        super().__init__(uri, cache)
        self.root = os.path.realpath(urlparse(uri).path if uri.startswith("file:") else uri)

    def _fetch(self, name: str) -> str | None:
        path = os.path.realpath(os.path.join(self.root, name))
        inside = path.startswith(self.root.rstrip(os.sep) + os.sep)
        return path if inside and _is_adapter_dir(path) else None


class HFCacheResolver(LoRAResolver):
    """Adapters already in the local Hugging Face cache (nothing is downloaded)."""

    def _fetch(self, name: str) -> str | None:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        cache_dir = urlparse(self.uri).path or None
        try:
            path = snapshot_download(name, cache_dir=cache_dir, local_files_only=True)
        except (LocalEntryNotFoundError, ValueError, OSError):
            return None
        return path if _is_adapter_dir(path) else None


class S3Resolver(LoRAResolver):
    """`s3://BUCKET/PREFIX`: `<prefix>/<name>/<file>` objects into the download cache."""

    def __init__(self, uri: str, cache: DownloadCache | None = None) -> None:
        super().__init__(uri, cache)
        if cache is None:
            raise ValueError(f"{uri}: an object-store resolver needs a download cache")
        parsed = urlparse(uri)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        self._client = None

    def client(self):
        if self._client is None:
            import boto3  # endpoint (AWS_ENDPOINT_URL) and credentials: boto3's own chain

            self._client = boto3.client("s3")
        return self._client

    def _fetch(self, name: str) -> str | None:
        key_prefix = f"{self.prefix}/{name}/" if self.prefix else f"{name}/"
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=key_prefix)
        objects = [o for page in pages for o in page.get("Contents", [])
                   if "/" not in o["Key"][len(key_prefix):]]  # this adapter's files only
        if not any(o["Key"].endswith("/adapter_config.json") for o in objects):
            return None

        def download(tmp: str) -> int:
            for o in objects:
                self.client().download_file(self.bucket, o["Key"],
                                            os.path.join(tmp, o["Key"][len(key_prefix):]))
            return sum(o["Size"] for o in objects)

        t0 = time.perf_counter()
        path, nbytes = self.cache.put(f"s3/{self.bucket}/{key_prefix}", download)
        with self.stats.lock:
            self.stats.download_bytes += nbytes
            self.stats.download_seconds += time.perf_counter() - t0
        return path


class DownloadCache:
    """Downloaded adapters on local disk, at most `max_bytes` (least recently used go
    first; an adapter in use stays readable: the engine holds its host copy)."""

    def __init__(self, root: str, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        os.makedirs(root, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, int]] = {}  # key -> (dir, bytes), LRU order

    def put(self, key: str, download) -> tuple[str, int]:
        """The directory for `key`, downloading with download(tmp_dir) -> bytes if absent.
        A failed download leaves nothing behind."""
        with self._lock:
            if key in self._entries:
                self._entries[key] = self._entries.pop(key)
                return self._entries[key][0], 0
        final = os.path.join(self.root, key.replace("/", "__"))
        tmp = f"{final}.partial-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            nbytes = download(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with self._lock:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._entries[key] = (final, nbytes)
            self._evict()
        return final, nbytes

    def _evict(self) -> None:
        total = sum(n for _, n in self._entries.values())
        for key in list(self._entries):
            if total <= self.max_bytes or len(self._entries) == 1:
                break
            path, n = self._entries.pop(key)
            shutil.rmtree(path, ignore_errors=True)
            total -= n


_BUILTIN = {"file": DirectoryResolver, "": DirectoryResolver, "s3": S3Resolver,
            "hf-cache": HFCacheResolver}


def resolver_classes() -> dict[str, type]:
    """URI scheme -> resolver class: the entry-point group (where the built-ins are
    registered too, pyproject.toml), over the built-ins for an install whose metadata
    predates them."""
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {**_BUILTIN, **{name: ep.load() for name, ep in found.items()}}


def make_resolvers(uris: list[str], cache: DownloadCache | None) -> list[LoRAResolver]:
    """The resolvers for --lora-resolver-uri values, then vLLM's filesystem resolver when
    VLLM_LORA_RESOLVER_CACHE_DIR is set."""
    classes = resolver_classes()
    out = []
    for uri in uris:
        scheme = urlparse(uri).scheme if "://" in uri else ""
        cls = classes.get(scheme)
        if cls is None:
            raise ValueError(f"No LoRA resolver for {uri!r} (schemes: {sorted(classes)})")
        out.append(cls(uri, cache))
    env_dir = os.environ.get("VLLM_LORA_RESOLVER_CACHE_DIR")
    if env_dir:
        out.append(DirectoryResolver(env_dir, cache))
    return out
