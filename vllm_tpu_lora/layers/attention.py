"""Static-shape ragged paged attention.

KV cache layout per layer: `[num_blocks * block_size, 2 * num_kv_heads, head_dim]` with
K and V heads interleaved (k0, v0, k1, v1, ...). This is the page layout of torch_xla's
`ragged_paged_attention` TPU kernel viewed flat, so the same cache serves both paths.

Every step, each token first writes its own K/V into its slot, then attends to the
first `kv_len` slots of its sequence through its sequence's block table. All shapes are
fixed by the (token bucket, request bucket) of the step; padding tokens write to the
reserved block 0 and read one slot of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_tpu_lora import platform


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: KV write slot of each token
    token_block_tables: torch.Tensor  # [T, MB] int64: block table of each token's sequence
    token_kv_lens: torch.Tensor  # [T] int32: keys each token attends to (position + 1)
    # Per-sequence form used by the TPU kernel: [R], [R, MB], [R + 1], [1].
    seq_kv_lens: torch.Tensor
    seq_block_tables: torch.Tensor
    cu_q_lens: torch.Tensor
    num_seqs: torch.Tensor


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Scatter this step's K/V [T, Hkv, D] into their slots of the flat cache, in place."""
    t, hkv, d = k.shape
    kv = torch.stack((k, v), dim=2).reshape(t, 2 * hkv, d).to(kv_cache.dtype)
    kv_cache.index_copy_(0, slots, kv)


def paged_attention_reference(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [NB*BS, 2*Hkv, D]
    meta: AttentionMetadata,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Gather-based attention in plain torch ops: what XLA compiles on CPU."""
    t, h, d = q.shape
    hkv = kv_cache.shape[1] // 2
    group = h // hkv
    pages = kv_cache.view(-1, block_size, 2 * hkv, d)
    gathered = pages[meta.token_block_tables]  # [T, MB, BS, 2Hkv, D]
    ctx = gathered.shape[1] * block_size
    gathered = gathered.reshape(t, ctx, hkv, 2, d)
    keys, values = gathered[..., 0, :], gathered[..., 1, :]  # [T, L, Hkv, D]
    qg = q.reshape(t, hkv, group, d).to(torch.float32)
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, keys.to(torch.float32)) * scale
    visible = torch.arange(ctx, device=q.device)[None, :] < meta.token_kv_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgl,tlkd->tkgd", probs, values.to(torch.float32))
    return out.reshape(t, h * d).to(q.dtype)


def paged_attention_tpu(q, kv_cache, meta: AttentionMetadata, block_size: int, scale: float):
    """torch_xla's ragged paged attention Pallas kernel (TPU only)."""
    from torch_xla.experimental.custom_kernel import ragged_paged_attention

    t, h, d = q.shape
    pages = kv_cache.view(-1, block_size, kv_cache.shape[1], d)
    out = ragged_paged_attention(
        q,
        pages,
        meta.seq_kv_lens,
        meta.seq_block_tables.to(torch.int32),
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=scale,
    )
    return out.reshape(t, h * d)


def attention_backend():
    """Chosen by device, here and only here."""
    return paged_attention_tpu if platform.is_tpu() else paged_attention_reference
