"""Static-shape ragged paged attention, and the KV cache layout, chosen by device here.

KV cache per layer, a tuple of flat slot-major tensors:
- CPU: `(k [num_blocks * block_size, num_kv_heads, head_dim], v [same])`. Separate K and
  V keep the gathered pages contiguous; with K/V interleaved XLA's CPU backend spent 5x
  longer on the strided copies than on the attention itself.
- TPU: `(kv [num_blocks * block_size, 2 * num_kv_heads, head_dim_padded],)` with K and V
  heads interleaved (k0, v0, k1, v1, ...): the page layout of the `ragged_paged_attention`
  kernel, viewed flat. head_dim is zero-padded to the kernel's 128 lanes (JAX's kernel
  asserts it; Llama-3.2-1B's 64 would not pass): zero columns add nothing to q.k, and
  the output's padding columns are cut off.

Every step, each token first writes its own K/V into its slot, then attends to the
first `kv_len` slots of its sequence through its sequence's block table. On CPU the
queries are grouped in blocks of one sequence's tokens (see runner/input_batch.py), so
KV pages are gathered once per query block, not once per token. All shapes are fixed by
the token bucket of the step; padding tokens write to the reserved block 0 and read one
slot of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_tpu_lora import platform
from vllm_tpu_lora.torchax_compat import is_torchax_tensor

TPU_HEAD_DIM_ALIGN = 128  # the ragged kernel's lane width


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: KV write slot of each token
    # Query blocks (CPU path): [NQB, Q] token rows, [NQB, MB] block tables, [NQB, Q] kv
    # lengths (position + 1), and [T] the row of each token in the [NQB * Q] output.
    q_block_token_idx: torch.Tensor
    q_block_tables: torch.Tensor
    q_block_kv_lens: torch.Tensor
    token_out_index: torch.Tensor
    # Per-sequence form used by the TPU kernel: [R], [R, MB], [R + 1], [1].
    seq_kv_lens: torch.Tensor
    seq_block_tables: torch.Tensor
    cu_q_lens: torch.Tensor
    num_seqs: torch.Tensor


def kv_cache_shapes(num_slots: int, num_kv_heads: int, head_dim: int) -> list[tuple]:
    if platform.is_tpu():
        padded = -(-head_dim // TPU_HEAD_DIM_ALIGN) * TPU_HEAD_DIM_ALIGN
        return [(num_slots, 2 * num_kv_heads, padded)]
    return [(num_slots, num_kv_heads, head_dim)] * 2


def write_kv(kv_cache: tuple, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's K/V [T, Hkv, D] into their slots of the cache, in place."""
    if len(kv_cache) == 2:
        kv_cache[0].index_copy_(0, slots, k.to(kv_cache[0].dtype))
        kv_cache[1].index_copy_(0, slots, v.to(kv_cache[1].dtype))
        return
    t, hkv, d = k.shape
    kv = torch.stack((k, v), dim=2).reshape(t, 2 * hkv, d).to(kv_cache[0].dtype)
    if kv_cache[0].shape[-1] > d:  # head_dim padded to the kernel's lanes
        kv = F.pad(kv, (0, kv_cache[0].shape[-1] - d))
    kv_cache[0].index_copy_(0, slots, kv)


def paged_attention_reference(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: tuple,  # (k, v), each [NB*BS, Hkv, D]
    meta: AttentionMetadata,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Gather-based attention in plain torch ops: what XLA compiles on CPU.
    sliding_window W: a query at position p sees keys p-W+1..p (HF's and the TPU kernel's
    rule); soft_cap c: scores become c * tanh(scores / c) before masking (Gemma2)."""
    t, h, d = q.shape
    hkv = kv_cache[0].shape[1]
    group = h // hkv
    nqb, qb = meta.q_block_token_idx.shape
    ctx = meta.q_block_tables.shape[1] * block_size
    keys, values = (c.view(-1, block_size, hkv, d)[meta.q_block_tables].reshape(nqb, ctx, hkv, d)
                    for c in kv_cache)  # [NQB, L, Hkv, D]
    qg = q[meta.q_block_token_idx].reshape(nqb, qb, hkv, group, d).to(torch.float32)
    scores = torch.einsum("bqkgd,blkd->bkgql", qg, keys.to(torch.float32)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    key_pos = torch.arange(ctx, device=q.device)
    visible = key_pos < meta.q_block_kv_lens[..., None]  # [NQB, Q, L]
    if sliding_window is not None:
        visible = visible & (key_pos >= meta.q_block_kv_lens[..., None] - sliding_window)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgql,blkd->bqkgd", probs, values.to(torch.float32))
    out = out.reshape(nqb * qb, h * d)[meta.token_out_index]
    return out.to(q.dtype)


def paged_attention_tpu(q, kv_cache, meta: AttentionMetadata, block_size: int, scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None):
    """The ragged paged attention Pallas kernel (TPU only): torch_xla's on the torch_xla
    runtime, JAX's own (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the
    same kernel, inputs and page layout) inside the jitted step on the jax runtime. It
    applies the sliding window and soft cap itself, with the reference's rules."""
    t, h, d = q.shape
    padded = kv_cache[0].shape[-1]
    pages = kv_cache[0].view(-1, block_size, kv_cache[0].shape[1], padded)
    if padded > d:
        q = F.pad(q, (0, padded - d))
    if is_torchax_tensor(q):
        out = _jax_ragged_attention(q, pages, meta, scale, sliding_window, soft_cap)
        return out[..., :d].reshape(t, h * d)
    from torch_xla.experimental.custom_kernel import ragged_paged_attention

    out = ragged_paged_attention(
        q,
        pages,
        meta.seq_kv_lens,
        meta.seq_block_tables.to(torch.int32),
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return out[..., :d].reshape(t, h * d)


def _jax_ragged_attention(q, pages, meta: AttentionMetadata, scale: float,
                          sliding_window: int | None, soft_cap: float | None):
    import functools

    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    from torchax import interop

    from vllm_tpu_lora.ops.pallas_kernels import traced_without_x64

    kernel = traced_without_x64(functools.partial(
        ragged_paged_attention, sm_scale=scale, sliding_window=sliding_window,
        soft_cap=soft_cap))
    return interop.call_jax(kernel, q, pages, meta.seq_kv_lens.to(torch.int32),
                            meta.seq_block_tables.to(torch.int32), meta.cu_q_lens.to(torch.int32),
                            meta.num_seqs.to(torch.int32))


def attention_backend():
    """Chosen by device, here and only here."""
    return paged_attention_tpu if platform.is_tpu() else paged_attention_reference
