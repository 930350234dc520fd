"""The indexed LoRA kernel (ops/indexed_lora.py) in the Pallas interpreter against a float64
numpy reference (x @ A[s].T @ B[s] per token, s its adapter's device slot), its used-first
reordering, its TPU lowering (jax.export) and its VMEM budget. Speed is the TPU's to
measure: benchmarks/tpu_lora_layer.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import enable_x64

from vllm_tpu_lora.ops.indexed_lora import (
    VMEM_BUDGET_BYTES,
    fitting_plan,
    indexed_lora,
    max_group,
    tile_runs,
    token_tile,
    used_first,
    vmem_bytes,
)
from vllm_tpu_lora.ops.pallas_export import export_for_tpu, hbm_operands


def _step(rng, t, n, p, kind):
    """(active_slots [P], token_lora_idx [T]) as lora/step_layout.onehot_layout gives them:
    P device slots out of N (scattered, as LRU leaves them) and each token's position."""
    active = rng.choice(n, size=p, replace=False).astype(np.int32)
    if kind == "uniform":
        pos = rng.integers(-1, p, size=t)
    elif kind == "padded":  # a bucket wider than the step: the last positions unused
        pos = rng.integers(-1, max(1, p // 3), size=t)
    elif kind == "gaps":  # used positions with unused ones between them
        pos = rng.choice([-1, 0, p - 1], size=t)
    elif kind == "all_base":
        pos = np.full(t, -1)
    elif kind == "runs":  # a prefill: sequence by sequence, adapters numbered as met
        pos, met = [], 0
        while len(pos) < t:
            if met < p and rng.random() < 0.7:
                seq, met = met, met + 1  # a new adapter
            else:  # an adapter met before, or the base model
                seq = int(rng.integers(-1, met)) if met else -1
            pos += [seq] * int(rng.integers(1, 60))
        pos = np.asarray(pos[:t])
    else:
        raise ValueError(kind)
    return active, pos.astype(np.int32)


def _reference(x, weights, active, pos):
    out = np.zeros((x.shape[0], sum(b.shape[2] for _, b in weights)))
    for i in np.flatnonzero(pos >= 0):
        s = active[pos[i]]
        out[i] = np.concatenate([x[i] @ a[s].T @ b[s] for a, b in weights])
    return out


# (T, N slots, P bucket, R, D, output slices, token distribution): decode-sized and
# several tiles, packed slices, a padded bucket, all-base steps, rank 8 and 64.
CASES = [
    (16, 8, 4, 16, 256, (128,), "uniform"),
    (40, 128, 8, 16, 128, (256, 128, 128), "gaps"),
    (7, 4, 4, 8, 128, (128,), "padded"),
    (300, 32, 32, 64, 128, (128, 256), "uniform"),
    (64, 16, 16, 16, 128, (128,), "all_base"),
    (130, 64, 16, 16, 256, (384,), "padded"),
    (700, 64, 32, 16, 128, (128, 256), "runs"),
]


@pytest.mark.parametrize("t,n,p,r,d,outs,kind", CASES)
def test_indexed_kernel_matches_float64(t, n, p, r, d, outs, kind):
    rng = np.random.default_rng(t * n + r)
    active, pos = _step(rng, t, n, p, kind)
    x = rng.standard_normal((t, d)).astype(np.float32)
    weights = [(rng.standard_normal((n, r, d)).astype(np.float32) / np.sqrt(d),
                rng.standard_normal((n, r, o)).astype(np.float32) / np.sqrt(r)) for o in outs]
    used = set(active[pos[pos >= 0]].tolist())
    for a, b in weights:  # slots no token uses are never read: NaN there cannot leak
        a[sorted(set(range(n)) - used)] = np.nan
        b[sorted(set(range(n)) - used)] = np.nan
    with jax.default_matmul_precision("highest"):
        got = np.asarray(indexed_lora(jnp.asarray(x), [tuple(map(jnp.asarray, w)) for w in weights],
                                      jnp.asarray(pos), jnp.asarray(active), interpret=True,
                                      precision="highest"))
    ref = _reference(x.astype(np.float64), [(a.astype(np.float64), b.astype(np.float64))
                                            for a, b in weights], active, pos)
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.all(got[pos < 0] == 0)  # tokens without an adapter: exactly zero
    rms = float(np.sqrt(np.mean(ref ** 2))) or 1.0
    assert np.max(np.abs(got - ref)) / rms < 1e-5


def test_indexed_kernel_with_the_hosts_count():
    """The engine-style call: the step's adapters first in active_slots and their count
    given (no reordering on the device); bucket entries past it (slot 0, NaN here) are
    never read."""
    rng = np.random.default_rng(9)
    t, n, p, used, r, d, o = 24, 32, 8, 5, 16, 128, 256
    active = np.zeros(p, np.int32)
    active[:used] = rng.choice(np.arange(1, n), size=used, replace=False)
    pos = rng.integers(-1, used, size=t).astype(np.int32)
    pos[:used] = np.arange(used)  # the contract: every position below the count used
    x = rng.standard_normal((t, d)).astype(np.float32)
    a = rng.standard_normal((n, r, d)).astype(np.float32) / np.sqrt(d)
    b = rng.standard_normal((n, r, o)).astype(np.float32) / np.sqrt(r)
    a[0] = b[0] = np.nan
    with jax.default_matmul_precision("highest"):
        got = np.asarray(indexed_lora(jnp.asarray(x), [(jnp.asarray(a), jnp.asarray(b))],
                                      jnp.asarray(pos), jnp.asarray(active),
                                      jnp.asarray([used], np.int32), interpret=True,
                                      precision="highest"))
    ref = _reference(x.astype(np.float64), [(a.astype(np.float64), b.astype(np.float64))],
                     active, pos)
    assert np.isfinite(got).all() and np.all(got[pos < 0] == 0)
    assert np.max(np.abs(got - ref)) / np.sqrt(np.mean(ref ** 2)) < 1e-5


def test_tile_runs_span_each_tiles_positions():
    """Each token tile's run: its lowest and highest position and the groups holding
    them, none for a tile of base tokens (checked against a loop over the tiles)."""
    rng = np.random.default_rng(3)
    tile, group = 128, 8
    _, pos = _step(rng, 1024, 128, 64, "runs")
    pos[256:384] = -1  # a tile of base tokens only
    lo, hi, first, number = map(np.asarray, tile_runs(jnp.asarray(pos), tile, group))
    for i, chunk in enumerate(pos.reshape(-1, tile)):
        used = chunk[chunk >= 0]
        if used.size == 0:
            assert number[i] == 0 and hi[i] == -1
            continue
        assert (lo[i], hi[i]) == (used.min(), used.max())
        assert (first[i], first[i] + number[i] - 1) == (used.min() // group, used.max() // group)
    # Sequence by sequence, a prefill tile fetches a few adapters, not the step's every one.
    assert (hi - lo + 1)[number > 0].sum() < (number > 0).sum() * (pos.max() + 1) / 2


@pytest.mark.parametrize("group,depth", [(1, 1), (2, 2), (4, 3), (2, 4)])
def test_indexed_kernel_group_and_depth(group, depth):
    """Any group size and any number of groups fetched ahead give the same delta: 11 of
    12 positions used (the last group partly), the unused slots NaN."""
    rng = np.random.default_rng(group * 10 + depth)
    t, n, p, used, r, d, outs = 20, 24, 12, 11, 8, 128, (128, 256)
    active = np.zeros(p, np.int32)  # the padding position names slot 0, NaN below
    active[:used] = rng.choice(np.arange(1, n), size=used, replace=False)
    pos = rng.integers(-1, used, size=t).astype(np.int32)
    pos[:used] = np.arange(used)  # the contract: every position below the count used
    x = rng.standard_normal((t, d)).astype(np.float32)
    weights = [(rng.standard_normal((n, r, d)).astype(np.float32) / np.sqrt(d),
                rng.standard_normal((n, r, o)).astype(np.float32) / np.sqrt(r)) for o in outs]
    for a, b in weights:
        a[sorted(set(range(n)) - set(active[:used].tolist()))] = np.nan
        b[sorted(set(range(n)) - set(active[:used].tolist()))] = np.nan
    with jax.default_matmul_precision("highest"):
        got = np.asarray(indexed_lora(jnp.asarray(x), [tuple(map(jnp.asarray, w)) for w in weights],
                                      jnp.asarray(pos), jnp.asarray(active),
                                      jnp.asarray([used], np.int32), group=group, depth=depth,
                                      interpret=True, precision="highest"))
    ref = _reference(x.astype(np.float64), [(a.astype(np.float64), b.astype(np.float64))
                                            for a, b in weights], active, pos)
    assert np.isfinite(got).all() and np.all(got[pos < 0] == 0)
    assert np.max(np.abs(got - ref)) / np.sqrt(np.mean(ref ** 2)) < 1e-5


def test_indexed_kernel_casts_float32_buffers_in_the_kernel():
    """bfloat16 activations over float32 slot buffers (lora_dtype float32 under a bf16
    model): the kernel takes the buffers as they are and casts each group it fetched."""
    rng = np.random.default_rng(6)
    t, n, p, r, d, o = 24, 16, 8, 16, 256, 384
    active, pos = _step(rng, t, n, p, "uniform")
    x = rng.standard_normal((t, d))
    a, b = rng.standard_normal((n, r, d)) / np.sqrt(d), rng.standard_normal((n, r, o)) / np.sqrt(r)
    jx = jnp.asarray(x, jnp.bfloat16)
    ja, jb = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    got = np.asarray(indexed_lora(jx, [(ja, jb)], jnp.asarray(pos), jnp.asarray(active),
                                  interpret=True).astype(jnp.float32))
    # The reference sees what the kernel multiplies: x and the weights in bfloat16.
    as64 = [np.asarray(v.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
            for v in (jx, ja, jb)]
    ref = _reference(as64[0], [(as64[1], as64[2])], active, pos)
    assert got.dtype == np.float32 and np.all(got[pos < 0] == 0)
    assert np.max(np.abs(got - ref)) / np.sqrt(np.mean(ref ** 2)) < 3e-2


def test_indexed_kernel_bfloat16():
    rng = np.random.default_rng(4)
    t, n, p, r, d, o = 48, 16, 8, 16, 256, 384
    active, pos = _step(rng, t, n, p, "uniform")
    x = rng.standard_normal((t, d))
    a, b = rng.standard_normal((n, r, d)) / np.sqrt(d), rng.standard_normal((n, r, o)) / np.sqrt(r)
    bf = [jnp.asarray(v, jnp.bfloat16) for v in (x, a, b)]
    got = np.asarray(indexed_lora(bf[0], [(bf[1], bf[2])], jnp.asarray(pos),
                                  jnp.asarray(active), interpret=True).astype(jnp.float32))
    as64 = [np.asarray(v.astype(jnp.float32), np.float64) for v in bf]
    ref = _reference(as64[0], [(as64[1], as64[2])], active, pos)
    assert np.max(np.abs(got - ref)) / np.sqrt(np.mean(ref ** 2)) < 3e-2


@pytest.mark.parametrize("seed", range(4))
def test_used_first_moves_used_positions_to_the_front(seed):
    """The kernel visits count positions: exactly the used ones, each token's new position
    naming the same device slot as before."""
    rng = np.random.default_rng(seed)
    t, n, p = int(rng.integers(1, 200)), 64, int(rng.choice([1, 4, 16, 32]))
    active, pos = _step(rng, t, n, p, ["uniform", "padded", "gaps", "all_base"][seed])
    slots, new_pos, count = (np.asarray(v) for v in used_first(jnp.asarray(pos),
                                                              jnp.asarray(active)))
    used = sorted(set(pos[pos >= 0].tolist()))
    assert int(count[0]) == len(used)
    assert slots.tolist()[:len(used)] == active[used].tolist()  # in their order
    assert np.array_equal(new_pos < 0, pos < 0)
    assert np.array_equal(slots[new_pos[pos >= 0]], active[pos[pos >= 0]])
    assert np.all(new_pos < max(1, len(used)))


def test_vmem_budget_lowers_depth_then_group_then_tile_then_refuses():
    assert token_tile(1) == 16 and token_tile(40) == 48 and token_tile(1000) == 128
    # Groups fill 128 lanes where the rank is whole sublane tiles; else one adapter.
    assert [max_group(r, 32, "bfloat16") for r in (8, 16, 64, 128)] == [1, 8, 2, 1]
    assert max_group(8, 32, "float32") == 16 and max_group(16, 4, "bfloat16") == 4
    assert vmem_bytes(128, 14336, (4096,), 16, "bfloat16", 8) <= VMEM_BUDGET_BYTES
    # Llama-3-8B's gate_up at rank 64: two groups of two 14336-wide B slices do not fit
    # beside the accumulators; the group goes to one adapter before the tile shrinks.
    assert vmem_bytes(128, 4096, (14336, 14336), 64, "bfloat16", 2) > VMEM_BUDGET_BYTES
    tile, group, depth = fitting_plan(128, 4096, (14336, 14336), 64, "bfloat16", 2, 4)
    assert depth == 2 and group == 1 and 16 <= tile <= 128
    assert vmem_bytes(tile, 4096, (14336, 14336), 64, "bfloat16", group,
                      depth) <= VMEM_BUDGET_BYTES
    # Llama-3.2-1B's qkv at decode keeps 3 groups in flight ahead of the one computing.
    assert fitting_plan(32, 2048, (2048, 512, 512), 16, "bfloat16", 8) == (32, 8, 4)
    # Rank 512 at Qwen2.5-7B's MLP width: B alone is 19 MB a buffer, no token tile fits;
    # refused, naming the shape (the one-hot and grouped paths tile O there).
    with pytest.raises(ValueError, match=r"indexed_lora: D=3584, outputs \(18944,\) at rank 512"):
        fitting_plan(128, 3584, (18944,), 512, "bfloat16")


# Llama-3-8B's linears at decode and prefill shapes: Mosaic's lowering accepts them.
LOWERED = [(16, 128, 16, 16, 4096, (4096, 1024, 1024)), (128, 128, 32, 64, 14336, (4096,)),
           (256, 32, 32, 16, 4096, (14336, 14336)), (64, 8, 8, 256, 3584, (18944,))]


@pytest.mark.parametrize("t,n,p,r,d,outs", LOWERED)
def test_indexed_kernel_lowers_for_tpu(t, n, p, r, d, outs):
    """Under x64 too, as the jax runtime traces it (torchax enables x64), with the host's
    count as the engine passes it: every constant the kernel compares stays int32."""
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((t, d), bf),
            [(jax.ShapeDtypeStruct((n, r, d), bf), jax.ShapeDtypeStruct((n, r, o), bf))
             for o in outs],
            jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((p,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    with enable_x64(True):
        exported = export_for_tpu(lambda x, w, ti, sl, c: indexed_lora(x, w, ti, sl, c), args)
    # The slot buffers stay in HBM (the operands after the slots, each tile's run (four
    # arrays), x and positions): the kernel fetches the step's slots itself, XLA may not
    # prefetch them all into VMEM.
    assert hbm_operands(exported) == [list(range(7, 7 + 2 * len(outs)))]
    assert "tpu_custom_call" in exported.mlir_module()


def test_indexed_kernel_takes_float32_buffers_uncast():
    """Lowered for a TPU with bfloat16 activations over float32 buffers: the Mosaic call
    reads the buffers themselves (float32 operands), no cast of every slot before it."""
    args = (jax.ShapeDtypeStruct((32, 512), jnp.bfloat16),
            [(jax.ShapeDtypeStruct((64, 16, 512), jnp.float32),
              jax.ShapeDtypeStruct((64, 16, 256), jnp.float32))],
            jax.ShapeDtypeStruct((32,), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    text = export_for_tpu(lambda x, w, ti, sl, c: indexed_lora(x, w, ti, sl, c),
                          args).mlir_module()
    call = next(line for line in text.splitlines() if "custom_call @tpu_custom_call" in line)
    assert "tensor<64x16x512xf32>, tensor<64x16x256xf32>) ->" in call
    assert "tensor<64x16x512xf32>) -> tensor<64x16x512xbf16>" not in text
