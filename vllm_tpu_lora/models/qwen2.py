"""Qwen2 and Qwen3: the Llama decoder with Qwen's attention details."""

from __future__ import annotations

from vllm_tpu_lora.models.llama import DecoderSpec, LlamaForCausalLM, layer_sliding_windows


def _qwen_windows(cfg: dict) -> tuple[int | None, ...]:
    """Qwen's rule when the config has no layer_types: sliding only if use_sliding_window,
    from layer max_window_layers on."""
    if not cfg.get("use_sliding_window", False) and not cfg.get("layer_types"):
        return (None,) * cfg["num_hidden_layers"]
    first = cfg.get("max_window_layers", 0)
    return layer_sliding_windows(cfg, lambda i: i >= first)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Biased q/k/v, unbiased o_proj."""

    @classmethod
    def decoder_spec(cls, cfg: dict) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, hidden_act=cfg.get("hidden_act", "silu"),
                           sliding_windows=_qwen_windows(cfg))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """An RMSNorm over each head of q and k before RoPE; attention_bias (default none)."""

    @classmethod
    def decoder_spec(cls, cfg: dict) -> DecoderSpec:
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True,
                           hidden_act=cfg.get("hidden_act", "silu"),
                           sliding_windows=_qwen_windows(cfg))
