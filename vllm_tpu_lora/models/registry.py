"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from vllm_tpu_lora.models.llama import LlamaForCausalLM
from vllm_tpu_lora.models.qwen2 import Qwen2ForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(cfg: dict) -> type:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            if arch == "MistralForCausalLM" and cfg.get("sliding_window"):
                raise ValueError(
                    "MistralForCausalLM with sliding_window is not supported "
                    f"(sliding_window={cfg['sliding_window']})."
                )
            return _MODELS[arch]
    raise ValueError(
        f"Model architectures {archs} are not supported for now. "
        f"Supported architectures: {supported_architectures()}"
    )
