"""Which part of every sharded dimension each device holds: pure arithmetic, no XLA.

Tensor parallelism over N devices splits heads and the MLP's intermediate dimension. A
layer output slice (q, k, v, gate or up) is cut into `groups` contiguous shards of whole
units (heads of head_dim columns, or single columns). Normally groups == N; when a model
has fewer kv heads than N, the kv slices have groups == num_kv_heads and each kv head is
replicated on N // num_kv_heads consecutive devices, so that every device holds the kv
head its query heads attend to (vLLM's rule). Device i holds group `i * groups // N`.

The layout is validated here, before any weight is loaded, with errors that name the
numbers (vLLM's wording where vLLM has one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SliceShard:
    """One output slice of a column-parallel layer, split over `tp` devices."""

    units: int  # heads, or columns
    unit_size: int  # head_dim, or 1
    groups: int  # distinct shards; tp // groups devices hold each one
    tp: int

    @property
    def size(self) -> int:
        return self.units * self.unit_size

    @property
    def local_size(self) -> int:
        """Columns of this slice on every device."""
        return self.units // self.groups * self.unit_size

    def group_of(self, device: int) -> int:
        return device * self.groups // self.tp

    def columns_of(self, device: int) -> tuple[int, int]:
        """(offset, size) of this device's columns within the slice."""
        return self.group_of(device) * self.local_size, self.local_size


def _heads(cfg: dict) -> tuple[int, int, int]:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return heads, kv_heads, head_dim


def attention_slices(cfg: dict, tp: int) -> list[SliceShard]:
    """q, k, v of the packed qkv_proj: q heads split N ways, kv heads split or replicated."""
    heads, kv_heads, head_dim = _heads(cfg)
    if heads % tp:
        raise ValueError(f"Total number of attention heads ({heads}) must be divisible by "
                         f"tensor parallel size ({tp}).")
    if kv_heads >= tp and kv_heads % tp:
        raise ValueError(f"Total number of key-value heads ({kv_heads}) must be divisible by "
                         f"tensor parallel size ({tp}).")
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(f"Tensor parallel size ({tp}) must be divisible by the total number of "
                         f"key-value heads ({kv_heads}) when there are fewer kv heads than "
                         "devices (each kv head is then replicated).")
    q = SliceShard(heads, head_dim, tp, tp)
    kv = SliceShard(kv_heads, head_dim, min(kv_heads, tp), tp)
    return [q, kv, kv]


def mlp_slices(cfg: dict, tp: int) -> list[SliceShard]:
    """gate and up of the packed gate_up_proj: intermediate columns split N ways."""
    inter = cfg["intermediate_size"]
    if inter % tp:
        raise ValueError(f"intermediate_size ({inter}) must be divisible by tensor parallel "
                         f"size ({tp}).")
    part = SliceShard(inter, 1, tp, tp)
    return [part, part]


def kv_cache_groups(cfg: dict, tp: int) -> int:
    """Distinct shards of the KV cache's head dimension (kv heads replicated if fewer than N)."""
    return attention_slices(cfg, tp)[1].groups


def check_lora_layout(tp: int, max_lora_rank: int, fully_sharded: bool, backend: str) -> None:
    if fully_sharded and max_lora_rank % tp:
        raise ValueError(f"fully_sharded_loras shards the LoRA rank: max_lora_rank "
                         f"({max_lora_rank}) must be divisible by tensor parallel size ({tp}).")
    if backend == "pallas":
        raise ValueError("lora_backend='pallas' does not support tensor_parallel_size > 1: the "
                         "Pallas kernel is an opaque custom call that XLA's SPMD partitioner "
                         "would replicate. Use lora_backend='xla' (or 'auto').")
