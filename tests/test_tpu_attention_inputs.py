"""The TPU attention path's inputs, checked on CPU: what the engine hands torch_xla's
ragged-paged-attention kernel (the combined K/V cache layout `write_kv` fills, and the
per-sequence rows `prepare_step` builds: kv lengths, block tables, cumulative query
lengths, sequence count) must mean, under the kernel's contract, the attention the CPU
path computes from its own inputs.

The kernel itself only runs on a TPU (tests/test_tpu.py); its contract here is torch_xla's
own non-kernel reference of it (`use_kernel=False`), run eagerly on CPU tensors, against
`paged_attention_reference` over the split cache. A step mixes chunked prefills that start
mid-sequence, a fresh prompt and decodes, in shuffled blocks, with and without a sliding
window and soft cap.
"""

import numpy as np
import pytest
import torch

from vllm_tpu_lora import SamplingParams
from vllm_tpu_lora.engine.block_manager import NULL_BLOCK, blocks_needed
from vllm_tpu_lora.engine.scheduler import ScheduledSeq
from vllm_tpu_lora.engine.sequence import Sequence
from vllm_tpu_lora.layers import attention
from vllm_tpu_lora.runner import buckets
from vllm_tpu_lora.runner.input_batch import kv_window_blocks, prepare_step
from vllm_tpu_lora.runner.model_runner import _META_FIELDS

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
MAX_SEQS, MAX_BLOCKS, NUM_BLOCKS = 8, 6, 40
# (tokens already in the cache, tokens computed this step, tokens the sequence has)
STEP = [(0, 9, 9), (5, 1, 6), (10, 3, 20), (0, 1, 1), (17, 1, 18), (4, 4, 8)]


@pytest.fixture
def ragged_reference(monkeypatch):
    """Route paged_attention_tpu's kernel call to torch_xla's reference of the kernel."""
    from torch_xla.experimental import custom_kernel

    def reference(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw):
        out = custom_kernel._ragged_paged_attention_nonkernel(
            q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, None, None,
            mask_value=custom_kernel.DEFAULT_MASK_VALUE, **kw)
        # The reference returns the real tokens' rows only; the kernel all of q's rows
        # (padding rows are garbage there: zeros here).
        return torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])

    monkeypatch.setattr(custom_kernel, "ragged_paged_attention", reference)


def _step(rng):
    free = rng.permutation([b for b in range(NUM_BLOCKS) if b != NULL_BLOCK])
    scheduled, used = [], 0
    for i, (done, n, total) in enumerate(STEP):
        seq = Sequence(f"r{i}", 0, rng.integers(3, 100, size=total).tolist(),
                       SamplingParams(temperature=0.0), seed=i)
        need = blocks_needed(done + n, BLOCK)
        seq.block_ids = free[used:used + need].tolist()
        used += need
        scheduled.append(ScheduledSeq(seq, done, n))
    return scheduled


def _write_all_kv(scheduled, rng, caches):
    """Every position up to the end of this step gets its K/V, in both cache layouts."""
    for s in scheduled:
        end = s.start + s.num_tokens
        pos = np.arange(end)
        table = np.asarray(s.seq.block_ids)
        slots = torch.from_numpy(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        k, v = (torch.from_numpy(rng.standard_normal((end, KV_HEADS, DIM)).astype(np.float32))
                for _ in range(2))
        for cache in caches:
            attention.write_kv(cache, k, v, slots)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 3.0), (7, 2.0)])
def test_tpu_kernel_inputs_mean_the_cpu_attention(ragged_reference, monkeypatch, window,
                                                   soft_cap):
    rng = np.random.default_rng(0 if window is None else window)
    scheduled = _step(rng)
    n_tok = sum(s.num_tokens for s in scheduled)
    t_b = buckets.pick([16, 32], n_tok)
    assert t_b > n_tok  # padding rows too
    a = prepare_step(scheduled, t_b, MAX_SEQS, MAX_BLOCKS, BLOCK, {}, None, MAX_SEQS,
                     kv_window_blocks(scheduled, BLOCK))
    slots_total = NUM_BLOCKS * BLOCK
    split = tuple(torch.zeros(slots_total, KV_HEADS, DIM) for _ in range(2))
    with monkeypatch.context() as m:  # the layout the engine allocates on a TPU
        m.setattr(attention.platform, "is_tpu", lambda: True)
        (shape,) = attention.kv_cache_shapes(slots_total, KV_HEADS, DIM)
    # K and V heads interleaved, head_dim zero-padded to the kernel's 128 lanes
    assert shape == (slots_total, 2 * KV_HEADS, attention.TPU_HEAD_DIM_ALIGN)
    combined = (torch.zeros(shape),)
    _write_all_kv(scheduled, rng, [split, combined])
    meta = attention.AttentionMetadata(**{f: torch.from_numpy(getattr(a, f))
                                          for f in _META_FIELDS})  # what the runner passes
    q = torch.from_numpy(rng.standard_normal((t_b, HEADS, DIM)).astype(np.float32))
    scale = DIM ** -0.5

    cpu = attention.paged_attention_reference(q, split, meta, BLOCK, scale, window, soft_cap)
    tpu = attention.paged_attention_tpu(q, combined, meta, BLOCK, scale, window, soft_cap)

    assert tpu.shape[1] == cpu.shape[1] == HEADS * DIM
    torch.testing.assert_close(tpu[:n_tok], cpu[:n_tok], atol=1e-5, rtol=1e-5)
    # The check can fail: a sequence's kv length off by one changes its rows.
    meta.seq_kv_lens[2] -= 1
    off = attention.paged_attention_tpu(q, combined, meta, BLOCK, scale, window, soft_cap)
    rows = slice(int(a.cu_q_lens[2]), int(a.cu_q_lens[3]))
    assert not torch.allclose(off[rows], cpu[rows], atol=1e-3)


@pytest.mark.parametrize("which", ["warm-up (all padding)", "mixed step"])
def test_every_step_keeps_the_kernels_prefetch_chain(which):
    """The TPU kernel copies each sequence's next KV page before computing the current
    one, starting with sequence 0 before its loop: every sequence it is told about must
    consume its copies (at least one KV row, no more query rows than KV rows, its pages in
    its table), and there must be at least one, or a copy is left in flight and the chip
    halts. The warm-up's all-padding step once had num_seqs 0 and halted the v5e."""
    scheduled = [] if which.startswith("warm") else _step(np.random.default_rng(1))
    n_tok = sum(s.num_tokens for s in scheduled)
    a = prepare_step(scheduled, 32, MAX_SEQS, MAX_BLOCKS, BLOCK, {}, None, MAX_SEQS,
                     kv_window_blocks(scheduled, BLOCK))
    n = int(a.num_seqs[0])
    assert n == max(1, len(scheduled)) and a.num_seqs_real == len(scheduled)
    q_lens = np.diff(a.cu_q_lens[:n + 1])
    kv_lens = a.seq_kv_lens[:n]
    assert (kv_lens >= 1).all() and (q_lens >= 1).all() and (q_lens <= kv_lens).all()
    assert a.cu_q_lens[n] <= 32 and (np.diff(a.cu_q_lens) >= 0).all()
    assert (-(-kv_lens // BLOCK) <= a.seq_block_tables.shape[1]).all()
    if scheduled:
        assert a.cu_q_lens[n] == n_tok
    else:  # the phantom sequence reads the null block only
        assert (a.seq_block_tables == NULL_BLOCK).all()
