"""The fused grouped LoRA kernel (ops/grouped_lora.py) in the Pallas interpreter against a
float64 numpy reference (x @ A[s].T @ B[s] per token), its work list, its TPU lowering
(jax.export: the Mosaic lowering runs on any host) and its VMEM budget. Speed is the
TPU's to measure: benchmarks/tpu_lora_layer.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.grouped_lora import (
    VMEM_BUDGET_BYTES,
    group_plan,
    grouped_kernel,
    grouped_lora,
    slots_per_group,
    tiles,
    token_tile,
    vmem_bytes,
)
from vllm_tpu_lora.ops.pallas_export import export_for_tpu


def _reference(x, weights, slots):
    out = []
    for a, b in weights:
        o = np.zeros((x.shape[0], b.shape[2]))
        for s in set(slots.tolist()) - {-1}:
            rows = slots == s
            o[rows] = x[rows] @ a[s].T @ b[s]
        out.append(o)
    return np.concatenate(out, axis=1)


def _slots(rng, t, s, kind):
    if kind == "uniform":
        return rng.integers(-1, s, size=t)
    if kind == "skewed":  # one adapter takes most tokens, a few others trickle
        return rng.choice([-1, 0, s - 1, s // 2], size=t, p=[0.1, 0.7, 0.1, 0.1])
    if kind == "mostly_base":
        return np.where(rng.random(t) < 0.85, -1, rng.integers(0, s, size=t))
    if kind == "all_base":
        return np.full(t, -1)
    if kind == "scattered":  # a few adapters in slots far apart (LRU slot assignment)
        few = rng.choice(s, size=min(3, s), replace=False)
        return rng.choice(np.append(few, -1), size=t)
    raise ValueError(kind)


# (T, S, R, D, output slices, token distribution): one tile and several, groups of 8
# slots (rank 16), 2 (rank 64) and 1 (S = 1), packed slices, steps without adapters.
CASES = [
    (16, 8, 16, 256, (128,), "uniform"),
    (40, 4, 16, 128, (256, 128, 128), "skewed"),
    (300, 32, 16, 256, (384,), "uniform"),
    (300, 32, 64, 128, (128, 256), "mostly_base"),
    (130, 1, 16, 128, (128,), "uniform"),
    (64, 16, 16, 128, (128,), "all_base"),
    (24, 128, 16, 128, (128, 256), "scattered"),
    (200, 64, 16, 128, (128,), "scattered"),
]


@pytest.mark.parametrize("t,s,r,d,outs,kind", CASES)
def test_grouped_kernel_matches_float64(t, s, r, d, outs, kind):
    rng = np.random.default_rng(t * s + r)
    slots = _slots(rng, t, s, kind)
    x = rng.standard_normal((t, d)).astype(np.float32)
    weights = [(rng.standard_normal((s, r, d)).astype(np.float32) / np.sqrt(d),
                rng.standard_normal((s, r, o)).astype(np.float32) / np.sqrt(r)) for o in outs]
    unused = sorted(set(range(s)) - set(slots.tolist()))
    for a, _ in weights:  # an unused slot's A may hold anything: the select drops it
        a[unused] = np.nan
    with jax.default_matmul_precision("highest"):
        got = np.asarray(grouped_lora(jnp.asarray(x), [tuple(map(jnp.asarray, w)) for w in weights],
                                      jnp.asarray(slots, jnp.int32), interpret=True,
                                      precision="highest"))
    ref = _reference(x.astype(np.float64), [(a.astype(np.float64), b.astype(np.float64))
                                            for a, b in weights], slots)
    assert np.isfinite(got).all()
    assert np.all(got[slots < 0] == 0)  # tokens without an adapter: exactly zero
    rms = float(np.sqrt(np.mean(ref ** 2))) or 1.0
    assert np.max(np.abs(got - ref)) / rms < 1e-5


def test_grouped_kernel_bfloat16():
    """bfloat16 operands, float32 accumulation: within bfloat16's rounding of the rank
    activations (as the one-hot and segment paths)."""
    rng = np.random.default_rng(3)
    t, s, r, d, o = 200, 16, 16, 256, 256
    slots = _slots(rng, t, s, "uniform")
    x = rng.standard_normal((t, d))
    a, b = rng.standard_normal((s, r, d)) / np.sqrt(d), rng.standard_normal((s, r, o)) / np.sqrt(r)
    bf = [jnp.asarray(v, jnp.bfloat16) for v in (x, a, b)]
    got = np.asarray(grouped_lora(bf[0], [(bf[1], bf[2])], jnp.asarray(slots, jnp.int32),
                                  interpret=True).astype(jnp.float32))
    as64 = [np.asarray(v.astype(jnp.float32), np.float64) for v in bf]
    ref = _reference(as64[0], [(as64[1], as64[2])], slots)
    assert np.max(np.abs(got - ref)) / np.sqrt(np.mean(ref ** 2)) < 3e-2


@pytest.mark.parametrize("seed", range(6))
def test_work_list_visits_exactly_the_groups_each_tile_needs(seed):
    rng = np.random.default_rng(seed)
    t, s, r = int(rng.integers(1, 700)), int(rng.choice([1, 4, 8, 32, 128])), 16
    if seed % 2:  # a decode-sized step: one tile
        t = int(rng.integers(1, 129))
    if seed >= 4:  # groups between a tile's lowest and highest slot that no token uses
        s = 128
    slots = _slots(rng, t, s, ["uniform", "skewed", "mostly_base", "all_base", "scattered",
                               "scattered"][seed])
    g, tile = slots_per_group(s, r), token_tile(t)
    plan = jax.tree.map(np.asarray, group_plan(jnp.asarray(slots, jnp.int32), s, g, tile))
    n_tiles = -(-t // tile)
    assert plan.work_tile.shape[0] == n_tiles + s // g - 1  # the static bound
    # Sorted rows: the permutation and its inverse agree, slots ascending, base last;
    # one tile keeps token order.
    assert np.array_equal(plan.order[plan.inverse], np.arange(t))
    sorted_slot = plan.sorted_slot[:, 0]
    keyed = np.where(sorted_slot < 0, s, sorted_slot)
    if n_tiles > 1:
        assert np.all(np.diff(keyed) >= 0)
    else:
        assert np.array_equal(plan.order, np.arange(tile))
    live = [(int(ti), int(gi)) for ti, gi, v in zip(plan.work_tile, plan.work_group,
                                                    plan.work_live) if v]
    needed = {(i // tile, int(sl) // g) for i, sl in enumerate(sorted_slot) if sl >= 0}
    assert len(live) == len(set(live)) and set(live) == needed
    # Every tile is visited (its output block written), tiles in order, each once in a run.
    assert np.all(np.diff(plan.work_tile) >= 0)
    assert set(plan.work_tile.tolist()) == set(range(n_tiles))


def test_group_and_tile_sizes():
    assert [slots_per_group(s, 16) for s in (1, 4, 8, 128)] == [1, 4, 8, 8]
    assert [slots_per_group(128, r) for r in (8, 64, 128, 256)] == [16, 2, 1, 1]
    assert [token_tile(t) for t in (1, 16, 40, 128, 1024)] == [16, 16, 48, 128, 128]


# Llama-3-8B's linears at the step shapes: every kernel the engine would compile
# for them passes Mosaic's lowering.
LOWERED = [(16, 8, 16, 4096, (4096, 1024, 1024)), (256, 32, 16, 4096, (14336, 14336)),
           (1024, 128, 64, 14336, (4096,)), (1024, 128, 16, 4096, (4096,)),
           # Large ranks at Qwen2.5-7B / Gemma-2-9B widths: D and O tiled to fit VMEM.
           (512, 4, 512, 3584, (18944, 18944)), (128, 8, 256, 14336, (3584,))]


@pytest.mark.parametrize("t,s,r,d,outs", LOWERED)
def test_grouped_kernel_lowers_for_tpu(t, s, r, d, outs):
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((t, d), bf),
            [(jax.ShapeDtypeStruct((s, r, d), bf), jax.ShapeDtypeStruct((s, r, o), bf))
             for o in outs],
            jax.ShapeDtypeStruct((t,), jnp.int32))
    exported = export_for_tpu(lambda x, w, sl: grouped_lora(x, w, sl), args)
    assert "tpu_custom_call" in exported.mlir_module()


def test_vmem_budget():
    """The D tile, then the O tile halve until the estimate fits the budget (the whole O
    kept where a D tile allows it); what cannot fit the ceiling is refused, naming it."""
    tile = 128
    assert vmem_bytes(tile, 4096, 14336, 128, "bfloat16") > VMEM_BUDGET_BYTES
    d_tile, o_tile = tiles(tile, 4096, 14336, 128, "bfloat16")
    assert 14336 % o_tile == 0 and o_tile % 128 == 0 and 4096 % d_tile == 0
    assert vmem_bytes(tile, d_tile, o_tile, 128, "bfloat16") <= VMEM_BUDGET_BYTES
    assert tiles(16, 4096, 4096, 128, "bfloat16") == (4096, 4096)
    # Rank 512 (one slot per group, 512 lanes) at Qwen2.5-7B's MLP width fits by tiling.
    d_tile, o_tile = tiles(tile, 3584, 18944, 512, "bfloat16")
    assert vmem_bytes(tile, d_tile, o_tile, 512, "bfloat16") <= VMEM_BUDGET_BYTES
    with pytest.raises(ValueError, match="D=4096, O=4096 at 65536 lanes.*VMEM"):
        tiles(tile, 4096, 4096, 65536, "float32")
    assert vmem.VMEM_LIMIT_CEILING_BYTES > VMEM_BUDGET_BYTES


def test_grouped_kernel_tiles_d_and_o():
    """Forced small D and O tiles (several of each) give the same delta as one tile."""
    rng = np.random.default_rng(5)
    t, s, r, d, o = 200, 8, 16, 512, 384
    slots = _slots(rng, t, s, "uniform")
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((s, r, d)) / np.sqrt(d), jnp.float32)
    b = jnp.asarray(rng.standard_normal((s, r, o)) / np.sqrt(r), jnp.float32)
    g, tile = slots_per_group(s, r), token_tile(t)
    plan = group_plan(jnp.asarray(slots, jnp.int32), s, g, tile)
    xs = x[jnp.minimum(plan.order, t - 1)]
    with jax.default_matmul_precision("highest"):
        whole = grouped_kernel(plan, xs, a, b, group=g, tile=tile, blocks=(d, o),
                               interpret=True, precision="highest")
        tiled = grouped_kernel(plan, xs, a, b, group=g, tile=tile, blocks=(128, 128),
                               interpret=True, precision="highest")
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(whole), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(whole)).max() > 0.1  # a real delta, not zeros
