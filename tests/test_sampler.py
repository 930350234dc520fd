"""Tests for the in-graph sampler: exactness of greedy/logprobs, sampling statistics against an
independent float64 numpy reference, per-request determinism, and one graph for all params."""

import os
from dataclasses import fields

os.environ.setdefault("PJRT_DEVICE", "CPU")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_tpu_lora.layers.sampler import (  # noqa: E402
    MAX_LOGPROBS,
    SamplerOutput,
    SamplingTensors,
    _kept_mask,
    gumbel_from_bits,
    random_bits,
    sample,
)

# A known distribution over V=8 with gaps wide enough that no filter sits on a boundary.
PROBS = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])


def reference_keep(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM V1 filters in float64 on the float32 temperature-scaled logits the sampler sees:
    min_p -> top_k -> top_p. Ties: top_k keeps every token tied with the k-th value, and a
    tie group straddling the top_p boundary is kept whole (a token stays iff the mass of the
    strictly larger values is < top_p). The row maximum always stays."""
    x32 = np.asarray(logits, dtype=np.float32)
    if temperature < 1e-5:
        return x32 == x32.max()
    x = (x32 / np.float32(temperature)).astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if 0 < top_k < len(x):
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][top_k - 1]
        keep &= x >= kth
    if top_p < 1.0:
        q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
        order = np.argsort(-x, kind="stable")
        mass_strictly_above = _mass_strictly_above(x[order], q[order])
        keep[order] &= mass_strictly_above < top_p
    return keep | (x == x.max())


def _mass_strictly_above(x_desc, q_desc):
    """For values sorted descending: the total of q over values strictly larger than each."""
    inclusive = np.cumsum(q_desc)
    first_of_group = np.r_[True, x_desc[1:] != x_desc[:-1]]
    group_start = np.maximum.accumulate(np.where(first_of_group, np.arange(len(x_desc)), 0))
    return np.where(group_start > 0, inclusive[group_start - 1], 0.0)


def reference_distribution(logits, temperature=1.0, **filters):
    """The renormalised distribution the sampler draws from (one-hot argmax when greedy)."""
    x = np.asarray(logits, dtype=np.float64)
    if temperature < 1e-5:
        return np.eye(len(x))[np.argmax(x)]
    x = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    p = np.exp(x.astype(np.float64) - x.max())
    out = np.where(reference_keep(logits, temperature, **filters), p, 0.0)
    return out / out.sum()


def test_reference_supports_by_hand():
    # Guards the reference itself, from arithmetic done by hand on PROBS.
    logits = np.log(PROBS)
    support = lambda **kw: set(np.flatnonzero(reference_distribution(logits, **kw)))  # noqa: E731
    assert support(top_k=3) == {0, 1, 2}
    assert support(top_p=0.6) == {0, 1, 2}  # 0.30 + 0.20 < 0.6 <= 0.65
    assert support(min_p=0.2) == set(range(6))  # 0.07 >= 0.2 * 0.30 > 0.04
    assert support(top_k=2, top_p=0.55) == {0}  # top_p sees the top_k-renormalised 0.6/0.4
    assert support(top_p=0.0) == {0}
    np.testing.assert_allclose(reference_distribution(logits, temperature=0.5),
                               PROBS**2 / (PROBS**2).sum())
    # Ties: top_k keeps the whole group at the k-th value; top_p keeps a group whose
    # strictly-larger mass is < top_p whole, and drops it whole otherwise.
    tied = np.log([0.3, 0.2, 0.2, 0.2, 0.1])
    assert set(np.flatnonzero(reference_keep(tied, top_k=2))) == {0, 1, 2, 3}
    assert set(np.flatnonzero(reference_keep(tied, top_p=0.35))) == {0, 1, 2, 3}
    assert set(np.flatnonzero(reference_keep(tied, top_p=0.29))) == {0}
    assert set(np.flatnonzero(reference_keep(np.zeros(6), top_p=0.0))) == set(range(6))


STAT_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.7, top_k=5, top_p=0.8),
    dict(temperature=1.5, min_p=0.3, top_p=0.9),
    dict(temperature=2.0, top_k=6, min_p=0.5),
    dict(temperature=1.0, top_k=2, top_p=0.55),
    dict(temperature=1.0, top_p=0.0),
    dict(temperature=0.0, top_k=3, top_p=0.5),
]


def _params_for_rows(cases, rows_per_case):
    names = ("temperature", "top_k", "top_p", "min_p")
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    return {n: np.repeat([c.get(n, defaults[n]) for c in cases], rows_per_case) for n in names}


def _assert_matches(counts, expected, n):
    """Per-token 5-sigma binomial bound plus a chi-square bound on the filtered support.

    Seeds are fixed, so the check is deterministic; with ~10 tokens × 11 cases a 5-sigma
    bound has a false-alarm chance of ~1e-5 for a correct sampler, while a wrong filter
    or order moves some frequency by >= 0.02, i.e. > 5 sigma at n = 8192 (sigma <= 0.0055).
    """
    freq = counts / n
    assert np.all(counts[expected == 0] == 0), (freq, expected)
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-9), (freq, expected)
    support = expected > 0
    if support.sum() > 1:
        chi2 = (((counts - n * expected) ** 2)[support] / (n * expected[support])).sum()
        df = support.sum() - 1
        assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df)  # ~6 sigma of the chi2 law


def test_sampling_statistics_all_params_in_one_batch():
    n = 8192
    rng = np.random.default_rng(0)
    rows = n * len(STAT_CASES)
    params = _params_for_rows(STAT_CASES, n)
    # Full 64-bit seeds (negative ones too) and arbitrary steps: every row is an independent draw.
    seeds = rng.integers(-(2**63), 2**63 - 1, size=rows, dtype=np.int64)
    steps = rng.integers(0, 10_000, size=rows)
    t = SamplingTensors.from_numpy(rows, seeds=seeds, step=steps, **params)
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32).repeat(rows, 1)
    tokens = sample(logits, t).sampled_token_ids.numpy().reshape(len(STAT_CASES), n)
    for case, case_tokens in zip(STAT_CASES, tokens, strict=True):
        expected = reference_distribution(np.log(PROBS), **case)
        counts = np.bincount(case_tokens, minlength=len(PROBS))
        _assert_matches(counts, expected, n)


def test_one_request_over_many_steps_follows_distribution():
    # A single seeded request: successive steps must also be independent draws.
    n = 16384
    t = SamplingTensors.from_numpy(n, temperature=np.full(n, 0.8), top_k=np.full(n, 7),
                                   seeds=np.full(n, 1234), step=np.arange(n))
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32).repeat(n, 1)
    counts = np.bincount(sample(logits, t).sampled_token_ids.numpy(), minlength=len(PROBS))
    expected = reference_distribution(np.log(PROBS), temperature=0.8, top_k=7)
    _assert_matches(counts, expected, n)


def _random_batch(rows, vocab, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = _random_batch(6, 300)
    logits[5, :] = 0.0
    logits[5, [7, 42, 299]] = 4.0
    # Filters and a sub-epsilon temperature must not change a greedy pick.
    t = SamplingTensors.from_numpy(8, temperature=[0, 0, 0, 1e-6, 0, 0], top_k=[1, 5, 0, 0, 2, 0],
                                   top_p=[1, 0.1, 0.5, 1, 1, 0.3], min_p=[0, 0, 0.9, 0, 0.5, 0])
    logits = torch.cat([logits, torch.zeros(2, 300)])
    out = sample(logits, t)
    assert out.sampled_token_ids.dtype == torch.int32
    assert torch.equal(out.sampled_token_ids[:6].long(), torch.argmax(logits[:6], dim=-1))
    assert out.sampled_token_ids[5].item() == 7


def _mixed_params(rows, seed=0):
    rng = np.random.default_rng(seed)
    return dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.3], rows),
                top_k=rng.choice([0, 1, 10, 50], rows), top_p=rng.choice([1.0, 0.9, 0.5], rows),
                min_p=rng.choice([0.0, 0.05], rows), seeds=rng.integers(0, 2**40, rows),
                step=rng.integers(0, 100, rows))


def test_logprobs_and_topk_match_torch():
    rows, vocab = 16, 1000
    logits = _random_batch(rows, vocab, seed=1)
    out = sample(logits, SamplingTensors.from_numpy(rows, **_mixed_params(rows)))
    ref = torch.log_softmax(logits.double(), dim=-1)
    ids = out.sampled_token_ids.long()
    assert out.sampled_logprobs.dtype == torch.float32
    np.testing.assert_allclose(out.sampled_logprobs.double(), ref.gather(-1, ids[:, None])[:, 0],
                               atol=1e-5, rtol=0)
    ref_vals, ref_ids = torch.topk(ref, MAX_LOGPROBS, dim=-1)
    assert out.topk_logprobs.shape == (rows, MAX_LOGPROBS)
    assert torch.equal(out.topk_token_ids.long(), ref_ids)
    np.testing.assert_allclose(out.topk_logprobs.double(), ref_vals, atol=1e-5, rtol=0)
    assert torch.all(out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:])


def test_rows_without_top_k_or_top_p_keep_what_min_p_leaves():
    # With top_k and top_p off, a row draws argmax(scaled logits + Gumbel noise) over the
    # tokens min_p keeps, computed here from the public noise functions.
    rows, vocab = 32, 700
    logits = _random_batch(rows, vocab, seed=8, scale=1.5)
    params = _mixed_params(rows, seed=9)
    params.update(top_k=np.zeros(rows), top_p=np.ones(rows))
    t = SamplingTensors.from_numpy(rows, **params)
    temperature = np.where(params["temperature"] < 1e-5, 1.0, params["temperature"])
    scaled = logits / torch.tensor(temperature, dtype=torch.float32)[:, None]
    keep = torch.exp(scaled - scaled.amax(-1, keepdim=True)) >= t.min_p[:, None]
    noise = gumbel_from_bits(random_bits(t.seeds, t.step, vocab))
    expected = torch.argmax(scaled.masked_fill(~keep, float("-inf")) + noise, dim=-1)
    expected = torch.where(t.temperature < 1e-5, torch.argmax(logits, dim=-1), expected)
    assert torch.equal(sample(logits, t).sampled_token_ids.long(), expected)


def test_small_vocab_clips_logprob_count():
    out = sample(_random_batch(2, 8), SamplingTensors.from_numpy(2))
    assert out.topk_logprobs.shape == (2, 8)


def test_same_seed_and_step_same_token_regardless_of_batch():
    vocab, n_req = 500, 6
    req_logits = _random_batch(n_req, vocab, seed=2, scale=1.0)  # flat: many plausible tokens
    req = dict(temperature=[1.0, 0.7, 1.2, 1.0, 0.9, 1.0], top_k=[0, 40, 0, 100, 0, 0],
               top_p=[1.0, 1.0, 0.9, 0.95, 1.0, 1.0], min_p=[0, 0, 0, 0, 0.02, 0],
               seeds=[11, 12, 13, 2**62 + 5, -7, 11], step=[0, 3, 9, 1, 5, 1])
    alone = sample(torch.cat([req_logits, torch.zeros(2, vocab)]),
                   SamplingTensors.from_numpy(8, **req)).sampled_token_ids[:n_req]

    # Same requests reversed and interleaved with unrelated ones in a bigger bucket.
    others = _mixed_params(10, seed=3)
    order = list(range(n_req))[::-1]
    params = {k: list(np.asarray(req[k])[order]) + list(others[k]) for k in req}
    logits = torch.cat([req_logits[order], _random_batch(10, vocab, seed=4), torch.zeros(16, vocab)])
    mixed = sample(logits, SamplingTensors.from_numpy(32, **params)).sampled_token_ids
    assert torch.equal(mixed[:n_req], alone[order])
    # Rows 0 and 5 share seed 11 but differ in step, so they are independent draws.
    assert torch.equal(sample(torch.cat([req_logits, torch.zeros(2, vocab)]),
                              SamplingTensors.from_numpy(8, **req)).sampled_token_ids[:n_req],
                       alone)


@pytest.mark.parametrize("vary", ["seeds", "seeds_high_bits", "step"])
def test_different_seeds_or_steps_give_different_tokens(vary):
    rows, vocab = 64, 1000
    values = dict(seeds=np.full(rows, 5), step=np.full(rows, 3))
    values[vary.removesuffix("_high_bits")] = np.arange(rows) << (32 if "high" in vary else 0)
    t = SamplingTensors.from_numpy(rows, temperature=np.ones(rows), **values)
    tokens = sample(torch.zeros(rows, vocab), t).sampled_token_ids.numpy()
    assert len(set(tokens.tolist())) >= 55  # 64 uniform draws from 1000: ~62 distinct


def test_extreme_random_bits_give_finite_gumbel_noise():
    bits = torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    noise = gumbel_from_bits(bits)
    assert torch.isfinite(noise).all() and torch.all(noise[1:] >= noise[:-1])


ADV_VOCAB = 8192
# Tolerances of the float32 sampler against the float64 reference, used only to sandwich
# the kept set of a token that sits within them of a min_p / top_p boundary: top_p masses
# (float32 softmax rounding ~1e-7, plus fixed-point sums off by ~sqrt(n) * 2**-31 ~ 3e-8
# here, n * 2**-31 <= 4e-6 at worst) and min_p's exp(s - s_max) (relative, ~|s - s_max| * 6e-8).
# The mass tolerance is that worst case: eager CPU softmax rounding on some x86 CPUs put a
# near-flat row (top_p = 1 - 1e-6 over 8192 tokens) past a 1e-6 tolerance.
MASS_TOL, MIN_P_RTOL = 4e-6, 1e-6


def _dyadic_row(rng, probs):
    """Power-of-two probabilities, exact in float32 softmax on CPU and XLA, at random ids;
    every other token is -inf. Returns (logits, ids of probs in order)."""
    x = np.full(ADV_VOCAB, -np.inf, dtype=np.float32)
    ids = rng.choice(ADV_VOCAB, size=len(probs), replace=False)
    x[ids] = np.log(probs)
    return x, ids


def _adversarial_cases():
    """[(logits[V], params, expected kept ids or None, is a random row)]."""
    rng = np.random.default_rng(11)
    cases = []

    def add(x, expected=None, random_row=False, **params):
        cases.append((np.asarray(x, dtype=np.float32), params, expected, random_row))

    # Ties at the k-th value: 9 distinct values, so every k lands inside a tie group.
    for k, temperature in [(1, 1.0), (2, 0.7), (3, 1.0), (100, 1.3), (4095, 1.0), (8191, 0.5)]:
        add(rng.integers(-4, 5, ADV_VOCAB), top_k=k, temperature=temperature)
    for top_p, min_p in [(0.5, 0.0), (0.9, 0.1), (0.999, 0.0)]:
        add(rng.integers(-4, 5, ADV_VOCAB), top_k=2000, top_p=top_p, min_p=min_p)
    x = np.zeros(ADV_VOCAB)
    x[:5], x[5:12] = 3.0, 2.0  # k = 6..12 all land on the 7-way tie at 2.0
    for k in (5, 6, 9, 12, 13):
        add(x, top_k=k, expected=set(range(5)) if k == 5 else set(range(12)) if k <= 12 else None)

    # top_p / min_p boundaries hit exactly (all masses dyadic, so exact in float32).
    above_half = float(np.nextafter(np.float32(0.5), np.float32(1)))
    for probs, params, kept in [
        ([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16], dict(top_p=0.5), 1),
        ([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16], dict(top_p=above_half), 2),
        ([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16], dict(top_p=0.75), 2),
        ([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16], dict(top_p=0.875), 3),  # the tied pair's edge
        ([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16], dict(top_p=0.9375), 5),
        ([1 / 4, 1 / 4, 1 / 4, 1 / 8, 1 / 8], dict(top_p=0.25), 3),  # tied top group kept whole
        ([1 / 4, 1 / 4, 1 / 4, 1 / 8, 1 / 8], dict(top_p=0.75), 3),
        ([1 / 4, 1 / 4, 1 / 4, 1 / 8, 1 / 8], dict(top_p=0.0), 3),
        ([1 / 2, 1 / 8, 1 / 8, 1 / 8, 1 / 8], dict(top_k=2), 5),  # tie at the k-th value
        ([1 / 2, 1 / 8, 1 / 8, 1 / 8, 1 / 8], dict(top_k=2, top_p=0.5), 1),
        ([1 / 2, 1 / 8, 1 / 8, 1 / 8, 1 / 8], dict(min_p=0.25), 5),  # p / p_max == min_p
        ([1 / 2, 1 / 8, 1 / 8, 1 / 8, 1 / 8],
         dict(min_p=float(np.nextafter(np.float32(0.25), np.float32(1)))), 1),
        ([1 / 2, 1 / 8, 1 / 8, 1 / 8, 1 / 8], dict(min_p=0.25, top_p=above_half), 5),
    ]:
        x, ids = _dyadic_row(rng, probs)
        add(x, expected=set(ids[:kept].tolist()), **params)

    # Very peaked: one token holds all the float32 mass, or nearly all of it.
    for temperature, top_k, top_p, min_p in [(1.0, 0, 0.9, 0.0), (1.0, 5, 0.5, 0.1),
                                             (0.01, 50, 0.999999, 0.0), (0.01, 0, 1.0, 0.5),
                                             (1.0, 0, 0.999999, 0.0), (3.0, 0, 0.999999, 0.0)]:
        x = rng.standard_normal(ADV_VOCAB) * 3
        x[rng.integers(ADV_VOCAB)] = 60.0
        add(x, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    x = rng.standard_normal(ADV_VOCAB)
    x[[10, 20]] = [30.0, 30.0 - 15.0]  # the runner-up holds ~3e-7 of the mass
    add(x, top_p=0.9999995)
    add(x, top_p=0.9999990)

    # Very flat: everything tied, or within 1e-4 of it.
    for params in [dict(top_k=1), dict(top_p=0.5), dict(top_p=0.0), dict(min_p=0.9),
                   dict(top_k=7, top_p=0.3)]:
        add(np.zeros(ADV_VOCAB), expected=set(range(ADV_VOCAB)), **params)
    for top_k, top_p in [(0, 0.5), (0, 0.9), (10, 1.0), (4096, 0.3), (0, 0.999)]:
        add(rng.standard_normal(ADV_VOCAB) * 1e-4, top_k=top_k, top_p=top_p)

    # -inf (blocked) tokens, with top_k beyond the finite ones.
    x = rng.standard_normal(ADV_VOCAB) * 2
    x[rng.choice(ADV_VOCAB, 8000, replace=False)] = -np.inf
    for top_k, top_p in [(1000, 1.0), (1000, 0.9), (50, 0.5)]:
        add(x, top_k=top_k, top_p=top_p)

    # Random rows with every kind of setting.
    for _ in range(48):
        add(rng.standard_normal(ADV_VOCAB) * rng.choice([1.0, 3.0, 8.0]),
            temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
            top_k=rng.choice([0, -1, 1, 20, 1000, 8191, 8192]),
            top_p=rng.choice([1.0, 0.99, 0.95, 0.9, 0.5, 0.1, 0.0]),
            min_p=rng.choice([0.0, 0.01, 0.2]), random_row=True)
    return cases


@pytest.mark.parametrize("backend", ["eager", "xla"])
def test_filters_exact_on_adversarial_rows(backend):
    cases = _adversarial_cases()
    rows = len(cases)
    names = ("temperature", "top_k", "top_p", "min_p")
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    params = {n: [c[1].get(n, defaults[n]) for c in cases] for n in names}
    logits = torch.tensor(np.stack([c[0] for c in cases]))
    device = None
    if backend == "xla":
        torch_xla = pytest.importorskip("torch_xla")
        device = torch_xla.device()
    t = SamplingTensors.from_numpy(rows, device, **params)
    kept = _kept_mask(logits.to(device) / t.temperature[:, None], t)
    if device is not None:
        torch_xla.sync()
    kept = kept.cpu().numpy()

    undecided_random_rows = 0
    for row, (x, p, expected, random_row) in enumerate(cases):
        got = kept[row]
        if expected is not None:
            assert set(np.flatnonzero(got).tolist()) == expected, (row, p)
        # The sampler sees float32 parameters; top_p >= 1 (off) is exact, so not perturbed.
        p = {n: v if n == "top_k" else float(np.float32(v)) for n, v in (defaults | p).items()}
        top_p_lo, top_p_hi = (p["top_p"], p["top_p"]) if p["top_p"] >= 1 else (
            p["top_p"] - MASS_TOL, p["top_p"] + MASS_TOL)
        if expected is not None and len(expected) < 100:
            continue  # a boundary hit exactly: only the exact expectation applies
        # Sandwich: equal to the reference wherever no token is within the tolerance of a
        # min_p / top_p boundary; for a token within it, either side is right.
        strict = reference_keep(x, p["temperature"], p["top_k"], top_p_lo,
                                p["min_p"] * (1 + MIN_P_RTOL))
        loose = reference_keep(x, p["temperature"], p["top_k"], top_p_hi,
                               p["min_p"] * (1 - MIN_P_RTOL))
        assert np.all(strict <= got) and np.all(got <= loose), (
            row, p, np.flatnonzero(strict & ~got)[:10], np.flatnonzero(got & ~loose)[:10])
        undecided_random_rows += random_row and not np.array_equal(strict, loose)
    # The tolerance must not hollow the test out: random rows are decided exactly.
    assert undecided_random_rows == 0, undecided_random_rows


@pytest.mark.parametrize("backend", ["eager", "xla"])
def test_top_logprobs_order_ties_by_lowest_id(backend):
    # bf16-like logits: few distinct values, so ties sit inside the top K and across its
    # edge. Expected: a stable descending sort, i.e. value desc, then id asc.
    rng = np.random.default_rng(12)
    logits = torch.tensor(rng.integers(0, 6, (6, 4096)) * 0.125, dtype=torch.float32)
    logits[1, :] = 0.0  # all tied
    logits[2, [4000, 7, 3000]] = 5.0  # a tie above the boundary, listed out of id order
    t = SamplingTensors.from_numpy(6)
    if backend == "xla":
        torch_xla = pytest.importorskip("torch_xla")
        out = _sample_on_xla(torch_xla, logits, SamplingTensors.from_numpy(6, torch_xla.device()))
    else:
        out = sample(logits, t)
    raw = torch.log_softmax(logits, dim=-1).numpy()
    expected = np.argsort(-raw, axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.topk_token_ids.numpy(), expected)
    np.testing.assert_allclose(out.topk_logprobs.numpy(),
                               np.take_along_axis(raw, expected, axis=-1), atol=1e-5, rtol=0)


def test_padding_rows_cannot_disturb_real_rows():
    vocab = 200
    real = _random_batch(3, vocab, seed=5)
    t = SamplingTensors.from_numpy(8, temperature=[1.0, 0.0, 0.8], top_p=[0.9, 1, 1],
                                   seeds=[1, 2, 3])
    clean = sample(torch.cat([real, torch.zeros(5, vocab)]), t)
    assert torch.isfinite(clean.sampled_logprobs).all()
    assert torch.isfinite(clean.topk_logprobs).all()
    garbage = sample(torch.cat([real, torch.full((5, vocab), float("nan"))]), t)
    assert torch.equal(garbage.sampled_token_ids[:3], clean.sampled_token_ids[:3])
    assert torch.equal(garbage.sampled_logprobs[:3], clean.sampled_logprobs[:3])


def test_from_numpy_validates():
    wrapped = SamplingTensors.from_numpy(3, seeds=[2**64 - 1, 2**63, -(2**63)]).seeds
    assert wrapped.tolist() == [-1, -(2**63), -(2**63)]
    with pytest.raises(TypeError, match="unknown sampling fields"):
        SamplingTensors.from_numpy(4, temprature=[1.0])
    with pytest.raises(ValueError, match="more than 2"):
        SamplingTensors.from_numpy(2, seeds=[1, 2, 3])


def _num_compiles():
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")  # None until the first compilation
    return 0 if data is None else data[0]


def _sample_on_xla(torch_xla, logits, t, **static):
    out = sample(logits.to(torch_xla.device()), t, **static)
    # Materialise every output in one graph, as the runner does: fetching outputs one by
    # one would cut a differently-shaped graph per fetch and count as extra compiles.
    torch_xla.sync()
    return SamplerOutput(*(getattr(out, f.name).cpu() for f in fields(SamplerOutput)))


def test_xla_one_graph_for_all_param_values_and_matches_eager():
    torch_xla = pytest.importorskip("torch_xla")
    device = torch_xla.device()
    rows, vocab = 32, 512
    logits = _random_batch(rows, vocab, seed=6)
    logits[0, :], logits[0, [9, 5, 300]] = 0.0, 2.0  # XLA's argmax must also pick id 5
    mixed = _mixed_params(rows, seed=7)

    greedy = _sample_on_xla(torch_xla, logits, SamplingTensors.from_numpy(rows, device))
    compiles = _num_compiles()
    assert compiles >= 1
    out = _sample_on_xla(torch_xla, logits, SamplingTensors.from_numpy(rows, device, **mixed))
    assert _num_compiles() == compiles, "new parameter values must reuse the compiled graph"

    assert torch.equal(greedy.sampled_token_ids, torch.argmax(logits, dim=-1).int())
    eager = sample(logits, SamplingTensors.from_numpy(rows, **mixed))
    assert torch.equal(out.sampled_token_ids, eager.sampled_token_ids)
    assert torch.equal(out.topk_token_ids, eager.topk_token_ids)
    np.testing.assert_allclose(out.sampled_logprobs, eager.sampled_logprobs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.topk_logprobs, eager.topk_logprobs, atol=1e-5, rtol=0)

    # Still that one graph for other parameter values, filters switched off included.
    mixed.update(top_k=np.zeros(rows), top_p=np.ones(rows))
    for seed_offset in (0, 1000):
        mixed["seeds"] = mixed["seeds"] + seed_offset
        t = SamplingTensors.from_numpy(rows, device, **mixed)
        out = _sample_on_xla(torch_xla, logits, t)
    assert _num_compiles() == compiles
    eager = sample(logits, SamplingTensors.from_numpy(rows, **mixed))
    assert torch.equal(out.sampled_token_ids, eager.sampled_token_ids)
