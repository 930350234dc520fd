"""The Llama-family decoder as a plain nn.Module (no device code), with the variations of
the architectures built on it (Qwen2/3, Mistral, Gemma/Gemma2, Phi-3) described by a
`DecoderSpec` each model class derives from its HF config. q/k/v and gate/up are packed into
one matmul each; separate checkpoint tensors are written shard by shard through
`packed_modules_mapping` (Phi-3's checkpoint is packed already).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_tpu_lora.layers.attention import (
    AttentionMetadata,
    attention_backend,
    kv_cache_shapes,
    write_kv,
)
from vllm_tpu_lora.layers.linear import MergedLinear, split_packed
from vllm_tpu_lora.layers.norm import GemmaRMSNorm, RMSNorm
from vllm_tpu_lora.layers.rotary import RotaryEmbedding, rope_params

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class DecoderSpec:
    """What differs between the decoders this file implements (defaults: Llama)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k, before RoPE
    gemma_norms: bool = False  # RMSNorm scaling by (1 + weight)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden), in the model dtype
    sandwich_norms: bool = False  # Gemma2: norms after attention and MLP too
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # Gemma2: cap * tanh(scores / cap)
    final_soft_cap: float | None = None  # Gemma2: the same on the logits
    sliding_windows: tuple[int | None, ...] = ()  # per layer; () or None: full attention


def layer_sliding_windows(cfg: dict, is_sliding=lambda i: True) -> tuple[int | None, ...]:
    """Per-layer sliding window from an HF config: its `layer_types` when it has them
    (transformers writes them), else the architecture's rule `is_sliding(layer index)`."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if not window:
        return (None,) * n
    types = cfg.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return tuple(window if is_sliding(i) else None for i in range(n))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, block_size: int, spec: DecoderSpec,
                 sliding_window: int | None) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.attn_scale or self.head_dim**-0.5
        self.soft_cap = spec.attn_soft_cap
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.qkv_proj = MergedLinear(hidden, [self.q_size, self.kv_size, self.kv_size],
                                     spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=spec.o_bias)
        if spec.qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        theta, scaling = rope_params(cfg)
        self.rotary_emb = RotaryEmbedding(self.head_dim, theta, scaling)
        self.attn = attention_backend()

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata):
        t = hidden.shape[0]
        q, k, v = split_packed(self.qkv_proj, hidden, [self.q_size, self.kv_size, self.kv_size])
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        write_kv(kv_cache, k, v.reshape(t, self.num_kv_heads, self.head_dim), meta.slot_mapping)
        out = self.attn(q, kv_cache, meta, self.block_size, self.scale,
                        sliding_window=self.sliding_window, soft_cap=self.soft_cap)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict, spec: DecoderSpec) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        if spec.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"Unsupported hidden_act {spec.hidden_act!r}; supported: "
                             f"{sorted(_ACTIVATIONS)}.")
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.intermediate_size = inter
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], spec.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=spec.mlp_bias)

    def forward(self, x):
        inter = self.intermediate_size
        gate, up = split_packed(self.gate_up_proj, x, [inter, inter])
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, block_size: int, spec: DecoderSpec,
                 sliding_window: int | None) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        norm = GemmaRMSNorm if spec.gemma_norms else RMSNorm
        self.input_layernorm = norm(hidden, eps)
        self.self_attn = LlamaAttention(cfg, block_size, spec, sliding_window)
        self.post_attention_layernorm = norm(hidden, eps)
        self.mlp = LlamaMLP(cfg, spec)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(hidden, eps)
            self.post_feedforward_layernorm = norm(hidden, eps)

    def forward(self, positions, hidden, kv_cache, meta):
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        if not self.sandwich:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        # Gemma2: post_attention_layernorm normalises the attention output itself.
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict, block_size: int, spec: DecoderSpec) -> None:
        super().__init__()
        n = cfg["num_hidden_layers"]
        windows = spec.sliding_windows or (None,) * n
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        # HF multiplies by sqrt(hidden) rounded to the model dtype (the default dtype while
        # load_model builds the model); a Python float keeps it a graph constant.
        self.embed_scale = (torch.tensor(math.sqrt(cfg["hidden_size"]),
                                         dtype=torch.get_default_dtype(), device="cpu").item()
                            if spec.embed_scale else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, block_size, spec, windows[i]) for i in range(n))
        norm = GemmaRMSNorm if spec.gemma_norms else RMSNorm
        self.norm = norm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (packed module, shard index)
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    @classmethod
    def decoder_spec(cls, cfg: dict) -> DecoderSpec:
        bias = bool(cfg.get("attention_bias", False))  # Llama's covers all four projections
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
                           hidden_act=cfg.get("hidden_act", "silu"))

    def __init__(self, cfg: dict, block_size: int) -> None:
        super().__init__()
        self.config = cfg
        spec = self.decoder_spec(cfg)
        self.final_soft_cap = spec.final_soft_cap
        self.model = LlamaModel(cfg, block_size, spec)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """-> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied
            logits = hidden @ self.model.embed_tokens.weight.t()
        else:
            logits = self.lm_head(hidden)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits

    def untie_lm_head(self) -> None:
        """Give a tied model its own lm_head (a copy of the embedding), so the logits
        matmul can be laid out for the device like every other linear."""
        if self.lm_head is None:
            weight = self.model.embed_tokens.weight
            self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                     device=weight.device, dtype=weight.dtype)
            self.lm_head.weight.data.copy_(weight.data)
            self.lm_head.requires_grad_(False)

    def kv_cache_shapes(self, num_slots: int) -> list[tuple]:
        """Per-layer KV cache tensors' shapes (layout chosen by the attention backend)."""
        attn = self.model.layers[0].self_attn
        return kv_cache_shapes(num_slots, attn.num_kv_heads, attn.head_dim)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer when the config sets one."""

    @classmethod
    def decoder_spec(cls, cfg: dict) -> DecoderSpec:
        spec = super().decoder_spec(cfg)
        return DecoderSpec(**{**spec.__dict__, "sliding_windows": layer_sliding_windows(cfg)})
