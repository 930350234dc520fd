"""Token sampler that runs inside one fixed-shape XLA graph.

Semantics: for logits[R, V] and per-row parameters, return one token per row.
  - temperature < _SAMPLING_EPS: greedy, argmax of the raw logits (lowest id on ties).
  - otherwise, vLLM V1's order: logits / temperature -> min_p -> top_k -> top_p, then an
    exact draw from the renormalised distribution by the Gumbel-max trick.
  - logprobs are those of the raw model distribution log_softmax(logits) (vLLM V1's default
    ``raw_logprobs`` mode), for the sampled token and for the top ``max_logprobs`` tokens.

Every parameter is a device tensor, never a Python value, and nothing branches on tensor
values, so one compiled graph per (R, V) serves every mix of greedy/random rows and filter
settings. Randomness is a counter-based hash of (seed, step, token id) rather than a stateful
RNG, so a request's draw does not depend on its row, its neighbours or the batch size, and a
seeded request is reproducible across runs, restarts and preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_SAMPLING_EPS = 1e-5  # vLLM: temperatures below this are greedy

_M32 = 0xFFFFFFFF
# Multiplicative constants of murmur3's 32-bit finaliser and the golden-ratio Weyl step.
_C1, _C2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9
# Distinct salts so that seed, step and token id cannot cancel each other out.
_SALT_SEED_HI, _SALT_STEP_LO, _SALT_STEP_HI, _SALT_TOKEN = (
    0x68E31DA4, 0xB5297A4D, 0x1B56C4E9, 0x7FEB352D)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, all shaped [R] and on the logits' device.

    Padding rows should take the FIELDS padding values (greedy, no filters), which
    `from_numpy` fills in: rows never interact, so padding cannot disturb real rows.
    """

    temperature: torch.Tensor  # float32; < 1e-5 => greedy
    top_k: torch.Tensor  # int32; <= 0 or >= V => disabled
    top_p: torch.Tensor  # float32; >= 1.0 => disabled
    min_p: torch.Tensor  # float32; 0.0 => disabled
    seeds: torch.Tensor  # int64; any 64-bit value
    step: torch.Tensor  # int64; tokens generated so far in this sequence

    # (numpy dtype, value for padding rows) per field, in declaration order.
    FIELDS = {
        "temperature": (np.float32, 0.0),
        "top_k": (np.int32, 0),
        "top_p": (np.float32, 1.0),
        "min_p": (np.float32, 0.0),
        "seeds": (np.int64, 0),
        "step": (np.int64, 0),
    }

    @classmethod
    def from_numpy(cls, num_rows: int, device: torch.device | str | None = None,
                   **values) -> SamplingTensors:
        """Build from host arrays/lists of length <= num_rows, padding to num_rows.

        Host-side numpy keeps input preparation off the device; one transfer per field.
        """
        unknown = set(values) - set(cls.FIELDS)
        if unknown:
            raise TypeError(f"unknown sampling fields: {sorted(unknown)}")
        out = {}
        for name, (dtype, pad) in cls.FIELDS.items():
            arr = np.full(num_rows, pad, dtype=dtype)
            given = values.get(name, [])
            if name == "seeds":  # Python seeds may be any int: keep them modulo 2**64
                given = np.array([int(v) & (2**64 - 1) for v in given], np.uint64).view(dtype)
            given = np.asarray(given, dtype=dtype)
            if given.shape[0] > num_rows:
                raise ValueError(f"{name} has {given.shape[0]} rows, more than {num_rows}")
            arr[: given.shape[0]] = given
            out[name] = torch.from_numpy(arr).to(device)
        return cls(**out)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int32 [R]
    sampled_logprobs: torch.Tensor  # float32 [R], raw log_softmax at the sampled token
    topk_logprobs: torch.Tensor  # float32 [R, K], K = min(max_logprobs, V), descending
    topk_token_ids: torch.Tensor  # int32 [R, K]


def sample(logits: torch.Tensor, t: SamplingTensors, max_logprobs: int = MAX_LOGPROBS, *,
           top_k_top_p: bool = True) -> SamplerOutput:
    """Sample one token per row of logits[R, V] (see the module docstring).

    `max_logprobs` and `top_k_top_p` are static: each value is its own graph. With
    top_k_top_p=False the [R, V] sort, by far the sampler's largest cost, is skipped and
    t.top_k / t.top_p are IGNORED; choose it only for batches where every row disables both.
    """
    logits = logits.float()
    num_logprobs = min(max_logprobs, logits.shape[-1])
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    is_greedy = t.temperature < _SAMPLING_EPS
    temperature = torch.where(is_greedy, torch.ones_like(t.temperature), t.temperature)
    scaled = logits / temperature[:, None]
    if top_k_top_p:
        # One descending sort serves the filters and the top logprobs (dividing by a
        # positive temperature keeps the order), so no separate topk pass is needed.
        sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True)
        topk_ids = sorted_ids[:, :num_logprobs]
        cutoff = _filter_cutoff(sorted_logits / temperature[:, None], t)
        drop = scaled < cutoff[:, None]
    else:
        topk_ids = torch.topk(logits, num_logprobs, dim=-1).indices
        drop = ~_min_p_keep(scaled, scaled.amax(dim=-1, keepdim=True), t.min_p)
    gumbel = _gumbel_noise(t.seeds, t.step, logits.shape[-1])
    random_ids = torch.argmax(scaled.masked_fill(drop, float("-inf")) + gumbel, dim=-1)
    token_ids = torch.where(is_greedy, torch.argmax(logits, dim=-1), random_ids)
    return SamplerOutput(
        sampled_token_ids=token_ids.to(torch.int32),
        sampled_logprobs=raw_logprobs.gather(-1, token_ids[:, None])[:, 0],
        topk_logprobs=raw_logprobs.gather(-1, topk_ids),
        topk_token_ids=topk_ids.to(torch.int32),
    )


def _min_p_keep(scaled: torch.Tensor, row_max: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p_i >= min_p * p_max  <=>  exp(s_i - s_max) >= min_p: no softmax needed, and min_p = 0
    # keeps everything. Both sample() paths use this same expression so they agree exactly.
    return torch.exp(scaled - row_max) >= min_p[:, None]


def _filter_cutoff(sorted_scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Smallest temperature-scaled logit each row keeps after min_p, top_k and top_p.

    Each filter keeps a prefix of the descending order, so their composition is a prefix
    too and one value per row describes it; comparing against that value in vocab order
    avoids scattering a [R, V] mask back through the sort permutation.
    """
    vocab = sorted_scaled.shape[-1]
    positions = torch.arange(vocab, device=sorted_scaled.device)
    keep = _min_p_keep(sorted_scaled, sorted_scaled[:, :1], t.min_p)
    # top_k: like vLLM, keep every token tied with the k-th largest value.
    k = t.top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    kth_value = sorted_scaled.gather(-1, (k - 1)[:, None])
    keep = keep & (sorted_scaled >= kth_value)
    # top_p on the distribution left by min_p and top_k: keep a token while the mass
    # strictly above it is < top_p (the smallest prefix reaching top_p). top_p >= 1 is
    # exempted explicitly because a float32 cumsum can reach 1.0 before the tail ends.
    probs = torch.softmax(sorted_scaled.masked_fill(~keep, float("-inf")), dim=-1)
    mass_above = torch.cumsum(probs, dim=-1) - probs
    top_p = t.top_p[:, None]
    keep = keep & ((mass_above < top_p) | (top_p >= 1.0))
    keep = keep | (positions == 0)  # the top token always survives (e.g. top_p = 0)
    num_kept = keep.to(torch.int64).sum(dim=-1)
    return sorted_scaled.gather(-1, (num_kept - 1)[:, None])[:, 0]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, without signed int64 overflow.

    Splitting c into 16-bit halves keeps every product below 2**48, so the result is
    well defined on any backend (eager ATen, XLA CPU, TPU's emulated s64).
    """
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 values in [0, 2**32): a bijective avalanche mix.

    Inputs are non-negative, so `>>` (arithmetic in torch) acts as a logical shift.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Hash each row's 64-bit seed and step into a 32-bit key, shape [R] (cheap)."""
    seeds, step = seeds.to(torch.int64), step.to(torch.int64)
    key = _fmix32(seeds & _M32)
    key = _fmix32(key ^ ((seeds >> 32) & _M32) ^ _SALT_SEED_HI)
    key = _fmix32(key ^ (step & _M32) ^ _SALT_STEP_LO)
    return _fmix32(key ^ ((step >> 32) & _M32) ^ _SALT_STEP_HI)


def random_bits(seeds: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32 pseudo-random bits per (row, token id) as int64 [R, V], a pure function of
    (seed, step, token id). The token hash is [V] only; the [R, V] work is one mix."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    token_hash = _fmix32(_mul32(token_ids, _GOLDEN) ^ _SALT_TOKEN)
    return _fmix32(_row_keys(seeds, step)[:, None] ^ token_hash[None, :])


def _gumbel_noise(seeds: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [R, V]; argmax(logits + noise) draws from softmax(logits)."""
    return gumbel_from_bits(random_bits(seeds, step, vocab_size))


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Map 32-bit integers to finite standard Gumbel samples."""
    # 23 bits at the centres of 2**23 bins: u lies strictly inside (0, 1) and is exact in
    # float32 (24 bits would round 1 - 2**-25 up to 1.0 and give an infinite sample).
    u = ((bits >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(u))
