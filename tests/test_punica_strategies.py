"""Every xla LoRA strategy of the fused-slices PunicaWrapper (what the runner's graphs run)
against the float32 per-token loop reference, on a packed (3-slice) layer with tokens
that use no adapter, active slots scattered over the stacked buffers, and free slots
holding garbage that no token may read."""

import numpy as np
import pytest
import torch

from vllm_tpu_lora import platform
from vllm_tpu_lora.lora import step_layout
from vllm_tpu_lora.lora.punica import PunicaWrapper
from vllm_tpu_lora.ops.bgmv_ref import bgmv_expand_slice_ref, bgmv_shrink_ref
from vllm_tpu_lora.runner import buckets

MAX_LORAS, RANK, DIM, SLICES = 20, 8, 64, [64, 32, 32]


@pytest.mark.parametrize("strategy,num_slots,num_tokens,dim", [
    ("single", 1, 16, DIM), ("onehot", 4, 16, DIM), ("gathered", 8, 32, DIM),
    ("gathered", 16, 64, DIM), ("gathered", 8, 32, 40),  # 40: not a multiple of the vector width
    ("grouped", 16, 64, DIM), ("grouped", 8, 256, DIM), ("slots", 8, 32, DIM),
    ("slots", 16, 64, 40), ("onehot", 16, 64, 40), ("stacked", 8, 32, DIM),
    ("stacked", MAX_LORAS, 16, 40)])
def test_strategy_matches_reference(strategy, num_slots, num_tokens, dim):
    rng = np.random.default_rng(num_slots * 100 + num_tokens)
    gen = torch.Generator().manual_seed(num_tokens)
    lora_a = [torch.randn(MAX_LORAS, RANK, dim, generator=gen) for _ in SLICES]
    lora_b = [torch.randn(MAX_LORAS, o, RANK, generator=gen) for o in SLICES]
    active = sorted(rng.choice(MAX_LORAS, size=num_slots, replace=False).tolist())
    # Free slots hold finite garbage: any read of them would show in the result.
    token_pos = rng.integers(-1, num_slots, size=num_tokens).astype(np.int32)
    x = torch.randn(num_tokens, dim, generator=gen)
    y0 = torch.randn(num_tokens, sum(SLICES), generator=gen)

    punica = PunicaWrapper("xla", fuse_slices=True)
    punica.force_strategy, punica.max_loras = strategy, MAX_LORAS
    if strategy == "slots":  # the step must fit its slots' rows (else: the fallback graph)
        assert step_layout.slots_fit(token_pos, num_slots)
    _check_against_reference(punica, token_pos, active, num_slots, lora_a, lora_b, x, y0)


def test_onehot_with_fewer_adapters_than_its_bucket():
    """The TPU's strategy in the common case: 3 adapters in a 4-slot graph. The runner
    pads active_slots to the bucket (the padding points at slot 0, whose garbage no
    token's one-hot selects)."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    lora_a = [torch.randn(MAX_LORAS, RANK, DIM, generator=gen) for _ in SLICES]
    lora_b = [torch.randn(MAX_LORAS, o, RANK, generator=gen) for o in SLICES]
    active = [5, 11, 17]  # slot 0 (the padding's) holds another adapter's garbage
    token_pos = rng.integers(-1, len(active), size=48).astype(np.int32)
    punica = PunicaWrapper("xla", fuse_slices=True)
    punica.force_strategy, punica.max_loras = "onehot", MAX_LORAS
    _check_against_reference(punica, token_pos, active, 4, lora_a, lora_b,
                             torch.randn(48, DIM, generator=gen),
                             torch.randn(48, sum(SLICES), generator=gen))


@pytest.mark.parametrize("strategy,num_slots,num_tokens", [
    ("single", 1, 16), ("onehot", 4, 48), ("onehot", 16, 64), ("stacked", MAX_LORAS, 32)])
def test_tpu_layout_strategies_match_reference(strategy, num_slots, num_tokens):
    """On a TPU the xla path holds A rank-first ([N, R, D]: a minor rank axis would be
    padded to 128 lanes there) and runs only single, onehot and stacked (a bucket of
    every slot), which read it so; the strategies that read A by input refuse to be
    forced there."""
    rng = np.random.default_rng(num_slots + num_tokens)
    gen = torch.Generator().manual_seed(num_slots)
    lora_a = [torch.randn(MAX_LORAS, RANK, DIM, generator=gen) for _ in SLICES]
    lora_b = [torch.randn(MAX_LORAS, o, RANK, generator=gen) for o in SLICES]
    active = sorted(rng.choice(MAX_LORAS, size=num_slots, replace=False).tolist())
    token_pos = rng.integers(-1, num_slots, size=num_tokens).astype(np.int32)
    punica = PunicaWrapper("xla", fuse_slices=True)
    punica.max_loras, punica.on_tpu, punica.tpu_strategies = MAX_LORAS, True, True
    assert not punica.a_by_input
    assert punica.xla_strategy(num_tokens, num_slots) == strategy
    _check_against_reference(punica, token_pos, active, num_slots, lora_a, lora_b,
                             torch.randn(num_tokens, DIM, generator=gen),
                             torch.randn(num_tokens, sum(SLICES), generator=gen))
    punica.force_strategy = "gathered"
    with pytest.raises(ValueError, match="does not hold"):
        punica.xla_strategy(num_tokens, num_slots)


@pytest.mark.parametrize("num_active,num_tokens", [(8, 64), (16, 256), (3, 64)])
def test_split_strategy_matches_reference(num_active, num_tokens):
    """A mixed step as continuous batching makes it: a few adapters with prefill chunks
    (heavy: the one-hot product) and single decode tokens of many others (light: gathered
    rows), plus base-model tokens. The graph's S is the heavy adapters' bucket."""
    rng = np.random.default_rng(num_active * 7 + num_tokens)
    gen = torch.Generator().manual_seed(num_tokens + 1)
    lora_a = [torch.randn(MAX_LORAS, RANK, DIM, generator=gen) for _ in SLICES]
    lora_b = [torch.randn(MAX_LORAS, o, RANK, generator=gen) for o in SLICES]
    active = sorted(rng.choice(MAX_LORAS, size=num_active, replace=False).tolist())
    decode = list(range(2, num_active)) + [-1, 1, -1]  # one token each (1 is repeated)
    prefill = num_tokens - len(decode)
    token_pos = np.array(decode + [0] * (prefill // 2) + [1] * (prefill - prefill // 2),
                         np.int32)
    rng.shuffle(token_pos[:len(decode)])

    punica = PunicaWrapper("xla", fuse_slices=True)
    ladder = [0] + [2 ** i for i in range(5)]
    num_slots = punica.graph_slots(token_pos, num_active, ladder)
    assert punica.xla_strategy(num_tokens, num_slots) == "split"
    heavy, light = step_layout.heavy_positions(token_pos, num_active)
    assert light.any() and heavy and num_slots < buckets.pick(ladder, num_active)
    x = torch.randn(num_tokens, DIM, generator=gen)
    y0 = torch.randn(num_tokens, sum(SLICES), generator=gen)
    _check_against_reference(punica, token_pos, active, num_slots, lora_a, lora_b, x, y0)


def _check_against_reference(punica, token_pos, active, num_slots, lora_a, lora_b, x, y0):
    """Run the step's plan through add_lora_linear on the device; compare with the float32
    per-token loop."""
    dev = platform.xla_device()
    plan = punica.plan_step(token_pos, active, num_slots, torch.float32)
    punica.set_step(num_slots, {k: torch.from_numpy(v).to(dev) for k, v in plan.items()})
    # The fused xla path reads B [N, R, O] and A [N, D, R], or rank-first on a TPU.
    assert punica.weights_transposed
    got = punica.add_lora_linear(y0.to(dev), x.to(dev),
                                 [(a.transpose(1, 2).contiguous() if punica.a_by_input else a)
                                  .to(dev) for a in lora_a],
                                 [b.transpose(1, 2).contiguous().to(dev) for b in lora_b],
                                 SLICES).cpu()
    idx = torch.tensor([active[p] if p >= 0 else -1 for p in token_pos])
    expected, offset = y0.clone(), 0
    for a, b, size in zip(lora_a, lora_b, SLICES):
        ys = bgmv_shrink_ref(x, a, idx, torch.ones(MAX_LORAS))
        expected = bgmv_expand_slice_ref(ys, b, idx, expected, offset, size)
        offset += size
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens,fits", [(64, True), (64, False), (128, False)])
def test_slots_bucket_and_its_fallback_match_reference(num_tokens, fits):
    """A slots bucket (S above half the device slots, T >= 64): a step whose adapters fit
    a slot's C = 2T/S rows reads the buffers in place; one where an adapter has more tokens
    runs the bucket's fallback graph (gathered at T=64, split at T=128, whose heavy bucket
    graph_slots picks). The runner and the plan agree on which, and both are exact."""
    rng = np.random.default_rng(num_tokens + fits)
    gen = torch.Generator().manual_seed(num_tokens * 3 + fits)
    lora_a = [torch.randn(MAX_LORAS, RANK, DIM, generator=gen) for _ in SLICES]
    lora_b = [torch.randn(MAX_LORAS, o, RANK, generator=gen) for o in SLICES]
    num_active = 12
    active = sorted(rng.choice(MAX_LORAS, size=num_active, replace=False).tolist())
    if fits:  # an even spread with some base-model tokens
        token_pos = (np.arange(num_tokens) % (num_active + 1) - 1).astype(np.int32)
    else:  # one prefill chunk far over a slot's rows, a decode token for the others
        token_pos = np.array(list(range(1, num_active)) + [-1]
                             + [0] * (num_tokens - num_active), np.int32)
    rng.shuffle(token_pos)

    punica = PunicaWrapper("xla", fuse_slices=True)
    punica.max_loras = MAX_LORAS
    ladder = [0] + [2 ** i for i in range(5)]
    num_slots = punica.graph_slots(token_pos, num_active, ladder)
    plan = punica.plan_step(token_pos, active, num_slots, torch.float32)
    assert ("slot_perm" in plan) == fits
    if fits:
        assert num_slots == 16 and punica.xla_strategy(num_tokens, num_slots) == "slots"
    else:
        assert not step_layout.slots_fit(token_pos, 16)
    _check_against_reference(punica, token_pos, active, num_slots, lora_a, lora_b, x=torch.randn(
        num_tokens, DIM, generator=gen), y0=torch.randn(num_tokens, sum(SLICES), generator=gen))


def test_tpu_backend_rule_and_onehot_table(monkeypatch):
    """lora_backend="auto": the xla backend on and off a TPU, at any slot count and rank;
    there a graph with 2+ adapters runs onehot over its adapters, or stacked where its
    bucket is every slot ("single" for one), the fused grouped kernel only where T*S*R
    reaches the measured 2^20 over 2,048+ lanes (S*R), and the indexed kernel in decode
    graphs of 32+ adapters at rank 16 (kernels: with "auto", an explicit "xla" never);
    an explicit backend stands."""
    from vllm_tpu_lora.lora import punica as punica_mod

    for tpu in (False, True):
        monkeypatch.setattr(punica_mod.platform, "is_tpu", lambda tpu=tpu: tpu)
        assert punica_mod.resolve_lora_backend("auto") == "xla", tpu
        assert punica_mod.resolve_lora_backend("pallas") == "pallas"
    punica = PunicaWrapper("xla", fuse_slices=True)
    punica.max_loras = 16
    assert punica.on_tpu and punica.tpu_strategies
    for t, s in ((16, 8), (64, 8), (256, 4), (512, 4), (16, 2)):
        assert punica.xla_strategy(t, s) == "onehot", (t, s)
    for t in (16, 256, 1024):  # a bucket of every slot reads them as they lie
        assert punica.xla_strategy(t, 16) == "stacked", t
    assert punica.xla_strategy(16, 1) == punica.xla_strategy(512, 1) == "single"
    punica.max_loras, punica.max_rank = 128, 16
    assert punica.xla_strategy(1024, 128) == "stacked"  # lora_backend="xla": XLA ops only
    assert punica.xla_strategy(32, 32) == "onehot"  # no kernel either
    punica.grouped_kernel_from = step_layout.GROUPED_KERNEL_FROM  # as "auto" sets it
    assert punica.xla_strategy(512, 128) == punica.xla_strategy(1024, 128) == "grouped_kernel"
    assert punica.xla_strategy(256, 128) == "stacked"  # 2^19: measured slower there
    assert punica.xla_strategy(1024, 32) == punica.xla_strategy(8192, 32) == "onehot"  # 512 lanes
    assert punica.xla_strategy(4096, 1) == "single"
    # Decode graphs over 32+ of more slots run the indexed kernel (measured at rank 16);
    # more tokens, fewer slots or every slot do not.
    assert punica.xla_strategy(32, 32) == punica.xla_strategy(16, 64) == "indexed"
    assert punica.xla_strategy(64, 32) == punica.xla_strategy(32, 16) == "onehot"
    assert punica.xla_strategy(32, 128) == "stacked"
    punica.max_rank = 64  # the rule reads the buffers' rank
    assert punica.xla_strategy(32, 32) == "onehot"  # not measured at rank 64
    assert punica.xla_strategy(256, 128) == "grouped_kernel"
    assert punica.xla_strategy(256, 32) == "onehot"
    punica.max_rank = 128  # one slot a group: not measured, not picked
    assert punica.xla_strategy(1024, 128) == "stacked"
    punica.max_rank = 64
    assert punica.strategy_table([256, 512], [0, 1, 2, 32, 128], max_num_seqs=256) == (
        "T256: S1 single, S2-S32 onehot, S128 grouped_kernel; "
        "T512: S1 single, S2 onehot, S32-S128 grouped_kernel")
    # 32 sequences never bring more than 32 adapters: no 128-slot graph is compiled or listed
    assert punica.strategy_table([256, 512], [0, 1, 2, 32, 128], max_num_seqs=32) == (
        "T256: S1 single, S2-S32 onehot; T512: S1 single, S2 onehot, S32 grouped_kernel")
