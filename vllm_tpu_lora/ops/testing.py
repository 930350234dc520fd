"""Test inputs and tolerances for the LoRA ops (used by tests/test_ops_*.py and
usable by layer/runner tests that need realistic adapter buffers).

A case is adversarial on purpose: slots that no token references are filled with
NaN (weights and scale), padding tokens (idx = -1) have NaN activations (x and y), and each
slot's rank is partly zero-padded as the stacked adapter buffers are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

DISTRIBUTIONS = ("identical", "distinct", "uniform", "skewed")

# (atol, rtol) per dtype: bf16 rounds inputs and outputs to 8 mantissa bits.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (6e-2, 2e-2),
    torch.float16: (1e-2, 4e-3),  # 11 mantissa bits
}


class LoraCase(NamedTuple):
    x: torch.Tensor  # [T, D]
    lora_a: torch.Tensor  # [N, R, D]
    lora_b: torch.Tensor  # [N, O, R]
    idx: torch.Tensor  # int32 [T]
    scale: torch.Tensor  # float32 [N]
    base: torch.Tensor  # [T, O]
    y: torch.Tensor  # [T, R] input for expand tests (NaN rows where idx < 0)


def make_indices(num_tokens: int, num_slots: int, dist: str, gen: torch.Generator) -> torch.Tensor:
    """int32 [T] slot per token following one of DISTRIBUTIONS."""
    t, n = num_tokens, num_slots
    if dist == "identical":  # every token on the last slot: slots 0..N-2 unused
        idx = torch.full((t,), n - 1)
    elif dist == "distinct":  # round-robin: neighbouring tokens never share a slot
        idx = torch.arange(t) % n
    elif dist == "uniform":
        idx = torch.randint(0, n, (t,), generator=gen)
    elif dist == "skewed":  # mostly slot 0, ~25% padding (-1), slot N-1 never used
        r = torch.rand(t, generator=gen)
        idx = torch.where(r < 0.6, 0, torch.randint(0, max(n - 1, 1), (t,), generator=gen))
        idx = torch.where(r > 0.75, -1, idx)
    else:
        raise ValueError(f"unknown index distribution {dist!r}; expected one of {DISTRIBUTIONS}")
    return idx.to(torch.int32)


def make_case(
    num_tokens: int,
    in_features: int,
    out_features: int,
    rank: int,
    num_slots: int,
    dtype: torch.dtype,
    dist: str,
    seed: int = 0,
) -> LoraCase:
    """Random CPU inputs for one op test; see the module docstring for the traps."""
    g = torch.Generator().manual_seed(seed)
    t, d, o, r, n = num_tokens, in_features, out_features, rank, num_slots
    idx = make_indices(t, n, dist, g)
    a = torch.randn(n, r, d, generator=g) / d**0.5
    b = torch.randn(n, o, r, generator=g) / r**0.5
    # Zero-pad each slot's rank beyond a random effective rank, as adapter buffers are.
    eff = torch.randint(1, r + 1, (n,), generator=g)
    keep = torch.arange(r)[None, :] < eff[:, None]  # [N, R]
    a = torch.where(keep[:, :, None], a, 0.0)
    b = torch.where(keep[:, None, :], b, 0.0)
    scale = torch.rand(n, generator=g) + 0.5
    used = torch.zeros(n, dtype=torch.bool)
    used[idx[idx >= 0].long()] = True
    nan = float("nan")
    a[~used], b[~used], scale[~used] = nan, nan, nan
    x = torch.randn(t, d, generator=g)
    x[idx < 0] = nan  # padding tokens must contribute exactly nothing
    y = torch.where((idx >= 0)[:, None], torch.randn(t, r, generator=g), nan)
    base = torch.randn(t, o, generator=g)
    return LoraCase(x.to(dtype), a.to(dtype), b.to(dtype), idx, scale, base.to(dtype), y.to(dtype))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare on CPU in float32 with the dtype's tolerance; NaN anywhere fails."""
    actual = actual.detach().to("cpu", torch.float32)
    assert not torch.isnan(actual).any(), "NaN leaked into the output"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected.to(torch.float32), atol=atol, rtol=rtol)
