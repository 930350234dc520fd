"""LoRAManager: `max_loras` device slots in stacked buffers, the adapter registry behind them.

- Registry (`registry.AdapterRegistry`): known adapters, host copies (read off the step,
  in a background thread), references held by admitted sequences, pins, reloads.
- Device slots: which adapter's weights sit in each slot of every LoRA layer's buffers.
  `activate()` puts the adapters of one step into slots, evicting the least recently used
  slot whose adapter no running sequence uses and that is not pinned.
- A host copy is prepared once, in the loader thread: every buffer's slot image (padded to
  max_lora_rank, scale folded into B, in lora_dtype) concatenated into one flat tensor;
  for an adapter of a recipe seen before, straight from its file bytes (copy_plan.py). The
  adapters a step brings in are then written together: one host->device transfer and one
  graph of `index_copy_`s at slot indices passed as a device tensor, one graph per batch
  size, compiled at warm-up, the same for every adapter.
- Pins (vLLM's pin_lora): a pinned adapter keeps its host copy and its device slot for
  good. One slot always stays unpinned, so every other adapter can still run.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_tpu_lora import ops, platform
from vllm_tpu_lora.lora.copy_plan import CopyPlan, build_plan, rank_rows
from vllm_tpu_lora.lora.layers import LoRALinear
from vllm_tpu_lora.lora.peft_loader import (
    AdapterBytes,
    LoRAModel,
    LoRASliceWeights,
    header_digest,
    load_peft_adapter,
    model_targets,
    plain_slices,
    raise_if_not_finite,
    read_adapter_bytes,
)
from vllm_tpu_lora.lora.registry import AdapterRegistry
from vllm_tpu_lora.lora.request import LoRARequest
from vllm_tpu_lora.lora.staging import DeviceStaging
from vllm_tpu_lora.runner.lazy_capture import FixedTensors

# Adapter recipes remembered (LRU), by the digest of their config and header: validations
# passed, and copy plans.
_VALID_HEADERS_KEPT = 256
# Slot writes batched per graph call (see write_slots); one captured graph per size.
_WRITE_BATCHES = (1, 2, 4, 8, 16)


@dataclass
class HostAdapter:
    """An adapter's slot image: one flat host tensor holding every buffer's slot, in order."""
    name: str
    flat: torch.Tensor
    # The image already on the device, moved by the loader thread (staging.py); dropped
    # once written.
    device: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class LoRAManager:
    def __init__(self, model: torch.nn.Module, layers: dict[str, LoRALinear], *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 target_modules=None, one_transfer: bool = True, allow_bias: bool = False,
                 allow_dora: bool = False) -> None:
        """one_transfer: write a slot from one flat host tensor. Off under tensor
        parallelism on torch_xla (its steps are traced lazily there; slicing a replicated
        flat tensor into sharded buffers made XLA add collective-permutes to every write):
        there each buffer's slot image is sent alone, already shaped like the buffer. On
        the jax runtime the write is one captured graph under TP too.
        allow_bias / allow_dora: serve lora_bias / DoRA adapters (the layers must hold the
        matching per-slot vectors). DoRA's rescale needs each layer's base weight: a
        reference to the host copy is kept (taken before the runner moves the model)."""
        self.model = model
        self.target_modules = target_modules
        self.layers = layers
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = dtype
        self.one_transfer = one_transfer
        self.allow_bias, self.allow_dora = allow_bias, allow_dora
        # (module, vector kind, output slice sizes) for each per-slot vector buffer.
        self._vector_layout = [(name, kind, list(layer.output_slices))
                               for name, layer in layers.items() for kind in layer.vector_kinds]
        self._base_weights = ({name: layer.base_layer.weight.detach()
                               for name, layer in layers.items()
                               if isinstance(layer, LoRALinear)} if allow_dora else {})
        # A few rows of the vocabulary layers' base weights (host, taken before the runner
        # moves the model): what PEFT's saved copies of them are checked against.
        self._base_rows = _vocab_base_rows(model)
        self._shapes = [tuple(buf.shape[1:]) for buf in self.buffers]
        # (module, slice, A slot shape, B slot shape, A held by input row [in, R], B held
        # by rank row [R, out]) in that order: read by the loader thread, which must not
        # touch the device buffers themselves.
        self._layout = [(name, i, tuple(a.shape[1:]), tuple(b.shape[1:]), layer.a_by_input,
                         layer.b_by_rank)
                        for name, layer in layers.items()
                        for i, (a, b) in enumerate(zip(layer.lora_a, layer.lora_b))]
        self.registry = AdapterRegistry(max_cpu_loras=max_cpu_loras, validate=self._validate,
                                        load=self._load_host, load_ahead=self._load_ahead,
                                        on_weights_changed=self._free_slot_of,
                                        max_loads_in_flight=max_loras)
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per device slot
        self._slot_used_at = [0] * max_loras
        self._clock = 0
        self.num_slot_loads = 0  # adapters written into a device slot
        # The shapes are bound here, not passed: a captured graph's arguments are flattened
        # and keyed leaf by leaf on every call, and ~170 ints cost ~0.9 ms per write.
        self._write_eager = functools.partial(_write_slot_images, shapes=self._shapes)
        self._write_graph = self._write_eager  # replaced by a captured graph (use_runtime)
        self._captured_writes = False
        self._rt = None  # the runner's runtime (use_runtime)
        self.staging: DeviceStaging | None = None  # (use_runtime)
        self._buffer_state: FixedTensors | None = None
        self._model_targets: dict | None = None
        self._valid_headers: OrderedDict[bytes, None] = OrderedDict()  # see _validate
        self._flat_numel = sum(math.prod(shape) for shape in self._shapes)
        # Recipe digest -> its CopyPlan, or None for a recipe that has none (see _load_host).
        self._plans: OrderedDict[bytes, CopyPlan | None] = OrderedDict()
        self._plans_lock = threading.Lock()  # the loader thread and add_lora both load

    def use_runtime(self, runtime, capture=None) -> None:
        """Write slots through the runner's runtime, once it has moved (and maybe sharded)
        the model; with a capture, as a captured graph: a write then runs no tracing,
        only the transfer and one cached executable that updates the buffers in place."""
        self._rt = runtime
        # Only where a transfer may start on the loader thread, and a write takes one
        # flat image per adapter.
        if self.one_transfer and runtime.transfers_from_any_thread:
            self.staging = DeviceStaging(runtime)
        self._buffer_state = FixedTensors(self.buffers)
        self._captured_writes = capture is not None
        self._write_graph = (capture.compile(self._write_eager) if capture is not None
                             else runtime.eager(self._write_eager))

    def kernel_layers(self) -> list[tuple[int | None, list[int]]]:
        """(in_features, output slices) of the layers that run the bgmv kernels: the
        linears, and the embedding's expand (its shrink is a lookup, in_features None);
        lm_head's LoRA is a dense product in the logits graph."""
        return [(layer.in_features if isinstance(layer, LoRALinear) else None,
                 list(layer.output_slices))
                for name, layer in self.layers.items() if name != "lm_head"]

    @property
    def logits_buffers(self) -> list[torch.Tensor]:
        """lm_head's LoRA buffers (the logits graph's arguments), if lm_head is adapted."""
        layer = self.layers.get("lm_head")
        return [] if layer is None else [*layer.lora_a, *layer.lora_b]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every slot buffer, in the order slot images are laid out in (also the forward
        graphs' LoRA arguments). Looked up each time: the runner moves (and may shard) the
        model after this manager is built."""
        return ([buf for layer in self.layers.values()
                 for pair in zip(layer.lora_a, layer.lora_b) for buf in pair]
                + [buf for layer in self.layers.values() for buf in layer.lora_vectors])

    # ---- adapters (vLLM's LoRA manager verbs) ----

    def add_lora(self, request: LoRARequest) -> bool:
        """Read and validate the adapter into the host cache now. False if already there."""
        return self.registry.load_now(request)

    def register(self, request: LoRARequest) -> None:
        """A request names this adapter: validate its files (no tensor data read); a cached
        adapter's files are checked once per registry round."""
        self.registry.register(request, once_per_round=True)

    def load_inplace(self, request: LoRARequest) -> None:
        self.registry.replace(request)

    def remove_lora(self, lora_id: int) -> bool:
        """Free the adapter's device slot and host copy. False if it was not known."""
        entry = self.registry.remove(lora_id)
        self._free_slot_of(lora_id)
        return entry is not None

    def pin_lora(self, lora_id: int) -> bool:
        entry = self.registry.entries.get(lora_id)
        if entry is None or entry.host is None:
            raise ValueError(f"LoRA {lora_id} is not loaded; add it before pinning")
        if entry.pinned:
            return True
        pinned = self.pinned
        if len(pinned) + 1 >= self.max_loras:
            raise ValueError(
                f"Cannot pin LoRA {lora_id}: max_loras is {self.max_loras} and "
                f"{len(pinned)} adapter(s) are pinned; pinning another would leave no device "
                "slot for the unpinned adapters (raise --max-loras)")
        self.registry.pin(lora_id)
        if lora_id not in self.slots:  # vLLM's pin also activates the adapter
            slot = self._evictable_slot(needed={lora_id})
            if slot is not None:
                self._load_into_slot(lora_id, slot)
        return True

    @property
    def pinned(self) -> set[int]:
        return self.registry.pinned_ids()

    def list_loras(self) -> set[int]:
        return self.registry.cached_ids()

    def is_loaded(self, lora_id: int) -> bool:
        entry = self.registry.entries.get(lora_id)
        return entry is not None and entry.host is not None

    @property
    def num_host_loads(self) -> int:
        return self.registry.num_host_loads

    @property
    def num_slots_in_use(self) -> int:
        return sum(s is not None for s in self.slots)

    # ---- references (the scheduler's admission policy) ----

    def ready(self, lora_id: int) -> bool:
        return self.registry.ready(lora_id)

    def acquire(self, lora_id: int) -> None:
        self.registry.acquire(lora_id)

    def release(self, lora_id: int) -> None:
        self.registry.release(lora_id)

    def weights_key(self, lora_id: int) -> tuple[int, int]:
        """The identity of the weights a sequence admitted now runs on: the id and a version
        that changes on every reload (what the prefix cache keys KV blocks by)."""
        return lora_id, self.registry.entries[lora_id].weights_version

    def set_running(self, lora_id: int, delta: int) -> None:
        entry = self.registry.entries.get(lora_id)
        if entry is not None:
            entry.running += delta

    # ---- host copies ----

    def _targets(self) -> dict:
        """The adapter-capable modules, walked once (on the first adapter named, after the
        runner has finished reshaping the model; the loader thread only reads it)."""
        if self._model_targets is None:
            self._model_targets = model_targets(self.model, self.target_modules)
        return self._model_targets

    def _validate(self, request: LoRARequest) -> tuple | None:
        """Header-only validation when a request names an adapter (engine thread). Its
        outcome depends only on the files' config and header and this engine's settings,
        so a digest of the two that passed before passes again without the ~0.5-1 ms of
        parsing: the cost of naming the 1,000th adapter of one recipe is two small reads.
        Returns the fingerprint of the files as read (None: not read that way, e.g. a
        .bin adapter; the caller takes adapter_fingerprint)."""
        files = read_adapter_bytes(request.lora_path)
        if files is not None and files.digest in self._valid_headers:
            self._valid_headers.move_to_end(files.digest)
            return files.fingerprint
        load_peft_adapter(request, self.model, max_lora_rank=self.max_rank, dtype=torch.float32,
                          target_modules=self.target_modules, header_only=True,
                          allow_bias=self.allow_bias, allow_dora=self.allow_dora,
                          targets=self._targets())
        if files is None:
            return None
        # Remembered only if the files did not change while they were validated.
        if files.digest == header_digest(request.lora_path):
            self._valid_headers[files.digest] = None
            if len(self._valid_headers) > _VALID_HEADERS_KEPT:
                self._valid_headers.popitem(last=False)
        return files.fingerprint

    def _load_host(self, request: LoRARequest) -> HostAdapter:
        """Read, validate and lay out an adapter (loader thread, or the engine thread for
        add_lora: touches no engine state). An adapter of a recipe laid out before is
        copied straight from its file bytes (see copy_plan.py)."""
        # The data is read here only for a recipe with a plan, or one not seen yet (to
        # learn its plan); a recipe known to have none goes the whole way alone.
        files = read_adapter_bytes(request.lora_path, self._plan_wanted)
        with self._plans_lock:
            known = files is not None and files.digest in self._plans
            plan = self._plans[files.digest] if known else None
            if known:
                self._plans.move_to_end(files.digest)
        if plan is not None and files.data is not None:
            flat = plan.image(files.data, self._flat_numel, self._views, self.dtype)
            if torch.isfinite(flat.sum(dtype=torch.float32)):
                return HostAdapter(request.lora_name, flat)
            # Not finite: the whole way below names the culprit in its error.
        host = self._load_whole_way(request)
        if files is not None and files.data is not None and not known:
            self._learn_plan(request, files, host)
        return host

    def _load_ahead(self, request: LoRARequest) -> HostAdapter:
        """The loader thread's read for a queued request: _load_host, then the image's
        transfer started (staging.py), as its slot write will follow soon."""
        host = self._load_host(request)
        if self.staging is not None:
            self.staging.stage(host)
        return host

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return _slot_views(flat, self._shapes)

    def _plan_wanted(self, digest: bytes) -> bool:
        with self._plans_lock:
            return self._plans.get(digest, True) is not None

    def _learn_plan(self, request: LoRARequest, files: AdapterBytes, host: HostAdapter) -> None:
        """Record the copy plan of `host`'s recipe (None: not a plain adapter, or the plan
        does not rebuild this very image bit for bit, e.g. the files changed meanwhile)."""
        slices = plain_slices(request.lora_path, self._targets())
        plan = None
        if slices is not None:
            plan = build_plan(slices, json.loads(files.header), self._layout)
        if plan is not None:
            flat = plan.image(files.data, self._flat_numel, self._views, self.dtype)
            if not torch.equal(flat, host.flat):
                plan = None
        with self._plans_lock:
            self._plans[files.digest] = plan
            if len(self._plans) > _VALID_HEADERS_KEPT:
                self._plans.popitem(last=False)

    def _load_whole_way(self, request: LoRARequest) -> HostAdapter:
        # float32 while scaling: the scale is folded into B before the cast to self.dtype.
        lora = load_peft_adapter(request, self.model, max_lora_rank=self.max_rank,
                                 dtype=torch.float32, target_modules=self.target_modules,
                                 allow_bias=self.allow_bias, allow_dora=self.allow_dora,
                                 base_rows=self._base_rows, targets=self._targets(),
                                 check_finite=False)
        host = self._host_adapter(lora)
        # One reduction over the image that will be served (in the serving dtype, the scale
        # folded in) instead of a concatenated copy of every tensor; the exact per-tensor
        # check runs only to name the culprit.
        if not torch.isfinite(host.flat.sum(dtype=torch.float32)) and not (
                torch.isfinite(host.flat).all()):
            raise_if_not_finite(lora, torch.float32)  # the dtype it was loaded in
            raise ValueError(f"Loading lora {request.lora_name} failed: its weights times "
                             f"its scale overflow {self.dtype}.")
        return host

    def _host_adapter(self, lora: LoRAModel | None) -> HostAdapter:
        """The slot image, written in place into one zeroed flat tensor: each slice
        zero-padded to max_rank, its scale folded into B (so the kernels need no scale)."""
        flat = torch.zeros(self._flat_numel, dtype=self.dtype)
        views = _slot_views(flat, self._shapes)  # A, B, A, B, ... in _layout's order
        n_ab = 2 * len(self._layout)
        for (name, i, _, _, by_input, by_rank), a, b in zip(self._layout, views[0:n_ab:2],
                                                            views[1:n_ab:2]):
            slices = lora.modules.get(name) if lora is not None else None
            w = slices[i] if slices else None
            if w is not None:
                r = w.lora_a.shape[0]  # PEFT's lora_a [r, in], lora_b [out, r]
                rank_rows(a, not by_input)[:r] = w.lora_a
                # B scaled in float32, then cast
                rank_rows(b, by_rank)[:r] = (w.lora_b.float() * w.scale).T
        for (name, kind, sizes), row in zip(self._vector_layout, views[n_ab:]):
            slices = lora.modules.get(name) if lora is not None else None
            for i, (offset, size) in enumerate(zip(_offsets(sizes), sizes)):
                w = slices[i] if slices else None
                if w is not None:
                    row[offset:offset + size] = self._slice_vector(name, kind, w, offset, size)
        return HostAdapter(lora.name if lora is not None else "", flat)

    def _slice_vector(self, name: str, kind: str, w: LoRASliceWeights, offset: int,
                      size: int) -> torch.Tensor:
        """One slice's part of a per-slot vector row (zeros where the feature is unused)."""
        if kind == "bias":
            return torch.zeros(size) if w.bias is None else w.bias.float() * w.scale
        if w.magnitude is None:
            return torch.zeros(size)
        # DoRA: g = m / ||W + s B A|| per output channel (PEFT's weight norm, the base
        # weight's rows of this slice); stored as g - 1 so that zero means "no rescale".
        base = self._base_weights[name][offset:offset + size].float()
        merged = base + w.scale * (w.lora_b.float() @ w.lora_a.float())
        return w.magnitude.float() / torch.linalg.norm(merged, dim=1) - 1.0

    # ---- device slots ----

    def activate(self, lora_ids) -> dict[int, int]:
        """Put every adapter of this step in a device slot; return {lora_int_id: slot}."""
        needed = set(lora_ids)
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step > max_loras {self.max_loras}")
        self._clock += 1
        loads = []
        for lora_id in needed:
            if lora_id not in self.slots:
                slot = self._evictable_slot(needed)
                if slot is None:
                    raise RuntimeError("no evictable LoRA slot: every slot is pinned or used by "
                                       "a running sequence")
                self._assign_slot(lora_id, slot)
                loads.append((slot, self.registry.host_copy(lora_id)))
            else:  # in its slot still: a copy staged meanwhile (re-read) is not needed
                self._drop_staged(lora_id)
            self._slot_used_at[self.slots.index(lora_id)] = self._clock
        self.write_slots(loads)
        return {lora_id: self.slots.index(lora_id) for lora_id in needed}

    def _drop_staged(self, lora_id: int) -> None:
        entry = self.registry.entries.get(lora_id)
        if entry is not None and entry.host is not None:
            entry.host.device = None

    def _evictable_slot(self, needed: set[int]) -> int | None:
        """A free slot, else the least recently used one that no running sequence, pin or
        this step needs."""
        if None in self.slots:
            return self.slots.index(None)
        entries = self.registry.entries
        candidates = [i for i, lid in enumerate(self.slots)
                      if lid not in needed and not (lid in entries and (entries[lid].pinned
                                                                        or entries[lid].running))]
        return min(candidates, key=lambda i: self._slot_used_at[i]) if candidates else None

    def _load_into_slot(self, lora_id: int, slot: int) -> None:
        self._assign_slot(lora_id, slot)
        self.write_slot(slot, self.registry.host_copy(lora_id))

    def _assign_slot(self, lora_id: int, slot: int) -> None:
        """Book `slot` for the adapter (its weights are written by the caller)."""
        evicted = self.slots[slot]
        if evicted is not None and evicted in self.registry.entries:
            self.registry.entries[evicted].counters["slot_evictions"] += 1
        self.slots[slot] = lora_id
        self.num_slot_loads += 1
        self.registry.entries[lora_id].counters["slot_loads"] += 1

    def _free_slot_of(self, lora_id: int) -> None:
        """Forget the adapter's slot (its weights are gone or stale); the data stays until
        the slot is written again, but nothing indexes a slot that holds no adapter."""
        if lora_id in self.slots:
            self.slots[self.slots.index(lora_id)] = None

    @property
    def write_batch_sizes(self) -> list[int]:
        """How many slots one write graph fills at once (one graph each, at warm-up)."""
        return [k for k in _WRITE_BATCHES if k <= self.max_loras] if self.one_transfer else [1]

    def write_slot(self, slot: int, host: HostAdapter) -> None:
        self.write_slots([(slot, host)])

    def write_slots(self, loads: list[tuple[int, HostAdapter]]) -> None:
        """Write adapters' slot images into their slots of every buffer. A write's fixed
        cost (a transfer and a graph launch, ~0.5 ms on a CPU host) is paid once per batch
        of up to 16: a step whose requests each bring a new adapter fills their slots at
        about the cost of one write plus the bytes (0.16 ms per adapter at 16, 512 KB
        each, on the CPU host, waited for)."""
        rt = self._rt
        if not self.one_transfer:
            for slot, host in loads:  # traced lazily: one write per graph, as at warm-up
                index = rt.to_device(np.array([slot], np.int64))
                for buf, image in zip(self.buffers, _slot_views(host.flat, self._shapes)):
                    buf.index_copy_(0, index, rt.to_device(image[None]))
                platform.sync()
            return
        sizes = self.write_batch_sizes
        while loads:
            # One call for up to the largest size: padded with repeats of the last write
            # (the same image into the same slot again), at most doubling the bytes.
            k = next((n for n in sizes if n >= len(loads)), sizes[-1])
            batch, loads = loads[:k], loads[k:]
            batch += batch[-1:] * (k - len(batch))
            slots = np.array([slot for slot, _ in batch], np.int64)
            # Each image moves as it lies: stacking them into one host array first cost
            # more than the transfers (a fresh multi-MB allocation per write), and on the
            # jax runtime's CPU device a host tensor's transfer is a zero-copy alias. All
            # of a batch's arrays move in one call: JAX's fixed cost per transfer call
            # (~0.2 ms on a CPU host) was most of a small write's time. (A repeat moves
            # again: torch_xla's capture needs distinct tensors.)
            # Images the loader thread staged are on the device already; the rest move
            # here (with the slot indices, in one call).
            move = [host.flat for _, host in batch if host.device is None]
            *moved, index = rt.to_device_many(move + [slots])
            moved = iter(moved)
            flats = [next(moved) if host.device is None else host.device for _, host in batch]
            # The captured write updates the buffers in place (both captures donate the
            # state a graph updates), instead of XLA copying every buffer whole
            # (max_loras adapters' worth) to change a few slots.
            self._write_graph(self._buffer_state, flats, index)
            rt.launched(self._captured_writes)  # traced lazily (enforce_eager): run it now
            for _, host in batch:  # written: the staged copy's device memory goes back
                host.device = None

    def warmup_adapter(self) -> HostAdapter:
        """A random full-rank adapter on every layer, so warm-up traces real LoRA math."""
        gen = torch.Generator().manual_seed(0)
        modules: dict[str, list] = {}
        for name, _, a_shape, b_shape, by_input, by_rank in self._layout:
            a = torch.randn(a_shape, generator=gen) * 0.01
            b = torch.randn(b_shape, generator=gen) * 0.01
            modules.setdefault(name, []).append(  # as PEFT's: lora_a [R, in], lora_b [out, R]
                LoRASliceWeights(a.T if by_input else a, b.T if by_rank else b, 1.0))
        return self._host_adapter(LoRAModel("warmup", 0, "", self.max_rank, modules))

    def clear_all_slots(self) -> None:
        zeros = self._host_adapter(None)
        self.write_slots([(slot, zeros) for slot in range(self.max_loras)])
        self.slots = [None] * self.max_loras

    # ---- observability ----

    def adapter_stats(self, waiting: dict[int, int]) -> dict[str, dict[str, Any]]:
        """Per adapter (by name): loads, evictions, where it is, who uses it.
        `waiting`: waiting sequences per lora id (the scheduler knows them)."""
        out = {}
        for lora_id, e in self.registry.entries.items():
            out[e.request.lora_name] = {
                "lora_int_id": lora_id, **e.counters,
                "on_device": lora_id in self.slots, "in_host_cache": e.host is not None,
                "pinned": e.pinned, "running": e.running, "waiting": waiting.get(lora_id, 0)}
        return out


def _vocab_base_rows(model: torch.nn.Module, n: int = 16) -> dict[str, tuple]:
    """{our module: (row indices, those rows)} of the embedding and lm_head base weights."""
    embed = model.model.embed_tokens.weight
    head = getattr(model, "lm_head", None)
    head = embed if head is None else getattr(head, "base_layer", head).weight
    idx = torch.linspace(0, embed.shape[0] - 1, n).long()
    return {name: (idx, w.detach()[idx].to("cpu", torch.float32).clone())
            for name, w in (("model.embed_tokens", embed), ("lm_head", head))}


def _write_slot_images(buffers: FixedTensors, flats: list[torch.Tensor], slots: torch.Tensor,
                       shapes: list[tuple]) -> list:
    """The slot-write graph: image flats[i] [numel] into slot slots[i] of every buffer
    (in place)."""
    offset = 0
    for buf, shape in zip(buffers.value, shapes):
        n = math.prod(shape)
        ops.put_slots(buf, slots, [flat[offset:offset + n] for flat in flats])
        offset += n
    return []


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _slot_views(flat: torch.Tensor, shapes: list[tuple]) -> list[torch.Tensor]:
    """A slot image split into its buffers' slots: consecutive views of `flat`, shaped."""
    views, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    return views
