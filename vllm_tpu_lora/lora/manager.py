"""LoRAManager: `max_loras` device slots in stacked buffers, an LRU host cache behind them.

- Host cache (`max_cpu_loras` adapters, LRU): parsed, validated PEFT adapters.
- Device slots (`max_loras`): which adapter's weights sit in each slot of every LoRA
  layer's buffers. `activate()` makes sure the adapters of one step are in slots,
  evicting the least recently used unpinned slot that the step does not need.
- A slot write is a data update: every buffer gets `index_copy_` at a slot index held in a
  device tensor, all in one graph that is compiled once (at warm-up) for every slot.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from vllm_tpu_lora import platform
from vllm_tpu_lora.lora.layers import LoRALinear
from vllm_tpu_lora.lora.peft_loader import LoRAModel, LoRASliceWeights, load_peft_adapter
from vllm_tpu_lora.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model: torch.nn.Module, layers: dict[str, LoRALinear], *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 target_modules=None) -> None:
        self.model = model
        self.target_modules = target_modules
        self.layers = layers
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = dtype
        self._cache: OrderedDict[int, LoRAModel] = OrderedDict()  # host LRU, newest last
        self._requests: dict[int, LoRARequest] = {}
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per device slot
        self._slot_used_at = [0] * max_loras
        self._clock = 0
        self.pinned: set[int] = set()
        self.num_slot_loads = 0  # adapters written into a device slot
        self.num_host_loads = 0  # adapters read from disk into the host cache

    # ---- host cache ----

    def add_lora(self, request: LoRARequest) -> bool:
        """Load (or refresh) an adapter in the host cache. False if it was already there."""
        if request.lora_int_id in self._cache:
            self._cache.move_to_end(request.lora_int_id)
            return False
        # float32 on the host: the scale is folded into B before the cast to self.dtype.
        lora = load_peft_adapter(request, self.model, max_lora_rank=self.max_rank,
                                 dtype=torch.float32, target_modules=self.target_modules)
        self.num_host_loads += 1
        self._make_room_in_cache()
        self._cache[request.lora_int_id] = lora
        self._requests[request.lora_int_id] = request
        return True

    def _make_room_in_cache(self) -> None:
        while len(self._cache) >= self.max_cpu_loras:
            victim = next((i for i in self._cache if i not in self.pinned), None)
            if victim is None:
                raise ValueError(f"All {self.max_cpu_loras} cached LoRAs are pinned; "
                                 "cannot load another (raise max_cpu_loras)")
            self._drop(victim)

    def _drop(self, lora_id: int) -> None:
        self._cache.pop(lora_id, None)
        self._requests.pop(lora_id, None)
        self.pinned.discard(lora_id)
        if lora_id in self.slots:
            self.slots[self.slots.index(lora_id)] = None

    def remove_lora(self, lora_id: int) -> bool:
        """Free the adapter's device slot and host copy. False if it was not loaded."""
        if lora_id not in self._cache and lora_id not in self.slots:
            return False
        self._drop(lora_id)
        return True

    def pin_lora(self, lora_id: int) -> bool:
        if lora_id not in self._cache:
            raise ValueError(f"LoRA {lora_id} is not loaded; add it before pinning")
        if lora_id not in self.pinned and len(self.pinned) >= self.max_loras:
            raise ValueError(f"Cannot pin more than max_loras ({self.max_loras}) LoRAs")
        self.pinned.add(lora_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self._cache)

    def is_loaded(self, lora_id: int) -> bool:
        return lora_id in self._cache

    @property
    def num_slots_in_use(self) -> int:
        return sum(s is not None for s in self.slots)

    # ---- device slots ----

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Put every adapter of this step in a device slot; return {lora_int_id: slot}."""
        if len(requests) > self.max_loras:
            raise RuntimeError(f"{len(requests)} adapters in one step > max_loras {self.max_loras}")
        self._clock += 1
        for lora_id, req in requests.items():
            if lora_id not in self._cache:
                self.add_lora(req)  # evicted from the host cache since: reload from disk
            self._cache.move_to_end(lora_id)
            if lora_id not in self.slots:
                self._load_into_slot(lora_id, self._free_slot(set(requests)))
            self._slot_used_at[self.slots.index(lora_id)] = self._clock
        return {lora_id: self.slots.index(lora_id) for lora_id in requests}

    def _free_slot(self, needed: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        candidates = [i for i, lid in enumerate(self.slots)
                      if lid not in needed and lid not in self.pinned]
        if not candidates:
            raise RuntimeError("no evictable LoRA slot: every slot is pinned or in use")
        return min(candidates, key=lambda i: self._slot_used_at[i])

    def _load_into_slot(self, lora_id: int, slot: int) -> None:
        self.write_slot(slot, self._cache[lora_id])
        self.slots[slot] = lora_id
        self.num_slot_loads += 1

    def write_slot(self, slot: int, lora: LoRAModel | None) -> None:
        """Write an adapter (None: zeros) into `slot` of every buffer, as one graph."""
        device = next(iter(self.layers.values())).lora_a_0.device
        slot_t = torch.tensor([slot], dtype=torch.int64, device=device)
        for name, layer in self.layers.items():
            slices = lora.modules.get(name) if lora is not None else None
            for i, (a_buf, b_buf) in enumerate(zip(layer.lora_a, layer.lora_b)):
                weights = slices[i] if slices else None
                a, b = self._padded(weights, a_buf.shape[1:], b_buf.shape[1:])
                a_buf.index_copy_(0, slot_t, a.to(device)[None])
                b_buf.index_copy_(0, slot_t, b.to(device)[None])
        platform.sync()

    def _padded(self, w, a_shape, b_shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-pad to max_rank and fold the scale into B (so the kernels need no scale)."""
        a = torch.zeros(a_shape, dtype=self.dtype)
        b = torch.zeros(b_shape, dtype=self.dtype)
        if w is not None:
            r = w.lora_a.shape[0]
            a[:r] = w.lora_a.to(self.dtype)
            b[:, :r] = (w.lora_b.float() * w.scale).to(self.dtype)
        return a, b

    def warmup_adapter(self) -> LoRAModel:
        """A random full-rank adapter on every layer, so warm-up traces real LoRA math."""
        gen = torch.Generator().manual_seed(0)
        modules = {}
        for name, layer in self.layers.items():
            modules[name] = [
                LoRASliceWeights(torch.randn(a.shape[1:], generator=gen) * 0.01,
                                 torch.randn(b.shape[1:], generator=gen) * 0.01, 1.0)
                for a, b in zip(layer.lora_a, layer.lora_b)]
        return LoRAModel("warmup", 0, "", self.max_rank, modules)

    def clear_all_slots(self) -> None:
        for slot in range(self.max_loras):
            self.write_slot(slot, None)
        self.slots = [None] * self.max_loras
