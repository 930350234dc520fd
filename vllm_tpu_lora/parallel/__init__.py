"""Tensor parallelism with XLA's SPMD partitioner: no hand-written collectives, XLA
inserts them from the annotations. On either runtime (parallel/mesh.py): torch_xla's
SPMD mode (`use_spmd`, `mark_sharding`), or the jax runtime's `NamedSharding`s over a
`jax.sharding.Mesh`, whose graphs are captured once and replayed like one device's.

The engine and the runner call `TensorParallel` at three points (DESIGN.md §4 still
holds: every graph is compiled at warm-up, adapter loads are data updates):
- `TensorParallel.create(...)`: validates the layout, then turns SPMD on, before any XLA
  tensor exists (layout.py, platform.enable_spmd, mesh.py);
- `prepare(model)`: on the host, before the move to the device, reorders the packed
  qkv / gate_up columns into per-device blocks (packed.py) and wraps the attention
  kernel to run on each device's heads (attention.py);
- `shard(model, kv_caches, lora_layers)`: after the move, annotates every weight, KV
  cache and LoRA buffer (sharding.py).
"""

from __future__ import annotations

from vllm_tpu_lora import platform
from vllm_tpu_lora.parallel.layout import (
    attention_slices,
    check_lora_layout,
    kv_cache_groups,
    mlp_slices,
)


class TensorParallel:
    def __init__(self, size: int, hf_config: dict, lora_config=None) -> None:
        """Validates only (pure): errors name the numbers, nothing touches XLA."""
        self.size = size
        self.layouts = {"qkv_proj": attention_slices(hf_config, size),
                        "gate_up_proj": mlp_slices(hf_config, size)}
        self.kv_groups = kv_cache_groups(hf_config, size)
        self.fully_sharded_loras = bool(lora_config and lora_config.fully_sharded_loras)
        if lora_config is not None:
            check_lora_layout(size, lora_config.max_lora_rank, lora_config.fully_sharded_loras,
                              lora_config.lora_backend)
        self.tpm = None

    @classmethod
    def create(cls, size: int, hf_config: dict, lora_config=None,
               runtime: str = "torch_xla") -> TensorParallel | None:
        """None for size 1; else validate and build the mesh (torch_xla: enable SPMD)."""
        if size == 1:
            return None
        tp = cls(size, hf_config, lora_config)
        if runtime == "jax":
            from vllm_tpu_lora.parallel.mesh import JaxTPMesh

            tp.tpm = JaxTPMesh(size, platform.jax_device_count(size), tp.kv_groups)
        else:
            from vllm_tpu_lora.parallel.mesh import XlaTPMesh

            tp.tpm = XlaTPMesh(size, platform.enable_spmd(size))
        return tp

    @staticmethod
    def lora_backend(requested: str) -> str:
        # The one-hot XLA ops partition like any other op; 'pallas' was rejected above.
        return "xla" if requested == "auto" else requested

    def prepare(self, model) -> None:
        from vllm_tpu_lora.parallel.attention import shard_attention
        from vllm_tpu_lora.parallel.packed import replace_packed_linears

        replace_packed_linears(model, self.layouts, self.tpm)
        if not shard_attention(model, self.tpm, self.kv_groups):
            raise ValueError(f"tensor parallelism found no attention in {type(model).__name__}")

    def shard(self, model, kv_caches: list[tuple], lora_layers: dict | None) -> dict[str, str]:
        from vllm_tpu_lora.parallel import sharding

        done = sharding.shard_model(model, self.tpm)
        sharding.shard_kv_caches(kv_caches, self.tpm, self.kv_groups)
        if lora_layers:
            sharding.shard_lora_buffers(lora_layers, self.tpm, self.fully_sharded_loras)
        return done


__all__ = ["TensorParallel"]
