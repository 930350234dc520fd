"""A Llama decode step written in plain JAX over an engine's own weights: the anchor the
jax runtime's step is measured against (benchmark_jax_runtime.py).

Same weights (the device arrays of a jax-runtime engine's modules, no copy), same batch,
contexts and page size; attention is the same ragged paged attention kernel on a TPU
(its reference implementation elsewhere); the KV pages are donated. No LoRA, no
sampling beyond argmax: what a hand-written step of this model costs on this chip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _array(t):
    return t._elem


def _linear(module):
    return _array(getattr(module, "base_layer", module).weight_t)


def _weights(model) -> dict:
    layers = model.model.layers
    attn = layers[0].self_attn
    return {
        "embed": _array(getattr(model.model.embed_tokens, "base_layer",
                                model.model.embed_tokens).weight),
        "head": _linear(model.lm_head),
        "norm": _array(model.model.norm.weight),
        "inv_freq": _array(attn.rotary_emb.inv_freq),
        "layers": [{
            "ln1": _array(layer.input_layernorm.weight),
            "ln2": _array(layer.post_attention_layernorm.weight),
            "qkv": _linear(layer.self_attn.qkv_proj), "o": _linear(layer.self_attn.o_proj),
            "gu": _linear(layer.mlp.gate_up_proj), "down": _linear(layer.mlp.down_proj),
        } for layer in layers],
        "dims": (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale),
    }


def _rms(x, w, eps=1e-5):
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
    return w * h.astype(x.dtype)


def _rope(x, pos, inv_freq):
    freqs = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = jnp.cos(emb)[:, None, :].astype(x.dtype), jnp.sin(emb)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _attention(metadata: tuple):
    if jax.devices()[0].platform == "tpu":
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )
        return ragged_paged_attention
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    # The reference loops over the sequences in Python: it takes its metadata concrete.
    def reference(q, pages, *_, sm_scale):
        return ref_ragged_paged_attention(q, pages, *metadata, sm_scale=sm_scale)
    return reference


def _pad_last(x, n: int):
    return x if x.shape[-1] == n else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])


def build_anchor(model, contexts: list[int], page_size: int):
    """(step, pages, inputs): `step(pages, *inputs) -> (token ids, pages)`, jitted with
    the pages donated, for a decode step of len(contexts) sequences."""
    w = _weights(model)
    nh, kvh, hd, scale = w.pop("dims")
    b = len(contexts)
    pages_per_seq = -(-max(contexts) // page_size) + 1
    num_pages = b * pages_per_seq + 1
    dtype = w["embed"].dtype
    # The kernel wants head_dim % 128 == 0: pages and queries zero-padded as the engine's.
    hp = -(-hd // 128) * 128
    pages = [jnp.zeros((num_pages, page_size, 2 * kvh, hp), dtype) for _ in w["layers"]]
    kv_lens = np.asarray(contexts, np.int32)
    page_indices = (1 + np.arange(b * pages_per_seq, dtype=np.int32)).reshape(b, pages_per_seq)
    pos = kv_lens - 1
    slots = page_indices[np.arange(b), pos // page_size] * page_size + pos % page_size
    inputs = (jnp.asarray(np.arange(b, dtype=np.int32) % 1000 + 3), jnp.asarray(pos),
              jnp.asarray(kv_lens), jnp.asarray(page_indices),
              jnp.arange(b + 1, dtype=jnp.int32), jnp.asarray([b], jnp.int32),
              jnp.asarray(slots, np.int32))
    attention = _attention((kv_lens, page_indices, np.arange(b + 1, dtype=np.int32),
                            np.asarray([b], np.int32)))

    # Weights are arguments, as the engine's graphs take them: closed over, they became
    # 3 GB of constants baked into the executable.
    def step(w, pages, tok, pos, kv_lens, page_indices, cu_q_lens, num_seqs, slots):
        x = w["embed"][tok]
        new_pages = []
        for lw, pg in zip(w["layers"], pages):
            h = _rms(x, lw["ln1"])
            qkv = h @ lw["qkv"]
            q = _rope(qkv[:, :nh * hd].reshape(b, nh, hd), pos, w["inv_freq"])
            k = _rope(qkv[:, nh * hd:(nh + kvh) * hd].reshape(b, kvh, hd), pos, w["inv_freq"])
            v = qkv[:, (nh + kvh) * hd:].reshape(b, kvh, hd)
            kv = _pad_last(jnp.stack([k, v], 2).reshape(b, 2 * kvh, hd), hp)
            pg = pg.reshape(-1, 2 * kvh, hp).at[slots].set(kv).reshape(pg.shape)
            new_pages.append(pg)
            a = attention(_pad_last(q, hp), pg, kv_lens, page_indices, cu_q_lens, num_seqs,
                          sm_scale=scale)[..., :hd]
            x = x + a.reshape(b, nh * hd) @ lw["o"]
            g, u = jnp.split(_rms(x, lw["ln2"]) @ lw["gu"], 2, -1)
            x = x + (jax.nn.silu(g) * u) @ lw["down"]
        logits = (_rms(x, w["norm"]) @ w["head"]).astype(jnp.float32)
        return jnp.argmax(logits, -1), new_pages

    jitted = jax.jit(step, donate_argnums=(1,))
    return (lambda pages, *args: jitted(w, pages, *args)), pages, inputs
