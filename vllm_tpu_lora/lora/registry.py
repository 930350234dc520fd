"""Host side of the adapter lifecycle: which adapters exist, their host copies, who needs them.

The rules (the device-slot side lives in manager.LoRAManager):
- An adapter becomes *known* when a request or add_lora names it. Naming it validates its
  files (config and safetensors header: names, shapes, ranks; no tensor data), so a bad
  adapter is refused before anything is queued, and a request that names an adapter whose
  files have since vanished or changed is checked against the files as they are now.
- Host copies are read by one background thread, which prefetches the adapters of the
  waiting queue's head, or synchronously between steps for add_lora / load_inplace. A
  step never reads a file: the scheduler only admits a sequence whose adapter is in host
  memory.
- A sequence holds a reference from admission to finish (preemption keeps it). A
  referenced or pinned adapter is never dropped from the host cache; at most
  `max_cpu_loras` unreferenced copies are kept, least recently used first out. Waiting
  sequences hold nothing, so 10,000 queued requests over 10,000 adapters hold only the
  prefetch window in memory.
- New weights under a known id (load_inplace, or files that changed on disk) are staged
  until no admitted sequence uses the old ones; meanwhile new sequences for that adapter
  wait. So one step never mixes two versions of an adapter, and a sequence runs on one
  version from its first token to its last.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from vllm_tpu_lora.lora.peft_loader import adapter_fingerprint
from vllm_tpu_lora.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# Process-wide, never reused: the prefix cache keys KV blocks by (id, weights version), and
# an adapter removed and added again under the same id may bring other weights.
_weights_versions = itertools.count(1)


class LoRALoadError(ValueError):
    """An adapter could not be loaded for a request that was already queued."""


@dataclass
class _Staged:
    request: LoRARequest
    fingerprint: tuple | None
    host: Any = None  # new host copy (load_inplace), or None: read it when needed


@dataclass
class AdapterEntry:
    request: LoRARequest
    fingerprint: tuple | None
    host: Any = None  # the prepared host copy (what a slot write needs), or None
    refs: int = 0  # admitted, unfinished sequences (host copy protected)
    running: int = 0  # of those, sequences in the running set (device slot protected)
    pinned: bool = False
    generation: int = 0  # bumped whenever the weights under this id change
    # Names the weights themselves (new on every reload): what cached KV is keyed by.
    weights_version: int = field(default_factory=lambda: next(_weights_versions))
    last_used: int = 0
    checked_round: int = -1  # the registry round in which its files were last checked
    loading: Future | None = None
    loading_generation: int = 0  # the generation the read in flight is for
    staged: _Staged | None = None
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("host_loads", "host_evictions", "slot_loads", "slot_evictions", "load_failures"), 0))


class AdapterRegistry:
    def __init__(self, *, max_cpu_loras: int, validate: Callable[[LoRARequest], tuple | None],
                 load: Callable[[LoRARequest], Any],
                 on_weights_changed: Callable[[int], None], max_loads_in_flight: int,
                 load_ahead: Callable[[LoRARequest], Any] | None = None) -> None:
        """validate(request) raises ValueError for a bad adapter without reading tensor data,
        and returns the fingerprint of the files it read (None: take adapter_fingerprint);
        load(request) returns the host copy (runs in the loader thread: must not touch
        engine state); load_ahead(request): the same for a queued request, whose slot
        write follows soon (default load); on_weights_changed(lora_id) frees the
        adapter's device slot;
        max_loads_in_flight: reads queued at once (the manager passes max_loras, the most
        adapters one admission can start)."""
        self.max_cpu_loras = max_cpu_loras
        self.max_loads_in_flight = max_loads_in_flight
        self._validate, self._load, self._on_weights_changed = validate, load, on_weights_changed
        self._load_ahead = load_ahead or load
        self.entries: dict[int, AdapterEntry] = {}
        # Indexes over entries, so that per-step work does not grow with the adapters ever
        # named (a server may have seen thousands): ids with a host copy, pinned ids.
        self._cached: set[int] = set()
        self._pinned: set[int] = set()
        self._clock = 0
        # Advanced by the engine once a step (and when a request reaches an idle engine):
        # requests naming a cached adapter share one check of its files per round. A stat
        # is a few microseconds on a local disk but ~0.1 ms on the TPU VM's, and far more on
        # network filesystems; a check per request cost 1% of the 8-adapter throughput there.
        self._round = 0
        self._executor: ThreadPoolExecutor | None = None
        self._wanted: set[int] = set()  # adapters the waiting queue's head needs
        self._loading: set[int] = set()  # adapters with a background read in flight
        self.num_host_loads = 0

    # ---- naming adapters (engine thread, between steps) ----

    def new_round(self) -> None:
        """Files of cached adapters are checked again for the next request naming them."""
        self._round += 1

    def register(self, request: LoRARequest, *, once_per_round: bool = False) -> AdapterEntry:
        """A request names `request`'s adapter: validate it if new or changed on disk.
        once_per_round: a cached adapter whose files were checked this round is not
        checked again (requests; add_lora checks every time)."""
        entry = self.entries.get(request.lora_int_id)
        if entry is None:
            fingerprint = self._validate(request) or adapter_fingerprint(request.lora_path)
            entry = self.entries[request.lora_int_id] = AdapterEntry(request, fingerprint)
            entry.checked_round = self._round
            return entry
        if once_per_round and entry.checked_round == self._round:
            return entry
        now = adapter_fingerprint(entry.request.lora_path)
        if entry.staged is not None or now == entry.fingerprint:
            entry.checked_round = self._round
            return entry
        # The files changed since they were read: the request gets them as they are now.
        self._validate(entry.request)  # gone or broken: refuse the request
        logger.info("LoRA %s changed on disk; new requests get the new weights",
                    entry.request.lora_name)
        self._stage(entry, _Staged(entry.request, now))
        entry.checked_round = self._round
        return entry

    def load_now(self, request: LoRARequest) -> bool:
        """add_lora: make sure a host copy is in memory now. False if it already was."""
        entry = self.register(request)
        if entry.host is not None and entry.staged is None:
            self._touch(entry)
            return False
        if entry.staged is None:
            try:
                host = self._read(entry.request)
            except Exception:
                if entry.refs == 0 and entry.loading is None and not entry.pinned:
                    self._drop(entry.request.lora_int_id)  # nothing else knows it
                raise
            self._set_host(entry, host)
        else:
            entry.staged.host = entry.staged.host or self._read(entry.staged.request)
        self._trim()
        return True

    def replace(self, request: LoRARequest) -> None:
        """load_inplace: new weights under a known id, read and validated now; applied once
        no admitted sequence uses the old ones."""
        entry = self.entries.get(request.lora_int_id)
        if entry is None:
            self.load_now(request)
            return
        host = self._read(request)  # raises: nothing changes
        self._stage(entry, _Staged(request, adapter_fingerprint(request.lora_path), host))

    def remove(self, lora_id: int) -> AdapterEntry | None:
        entry = self.entries.get(lora_id)
        if entry is not None and entry.refs:
            raise RuntimeError(f"LoRA {lora_id} is referenced by {entry.refs} sequence(s)")
        return self._drop(lora_id)

    def _drop(self, lora_id: int) -> AdapterEntry | None:
        self._cached.discard(lora_id)
        self._pinned.discard(lora_id)
        return self.entries.pop(lora_id, None)

    def pin(self, lora_id: int) -> None:
        self.entries[lora_id].pinned = True
        self._pinned.add(lora_id)

    def pinned_ids(self) -> set[int]:
        return set(self._pinned)

    def _read(self, request: LoRARequest):
        host = self._load(request)
        self.num_host_loads += 1
        entry = self.entries.get(request.lora_int_id)
        if entry is not None:
            entry.counters["host_loads"] += 1
        return host

    # ---- references (scheduler) ----

    def ready(self, lora_id: int) -> bool:
        """A sequence that holds no reference may be admitted: host copy in memory, no
        reload waiting for the old version to drain."""
        entry = self.entries.get(lora_id)
        return entry is not None and entry.host is not None and entry.staged is None

    def acquire(self, lora_id: int) -> None:
        entry = self.entries[lora_id]
        entry.refs += 1
        self._touch(entry)

    def release(self, lora_id: int) -> None:
        entry = self.entries.get(lora_id)
        if entry is None:
            return
        entry.refs -= 1
        self._touch(entry)
        if entry.refs == 0 and entry.staged is not None:
            self._apply_staged(entry)
        self._trim()

    # ---- background loading (engine thread submits and harvests) ----

    def prefetch(self, lora_ids: Iterable[int]) -> None:
        """Start reading host copies for the first adapters the waiting queue needs, in queue
        order; the window is max_cpu_loras adapters, the most the host cache keeps."""
        in_flight = len(self._loading)
        self._wanted = set()
        for lora_id in lora_ids:
            entry = self.entries.get(lora_id)
            if entry is None:
                continue
            self._wanted.add(lora_id)  # needed soon: last out of the host cache
            # (A staged reload is read once the old version drained: see _apply_staged.)
            if (entry.host is None and entry.staged is None and entry.loading is None
                    and in_flight < self.max_loads_in_flight):
                entry.loading = self._pool().submit(self._load_ahead, entry.request)
                entry.loading_generation = entry.generation
                self._loading.add(lora_id)
                in_flight += 1
            if len(self._wanted) >= self.max_cpu_loras:
                break

    def poll(self) -> dict[int, LoRALoadError]:
        """Take the finished background reads; {lora_id: error} for adapters that failed
        (their entry is dropped: the engine fails their waiting requests)."""
        failed: dict[int, LoRALoadError] = {}
        for lora_id in list(self._loading):
            entry = self.entries.get(lora_id)
            fut = entry.loading if entry is not None else None
            if fut is None:  # removed (and maybe named again) while its read was in flight
                self._loading.discard(lora_id)
                continue
            if not fut.done():
                continue
            entry.loading = None
            self._loading.discard(lora_id)
            if entry.loading_generation != entry.generation or entry.host is not None:
                continue  # read for weights that were replaced meanwhile, or loaded since
            try:
                host = fut.result()
            except Exception as e:  # noqa: BLE001 - reported to the adapter's requests
                entry.counters["load_failures"] += 1
                failed[lora_id] = e if isinstance(e, LoRALoadError) else LoRALoadError(str(e))
                if entry.refs == 0 and not entry.pinned:
                    self._drop(lora_id)
                continue
            self.num_host_loads += 1
            entry.counters["host_loads"] += 1
            self._set_host(entry, host)
        if failed:
            self._trim()
        return failed

    def wait_for_loads(self, timeout: float, every: bool = False) -> None:
        """Block (GIL released) until a background read (`every`: all reads in flight)
        finishes or `timeout` passes."""
        futures = [self.entries[i].loading for i in self._loading if i in self.entries]
        if futures:
            wait(futures, timeout=timeout, return_when=ALL_COMPLETED if every else FIRST_COMPLETED)

    def _pool(self) -> ThreadPoolExecutor:
        # One thread does the reads: more would only compete with the step for the cores.
        # At normal priority: lowered (niceness 10), it starved behind XLA's threads on a
        # busy 2-core host, its reads landed after the wave they were for, and requests
        # were admitted staggered into mixed prefill/decode steps (issue 41's churn:
        # 0.65x -> 0.83x of the 8-adapter throughput without it; docs/benchmarks.md).
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-loader")
        return self._executor

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- host cache ----

    def host_copy(self, lora_id: int):
        entry = self.entries.get(lora_id)
        if entry is None or entry.host is None:
            # The scheduler admits only ready adapters and references keep them: a bug.
            raise RuntimeError(f"LoRA {lora_id} has no host copy to write into a slot")
        return entry.host

    def cached_ids(self) -> set[int]:
        return set(self._cached)

    def _set_host(self, entry: AdapterEntry, host) -> None:
        self._hold(entry, host)
        self._touch(entry)
        self._trim()

    def _hold(self, entry: AdapterEntry, host) -> None:
        """The only place entry.host changes (keeps the index of host copies)."""
        entry.host = host
        lora_id = entry.request.lora_int_id
        if host is None:
            self._cached.discard(lora_id)
        else:
            self._cached.add(lora_id)

    def _touch(self, entry: AdapterEntry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def _trim(self) -> None:
        """Keep at most max_cpu_loras unreferenced, unpinned host copies: least recently
        used out first, the ones the waiting queue's head needs (prefetched) last."""
        if len(self._cached) <= self.max_cpu_loras:  # idle copies are among the cached
            return
        entries = self.entries
        idle = [(i in self._wanted, entries[i].last_used, i) for i in self._cached
                if not entries[i].refs and not entries[i].pinned]
        for _, _, lora_id in sorted(idle)[:max(0, len(idle) - self.max_cpu_loras)]:
            entry = entries[lora_id]
            self._hold(entry, None)
            entry.counters["host_evictions"] += 1

    def _stage(self, entry: AdapterEntry, staged: _Staged) -> None:
        entry.staged = staged
        entry.generation += 1  # a read in flight is for the old weights now
        if entry.refs == 0:
            self._apply_staged(entry)

    def _apply_staged(self, entry: AdapterEntry) -> None:
        staged, entry.staged = entry.staged, None
        entry.request, entry.fingerprint = staged.request, staged.fingerprint
        self._hold(entry, staged.host)
        entry.generation += 1
        entry.weights_version = next(_weights_versions)
        self._on_weights_changed(entry.request.lora_int_id)
        if entry.host is not None:
            self._touch(entry)
            self._trim()
