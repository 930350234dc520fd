"""Qwen2: the Llama decoder with biased q/k/v (and an unbiased o_proj)."""

from __future__ import annotations

from vllm_tpu_lora.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg: dict) -> tuple[bool, bool]:
        return True, False
