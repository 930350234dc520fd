"""PunicaWrapper: the per-step LoRA metadata every LoRA layer reads, and the shrink/expand
dispatch (vLLM's method names).

Per step the runner sets, as data only: `token_lora_idx` [T] (position of each token's
adapter in the step's active list, -1 for the base model and padding) and `active_slots`
[S] (device slot of each active position), where S is the step's LoRA-slot bucket. The
bucket itself is the only Python-level value and it is part of the graph key: S = 0 traces
no LoRA op at all, and the cost of the LoRA ops grows with S, not with max_loras.
"""

from __future__ import annotations

import torch

from vllm_tpu_lora import ops


class PunicaWrapper:
    def __init__(self, backend: str) -> None:
        self.backend = ops.resolve_backend(backend)
        self.num_active_slots = 0  # the slot bucket S of the graph being traced
        self.token_lora_idx: torch.Tensor | None = None
        self.active_slots: torch.Tensor | None = None
        self._layout = None
        self._ones = None

    def set_step(self, num_active_slots: int, token_lora_idx: torch.Tensor | None,
                 active_slots: torch.Tensor | None) -> None:
        self.num_active_slots = num_active_slots
        self.token_lora_idx, self.active_slots = token_lora_idx, active_slots
        self._layout = None  # built lazily, once per traced forward, by the first layer

    @property
    def active(self) -> bool:
        return self.num_active_slots > 0

    def _get_layout(self, dtype: torch.dtype):
        if self._layout is None:
            idx = self.token_lora_idx
            self._layout = ops.make_segment_layout(idx, self.num_active_slots,
                                                   backend=self.backend, dtype=dtype)
            # Adapter scales are folded into lora_b at load time.
            self._ones = torch.ones(self.num_active_slots, dtype=dtype, device=idx.device)
        return self._layout

    def add_shrink(self, x: torch.Tensor, lora_a: torch.Tensor,
                   keep_rank_axis: bool = False) -> torch.Tensor:
        """Semantics: ys = x @ lora_a[slot(t)].T for the active slots, in segment layout.
        Shapes: x [T, D], lora_a [max_loras, R, D] -> [T_pad, R]. keep_rank_axis: for a
        rank-sharded lora_a (see ops.bgmv_xla.onehot_shrink)."""
        layout = self._get_layout(x.dtype)
        a = lora_a.index_select(0, self.active_slots)
        return ops.segment_shrink(x, a, layout, self._ones, backend=self.backend,
                                  keep_rank_axis=keep_rank_axis)

    def add_expand(self, y: torch.Tensor, ys: torch.Tensor, lora_b: torch.Tensor,
                   offset: int, size: int) -> torch.Tensor:
        """Semantics: y[:, offset:offset+size] += ys @ lora_b[slot(t)].T.
        Shapes: y [T, O_total], ys [T_pad, R], lora_b [max_loras, size, R] -> y'."""
        b = lora_b.index_select(0, self.active_slots)
        return ops.segment_expand(ys, b, self._get_layout(y.dtype), y, offset, size,
                                  backend=self.backend)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                        lora_b: list[torch.Tensor], output_slices: list[int]) -> torch.Tensor:
        """y += LoRA(x) for every slice of a (possibly packed) linear layer."""
        offset = 0
        for a, b, size in zip(lora_a, lora_b, output_slices):
            y = self.add_expand(y, self.add_shrink(x, a), b, offset, size)
            offset += size
        return y
