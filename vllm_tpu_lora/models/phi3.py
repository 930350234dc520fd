"""Phi-3: the Llama decoder with q/k/v and gate/up already packed in the checkpoint
(`qkv_proj`, `gate_up_proj`), so PEFT adapters target the packed modules, and a sliding
window on every layer when the config sets one."""

from __future__ import annotations

from vllm_tpu_lora.layers.rotary import rope_params
from vllm_tpu_lora.models.llama import DecoderSpec, LlamaForCausalLM, layer_sliding_windows


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: dict[str, list[str]] = {}  # the checkpoint is packed already

    @classmethod
    def decoder_spec(cls, cfg: dict) -> DecoderSpec:
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        partial = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ValueError(f"Phi3ForCausalLM with partial_rotary_factor={partial} is not "
                             "supported (only full rotary embeddings).")
        rope_params(cfg)  # rejects rope types we cannot compute (e.g. longrope) up front
        return DecoderSpec(hidden_act=cfg.get("hidden_act", "silu"),
                           sliding_windows=layer_sliding_windows(cfg))
