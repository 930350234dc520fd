"""A Llama decode step written in plain JAX over an engine's own weights: the anchor the
jax runtime's step is measured against (benchmark_jax_runtime.py).

Same weights (the device arrays of a jax-runtime engine's modules, no copy), same batch,
contexts and page size; attention is the same ragged paged attention kernel on a TPU
(its reference implementation elsewhere); the KV pages are donated. No LoRA, no
sampling beyond argmax: what a hand-written step of this model costs on this chip.

With `lora_adapters=n` every linear also adds its LoRA delta from the engine's own slot
buffers, as plain JAX would write it: token t takes adapter t % n, each slice a one-hot
product over its adapters' A and B. `lora_form` says how the n adapters are read:
  - "stacked": the first n slots as they lie (no copy: a step with every slot in use);
  - "all": every slot as it lies, the one-hot over all of them (n of them used);
  - "gathered": the n slots taken by index (a device array, as the engine's step does),
    `jnp.take` (XLA's gather);
  - "sliced": the same n slots as n dynamic slices, concatenated (the engine's onehot
    on a TPU until 2026-12-07: +9.0 ms a decode step over 32 of 128 slots there);
  - "dma": the same n slots copied by the engine's DMA kernel (ops/slot_copy.py, its
    onehot's copy since; interpreted off a TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _array(t):
    return t._elem


def _linear(module):
    return _array(getattr(module, "base_layer", module).weight_t)


def _lora_slices(module) -> list[tuple]:
    """(A, B) per output slice of a LoRA linear; [] without LoRA. A is [N, R, D], or
    [N, D, R] where the engine holds it so (its `a_by_input`)."""
    if not hasattr(module, "lora_a"):
        return []
    return list(zip(map(_array, module.lora_a), map(_array, module.lora_b)))


def _read_adapters(w, n: int, active, form: str):
    if form == "stacked":
        return w[:n]
    if form == "all":
        return w
    if form == "gathered":
        return jnp.take(w, active, axis=0)
    if form == "dma":
        from vllm_tpu_lora.ops.slot_copy import take_slots_dma

        return take_slots_dma([w], active, interpret=jax.devices()[0].platform != "tpu")
    return jnp.concatenate([jax.lax.dynamic_index_in_dim(w, active[i], 0) for i in range(n)])


def _lora_delta(h, slices, onehot, active, form: str, by_input: bool):
    """h [T, D] -> the concatenated slices' deltas [T, O], token t's own adapter selected by
    onehot [T, n] (the n adapters: the first n slots, or `active`'s)."""
    n, deltas = onehot.shape[1], []
    if form == "all":  # over every slot: the ones past n selected by no token
        onehot = jnp.pad(onehot, ((0, 0), (0, slices[0][0].shape[0] - n)))
    with jax.named_scope("lora"):  # as the engine's (profile_step.py tells them apart)
        for a, b in slices:
            a, b = _read_adapters(a, n, active, form), _read_adapters(b, n, active, form)
            xa = jnp.einsum("td,ndr->tnr" if by_input else "td,nrd->tnr", h, a)
            xa = xa * onehot[:, :, None].astype(xa.dtype)
            deltas.append(jnp.einsum("tnr,nro->to", xa, b))
        return jnp.concatenate(deltas, -1)


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
            "lora": {"qkv": _lora_slices(layer.self_attn.qkv_proj),
                     "o": _lora_slices(layer.self_attn.o_proj),
                     "gu": _lora_slices(layer.mlp.gate_up_proj),
                     "down": _lora_slices(layer.mlp.down_proj)},
        } for layer in layers],
        "dims": (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale),
        "a_by_input": getattr(layers[0].self_attn.qkv_proj, "a_by_input", False),
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


def build_anchor(model, contexts: list[int], page_size: int, lora_adapters: int = 0,
                 lora_form: str = "stacked"):
    """(step, pages, inputs): `step(pages, *inputs) -> (token ids, pages)`, jitted with
    the pages donated, for a decode step of len(contexts) sequences (LoRA: the module
    docstring)."""
    w = _weights(model)
    if not lora_adapters:
        for lw in w["layers"]:
            lw.pop("lora")
    elif not w["layers"][0]["lora"]["qkv"]:
        raise ValueError("lora_adapters needs an engine with LoRA enabled")
    nh, kvh, hd, scale = w.pop("dims")
    a_by_input = w.pop("a_by_input")
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
              jnp.asarray(slots, np.int32),
              jnp.asarray(np.arange(b) % max(lora_adapters, 1), np.int32),
              jnp.arange(max(lora_adapters, 1), dtype=jnp.int32))
    attention = _attention((kv_lens, page_indices, np.arange(b + 1, dtype=np.int32),
                            np.asarray([b], np.int32)))

    # Weights are arguments, as the engine's graphs take them: closed over, they became
    # 3 GB of constants baked into the executable.
    def step(w, pages, tok, pos, kv_lens, page_indices, cu_q_lens, num_seqs, slots,
             token_adapter, active):
        onehot = token_adapter[:, None] == jnp.arange(lora_adapters)

        def linear(h, lw, name):
            y = h @ lw[name]
            if lora_adapters:
                y = y + _lora_delta(h, lw["lora"][name], onehot, active, lora_form,
                                    a_by_input).astype(y.dtype)
            return y

        x = w["embed"][tok]
        new_pages = []
        for lw, pg in zip(w["layers"], pages):
            h = _rms(x, lw["ln1"])
            qkv = linear(h, lw, "qkv")
            q = _rope(qkv[:, :nh * hd].reshape(b, nh, hd), pos, w["inv_freq"])
            k = _rope(qkv[:, nh * hd:(nh + kvh) * hd].reshape(b, kvh, hd), pos, w["inv_freq"])
            v = qkv[:, (nh + kvh) * hd:].reshape(b, kvh, hd)
            kv = _pad_last(jnp.stack([k, v], 2).reshape(b, 2 * kvh, hd), hp)
            pg = pg.reshape(-1, 2 * kvh, hp).at[slots].set(kv).reshape(pg.shape)
            new_pages.append(pg)
            a = attention(_pad_last(q, hp), pg, kv_lens, page_indices, cu_q_lens, num_seqs,
                          sm_scale=scale)[..., :hd]
            x = x + linear(a.reshape(b, nh * hd), lw, "o")
            g, u = jnp.split(linear(_rms(x, lw["ln2"]), lw, "gu"), 2, -1)
            x = x + linear(jax.nn.silu(g) * u, lw, "down")
        logits = (_rms(x, w["norm"]) @ w["head"]).astype(jnp.float32)
        return jnp.argmax(logits, -1), new_pages

    step.__name__ = f"anchor_lora{lora_adapters}_{lora_form}" if lora_adapters else "anchor"
    jitted = jax.jit(step, donate_argnums=(1,))

    def run(pages, *args):
        return jitted(w, pages, *args)

    page_types = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages]  # donated later
    run.hlo_text = lambda: jitted.lower(w, page_types, *inputs).compile().as_text()
    return run, pages, inputs
