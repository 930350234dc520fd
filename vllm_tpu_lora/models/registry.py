"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from vllm_tpu_lora.models.gemma import Gemma2ForCausalLM, GemmaForCausalLM
from vllm_tpu_lora.models.llama import LlamaForCausalLM, MistralForCausalLM
from vllm_tpu_lora.models.phi3 import Phi3ForCausalLM
from vllm_tpu_lora.models.qwen2 import Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(cfg: dict) -> type:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"Model architectures {archs} are not supported for now. "
        f"Supported architectures: {supported_architectures()}"
    )
