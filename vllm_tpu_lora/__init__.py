"""vllm_tpu_lora: a vLLM-style inference engine for TPUs with multi-LoRA serving."""

from vllm_tpu_lora.assets import demo_assets
from vllm_tpu_lora.llm import LLM
from vllm_tpu_lora.lora.request import LoRARequest
from vllm_tpu_lora.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "demo_assets"]
__version__ = "0.1.0"
