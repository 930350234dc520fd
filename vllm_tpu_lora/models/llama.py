"""Llama-family decoder (also Mistral-style configs without sliding window) as a plain
nn.Module: no device code. q/k/v and gate/up are packed into one matmul each; the
checkpoint's separate tensors are written shard by shard through `packed_modules_mapping`.
"""

from __future__ import annotations

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
from vllm_tpu_lora.layers.norm import RMSNorm
from vllm_tpu_lora.layers.rotary import RotaryEmbedding, rope_params


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, block_size: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.block_size = block_size
        self.qkv_proj = MergedLinear(hidden, [self.q_size, self.kv_size, self.kv_size], qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        theta, scaling = rope_params(cfg)
        self.rotary_emb = RotaryEmbedding(self.head_dim, theta, scaling)
        self.attn = attention_backend()

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata):
        t = hidden.shape[0]
        q, k, v = split_packed(self.qkv_proj, hidden, [self.q_size, self.kv_size, self.kv_size])
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        write_kv(kv_cache, k, v.view(t, self.num_kv_heads, self.head_dim), meta.slot_mapping)
        out = self.attn(q, kv_cache, meta, self.block_size, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r}; only 'silu' is supported.")
        self.intermediate_size = inter
        bias = cfg.get("mlp_bias", False)
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        inter = self.intermediate_size
        gate, up = split_packed(self.gate_up_proj, x, [inter, inter])
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, block_size: int, biases: tuple[bool, bool]) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttention(cfg, block_size, *biases)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions, hidden, kv_cache, meta):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict, block_size: int, biases: tuple[bool, bool]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, block_size, biases) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (packed module, shard index)
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    @staticmethod
    def attention_biases(cfg: dict) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias): Llama's `attention_bias` covers all four."""
        bias = bool(cfg.get("attention_bias", False))
        return bias, bias

    def __init__(self, cfg: dict, block_size: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, block_size, self.attention_biases(cfg))
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
            return hidden @ self.model.embed_tokens.weight.t()
        return self.lm_head(hidden)

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
