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

from vllm_tpu_lora.sampling_params import wrap_int64
from vllm_tpu_lora.torchax_compat import is_torchax_tensor

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
                given = [wrap_int64(int(v)) for v in given]
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


def sample(logits: torch.Tensor, t: SamplingTensors, max_logprobs: int = MAX_LOGPROBS,
           neg_token_ids: torch.Tensor | None = None) -> SamplerOutput:
    """Sample one token per row of logits[R, V] (see the module docstring).

    `max_logprobs` is static (each value is its own graph); everything else is data. Nothing
    sorts the [R, V] row: the top logprobs come from `topk`, the filters from per-row
    thresholds found by fixed-length bisection (see `_kept_mask`).
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if neg_token_ids is None:
        neg_token_ids = neg_token_ids_for(logits.shape[-1], logits.device)
    topk_logprobs, topk_ids = _top_logprobs(raw_logprobs, min(max_logprobs, logits.shape[-1]),
                                            neg_token_ids)
    is_greedy = t.temperature < _SAMPLING_EPS
    temperature = torch.where(is_greedy, torch.ones_like(t.temperature), t.temperature)
    scaled = logits / temperature[:, None]
    keep = _kept_mask(scaled, t)
    gumbel = _gumbel_noise(t.seeds, t.step, logits.shape[-1])
    random_ids = torch.argmax(scaled.masked_fill(~keep, float("-inf")) + gumbel, dim=-1)
    token_ids = torch.where(is_greedy, torch.argmax(logits, dim=-1), random_ids)
    return SamplerOutput(
        sampled_token_ids=token_ids.to(torch.int32),
        sampled_logprobs=raw_logprobs.gather(-1, token_ids[:, None])[:, 0],
        topk_logprobs=topk_logprobs,
        topk_token_ids=topk_ids.to(torch.int32),
    )


def sample_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` restricted to all-greedy rows without top logprobs: (token ids int32 [R],
    raw logprob of each [R]), the same ops on the same values as `sample`'s greedy rows, so
    the same tokens and logprobs. It skips what only random rows and top logprobs need
    (filters' bisection, noise, topk), ~10x cheaper per step on XLA CPU."""
    logits = logits.float()
    token_ids = torch.argmax(logits, dim=-1)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    return token_ids.to(torch.int32), raw_logprobs.gather(-1, token_ids[:, None])[:, 0]


_NEG_TOKEN_IDS: dict[tuple[int, torch.device], torch.Tensor] = {}


def neg_token_ids_for(vocab: int, device: torch.device) -> torch.Tensor:
    """-arange(vocab) as float32, uploaded once per (vocab, device) and then passed to every
    graph as device data: built in-graph, the iota broadcast over [R, V] cost XLA CPU ~8 ms
    per call at R=32, V=32000 (measured), as a graph input it costs nothing."""
    key = (vocab, device)
    if key not in _NEG_TOKEN_IDS:
        _NEG_TOKEN_IDS[key] = (-torch.arange(vocab, dtype=torch.float32)).to(device)
    return _NEG_TOKEN_IDS[key]


def _top_logprobs(raw: torch.Tensor, k: int,
                  neg_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row, descending, lowest id first among equal values.

    `topk`'s order among equal values is backend-defined (XLA CPU's is not stable), and
    equal logprobs are common with bf16 logits, so ties are put in a fixed order: ids tied
    with the k-th value come from a second topk over -id, the ones above it are reordered
    within [R, k]. The values themselves are those of `topk`, whatever its tie order.
    """
    vals, ids = torch.topk(raw, k, dim=-1)
    # torch_xla lowers topk to sort + slice, which XLA turns into a real TopK only while
    # every user of the sort is a slice from 0: vals[:, -1:] would fold into a slice from
    # k - 1 and leave a full [R, V] sort in the graph, so take the k-th value as a min.
    kth = vals.amin(dim=-1, keepdim=True)
    above = vals > kth  # a prefix of each row, shorter than k
    n_above = above.to(torch.int32).sum(-1, keepdim=True)
    # -id is exact in float32 for V <= 2**24, and distinct, so this topk has no ties.
    tie_score = torch.where(raw == kth, neg_token_ids, float("-inf"))
    tie_ids = torch.topk(tie_score, k, dim=-1).indices  # lowest ids tied with kth, ascending
    # Rank of each entry above kth among them by (value desc, id asc), then invert the rank.
    v_i, v_j, id_i, id_j = vals[:, :, None], vals[:, None, :], ids[:, :, None], ids[:, None, :]
    rank = ((v_j > v_i) | ((v_j == v_i) & (id_j < id_i))).to(torch.int32).sum(-1)
    slot = torch.arange(k, device=raw.device, dtype=torch.int32)
    at_slot = (rank[:, None, :] == slot[None, :, None]) & above[:, None, :]  # [R, slot, entry]
    ids_above = (at_slot.to(ids.dtype) * ids[:, None, :]).sum(-1)
    ids_tied = tie_ids.gather(-1, (slot[None, :] - n_above).clamp(min=0).to(torch.int64))
    return vals, torch.where(slot[None, :] < n_above, ids_above, ids_tied)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# One bisection step per bit of an int32 key: 32 steps end on a single key.
_BISECT_STEPS = 32
# top_p masses are summed as integers in units of 2**-30 (see `_kept_mask`).
_MASS_SCALE = 2.0**30


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys with the order of float32 values: key(a) < key(b) <=> a < b, and
    key(a) == key(b) <=> a == b (so -0.0 and +0.0 share key 0), for non-NaN a, b.

    Non-negative floats order like their bit patterns; a negative float is its magnitude's
    bit pattern negated (INT32_MIN - bits, which cannot overflow for bits < 0). Keys of
    real values never reach INT32_MIN or INT32_MAX (those are NaN bit patterns).
    """
    bits = _bitcast_to_int32(x)
    return torch.where(bits < 0, _INT32_MIN - bits, bits)


_XLA_BITCAST = None


def _bitcast_to_int32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 bit pattern. torch_xla 2.9 runs `Tensor.view(torch.int32)` as a CPU
    fallback (a graph break and two host transfers), so on XLA this is a registered
    BitcastConvert that stays inside the traced graph; torchax (the jax runtime) runs a
    dtype view as a reshape, so there it is JAX's bitcast."""
    if is_torchax_tensor(x):
        import jax
        from torchax import interop

        return interop.call_jax(lambda v: jax.lax.bitcast_convert_type(v, jax.numpy.int32), x)
    if x.device.type != "xla":
        return x.view(torch.int32)
    global _XLA_BITCAST
    if _XLA_BITCAST is None:
        import torch_xla.core.xla_builder as xb
        import torch_xla.core.xla_op_registry as xor

        _XLA_BITCAST = xor.register("sampler_bitcast_f32_s32", lambda v: v.bitcast(xb.Type.S32))
    return _XLA_BITCAST(x)


def _min_p_keep(scaled: torch.Tensor, row_max: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p_i >= min_p * p_max  <=>  exp(s_i - s_max) >= min_p: no softmax needed, and min_p = 0
    # keeps everything.
    return torch.exp(scaled - row_max) >= min_p[:, None]


def _kept_mask(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """[R, V] mask of the tokens each row keeps after min_p, top_k and top_p, in that order.

    Each filter keeps every token whose temperature-scaled logit is at least a per-row
    threshold. The thresholds are found without sorting, by bisection over the int32 order
    keys of the float32 values: `_BISECT_STEPS` unrolled compare-and-reduce passes per filter,
    a static graph whose search always ends on a single key, so no precision is lost there.

      - min_p: elementwise, the float32 test exp(s_i - s_max) >= min_p.
      - top_k: the threshold is the largest key t with #{key >= t} >= k, i.e. exactly the
        k-th largest value (counts are exact integers); like vLLM, every token tied with the
        k-th value is kept. k <= 0 or k >= V disables it.
      - top_p: on the distribution q renormalised over the tokens min_p and top_k kept, a
        token is kept iff the mass of the tokens with a strictly larger value is < top_p
        (the smallest descending prefix that reaches top_p; a tie group that straddles the
        boundary is kept whole, as the sort-based version did). The threshold is the smallest
        key t with mass(key > t) < top_p. Masses are summed in fixed point, Q_i =
        round(q_i * 2**30) as int32: every sum is exact in any reduction order (the same on
        every backend for the same q, and monotone in t as the bisection needs), stays far
        below 2**31 (sum Q is 2**30 plus rounding), and is compared exactly with
        ceil(top_p * 2**30) (scaling by 2**30 is exact in float32). The only error against
        the float32 q is that rounding, |sum Q * 2**-30 - sum q| <= n * 2**-31 over the n
        tokens summed: <= 1.5e-5 at V = 32000 in the worst case, ~sqrt(n) * 2**-31 (~1e-7)
        typically, on par with the float32 softmax's own rounding, and better than the float32
        cumsum it replaces (worst case ~V * 2**-24). Dyadic masses down to 2**-30 are exact,
        so a boundary hit exactly is decided exactly. top_p >= 1 disables it.
      - the row's maximum always survives (e.g. top_p = 0 or min_p > 1).
    """
    keys = _order_keys(scaled)
    row_max = scaled.amax(dim=-1, keepdim=True)
    vocab = scaled.shape[-1]
    keep = _min_p_keep(scaled, row_max, t.min_p)

    # top_k: lo is the largest key known to satisfy #{key >= lo} >= k. Step i tries
    # lo + 2**(31 - i), so 32 steps decide every bit of the 2**32-key range (int32 only:
    # the first probe, INT32_MIN + 2**31, is 0, and no later sum overflows).
    k = t.top_k.to(torch.int32)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    lo = torch.full_like(k, _INT32_MIN)
    for i in range(_BISECT_STEPS):
        mid = torch.zeros_like(lo) if i == 0 else lo + 2 ** (31 - i)
        count = (keys >= mid[:, None]).to(torch.int32).sum(-1, dtype=torch.int32)
        lo = torch.where(count >= k, mid, lo)
    keep = keep & (keys >= lo[:, None])

    # top_p: hi is the smallest key known to satisfy mass(key > hi) < top_p (INT32_MAX is
    # above every real key: if nothing passes, only the row max is kept). Step i tries
    # hi - 2**(31 - i), the first probe being INT32_MAX - 2**31 = -1.
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    quanta = torch.round(probs * _MASS_SCALE).to(torch.int32)
    top_p = t.top_p.float()
    # For an integer mass, mass < x <=> mass < ceil(x).
    # ceil(x) as -floor(-x): torchax 0.0.13's ceil casts with a deprecated array-as-dtype.
    budget = (-torch.floor(-top_p.clamp(0.0, 1.0) * _MASS_SCALE)).to(torch.int32)
    hi = torch.full_like(k, _INT32_MAX)
    for i in range(_BISECT_STEPS):
        mid = torch.full_like(hi, -1) if i == 0 else hi - 2 ** (31 - i)
        mass_above = torch.where(keys > mid[:, None], quanta, 0).sum(-1, dtype=torch.int32)
        hi = torch.where(mass_above < budget, mid, hi)
    keep = keep & ((keys >= hi[:, None]) | (top_p >= 1.0)[:, None])
    return keep | (scaled == row_max)


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
