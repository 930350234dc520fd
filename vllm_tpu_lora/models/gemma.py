"""Gemma and Gemma2: the Llama decoder with Gemma's norms, GeGLU and scaled embeddings."""

from __future__ import annotations

from vllm_tpu_lora.models.llama import DecoderSpec, LlamaForCausalLM, layer_sliding_windows


def _act(cfg: dict) -> str:
    # Gemma configs name the MLP activation `hidden_activation` (tanh-approximated GELU);
    # `hidden_act` is an older, ignored field.
    return cfg.get("hidden_activation") or "gelu_pytorch_tanh"


class GemmaForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: dict) -> DecoderSpec:
        return DecoderSpec(hidden_act=_act(cfg), gemma_norms=True, embed_scale=True,
                           qkv_bias=bool(cfg.get("attention_bias", False)),
                           o_bias=bool(cfg.get("attention_bias", False)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Plus norms after attention and MLP, logit soft-capping in attention and on the
    output, query scaling by query_pre_attn_scalar, and sliding-window attention on every
    other layer (the even ones, unless the config lists layer_types)."""

    @classmethod
    def decoder_spec(cls, cfg: dict) -> DecoderSpec:
        scalar = cfg.get("query_pre_attn_scalar")
        return DecoderSpec(
            hidden_act=_act(cfg), gemma_norms=True, embed_scale=True, sandwich_norms=True,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            attn_scale=scalar**-0.5 if scalar else None,
            attn_soft_cap=cfg.get("attn_logit_softcapping"),
            final_soft_cap=cfg.get("final_logit_softcapping"),
            sliding_windows=layer_sliding_windows(cfg, lambda i: i % 2 == 0))
