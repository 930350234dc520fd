"""A decoder layer's LoRA linears on a real TPU, composed as the engine composes them:
the Pallas path (lora_backend="pallas": per slice of a packed layer a gather into
segment order, the shrink and expand kernels, a scatter back) and the xla backend's
strategies on a TPU ("onehot": the step's S active slots' weights copied out, one
shrink over the slices' concatenated A, a [T, S] one-hot; "single": one adapter), next
to the base matmuls of the same linears, the fused grouped kernel
(ops/grouped_lora.py: tokens sorted by slot, slots grouped so their ranks fill 128 lanes,
shrink and expand in one kernel) and the indexed kernel (ops/indexed_lora.py: each used
adapter read at its slot by the kernel's DMA, shrink and expand fused, for decode-sized
steps). `--active` also measures steps that use fewer
adapters than the N slots. (Runs 4-6 in docs/results/tpu_lora_layer.jsonl also carry
"dense", a one-hot over all N slots per slice without the weight copy, which lost to
onehot at every point and left the engine.)

JAX only, like benchmarks/tpu_kernels.py (whose kernel loader and device timer it
uses); the compositions mirror ops/bgmv_pallas.py's and lora/punica.py's torch ops:

    python benchmarks/tpu_lora_layer.py                      # Mosaic on the chip
    python benchmarks/tpu_lora_layer.py --interpret --quick  # any host

Rows: part "layer_check" (every composition against a float64 reference, NaN in an
unused slot for the Pallas path), part "layer" (device ms per layer: base matmuls of
the four linears, each composition's LoRA delta, and base / (base + delta), the
linears-only ratio: attention and norms, which LoRA leaves alone, bring a model's
ratio closer to 1), each path's delta also against its roofline (part "roofline": the
chip's measured bf16 matmul rate and HBM bandwidth; a delta's roofline is its useful
FLOPs, 2*T*R*(D+O), or its bytes, the active adapters' A and B read once plus x read and
the delta written, whichever takes longer). `--profile-dir`: part "layer_profile" rows,
each path's device time per op (a jax.profiler trace of one dispatch per linear).
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
from tpu_kernels import _device_ms, load_kernels, load_torch_free
from tpu_kernels import emit as print_row

_OUT: list[str] = []  # --out: the file rows are appended to


def emit(row: dict) -> None:
    print_row(row)
    for path in _OUT:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

# Llama-3-8B's LoRA linears: (name, in_features, output slices).
LLAMA3_8B = (("qkv_proj", 4096, (4096, 1024, 1024)), ("o_proj", 4096, (4096,)),
             ("gate_up_proj", 4096, (14336, 14336)), ("down_proj", 14336, (4096,)))
QUICK = (("qkv_proj", 256, (256, 128, 128)), ("down_proj", 384, (256,)))


def step_arrays(jnp, token_slot, n, block):
    """The engine's own step arrays (lora/step_layout.py), on the device, for tokens on
    device slots 0..n-1 (-1: base model): the Pallas path's segment layout, single's
    token_slot and onehot's token_lora_idx / active_slots."""
    step_layout, slots = load_torch_free("lora.step_layout"), list(range(n))
    arrays = {**step_layout.segment_layout(token_slot, slots, n, block),
              **step_layout.token_slot_layout(token_slot, slots),
              **step_layout.onehot_layout(token_slot, slots, n)}
    out = {k: jnp.asarray(v) for k, v in arrays.items()}
    out["token_slot"] = jnp.asarray(token_slot, jnp.int32)
    out["active_count"] = jnp.asarray([n], jnp.int32)  # positions 0..n-1 (some maybe unused)
    out["plan"] = None  # built by with_plan once the rank is known
    return out


def with_plan(jnp, lay, n, r):
    """lay plus the grouped kernel's plan for N slots of rank r (once per step)."""
    g = load_torch_free("ops.grouped_lora")
    t = lay["token_slot"].shape[0]
    plan = g.group_plan(lay["token_slot"], n, g.slots_per_group(n, r), g.token_tile(t))
    return {**lay, "plan": plan}


def compositions(pk, jnp, block, interpret, precision="default"):
    shrink = functools.partial(pk.shrink_kernel, block=block, interpret=interpret,
                               precision=precision)
    expand = functools.partial(pk.expand_kernel, block=block, interpret=interpret,
                               precision=precision)

    def scatter(y, zs, dest, valid, offset):
        delta = jnp.where(valid[:, None], zs[dest], 0).astype(y.dtype)
        return y.at[:, offset: offset + zs.shape[1]].add(delta)

    def per_slice(x, y, lay, a_s, b_s):
        # bgmv_pallas.segment_shrink's scale (ones: scales are folded into B) and row
        # mask, then the expand and bgmv_xla.scatter_back, per slice.
        perm, dest, valid, slots = lay["perm"], lay["dest"], lay["token_valid"], lay["block_slot"]
        offset = 0
        ones = jnp.ones(a_s[0].shape[0], jnp.float32)
        for a, b in zip(a_s, b_s):
            ys = shrink(slots, x[perm], a)
            scale = jnp.repeat(ones[jnp.maximum(slots, 0)], block)[:, None]
            ys = jnp.where(lay["row_valid"][:, None], ys.astype(jnp.float32) * scale, 0)
            ys = ys.astype(x.dtype)
            y = scatter(y, expand(slots, ys, b), dest, valid, offset)
            offset += b.shape[1]
        return y

    def take(w, slots):
        """The single strategy's read on a TPU: the slot as a dynamic slice (a gather over
        the slot axis reads every slot there)."""
        import jax

        return jnp.concatenate([jax.lax.dynamic_index_in_dim(w, slots[i], 0)
                                for i in range(slots.shape[0])])

    def copy_out(ws, slots):
        """The onehot strategy's copy on a TPU since 2026-12-07 (ops.take_slots "dma"):
        the slots of each buffer copied by one DMA kernel, side by side (rows before
        that date used dynamic slices, `take`)."""
        return load_torch_free("ops.slot_copy").take_slots_dma(list(ws), slots,
                                                              interpret=interpret)

    def single(x, y, lay, a_s, bt_s):
        """S = 1 on a TPU (PunicaWrapper._single_slot_linear): the step's one adapter's
        A of every slice concatenated (rank-first, as a TPU holds it), one shrink, an
        expand per slice, masked."""
        slot = lay["active_slots"][:1]
        a = jnp.concatenate([take(a, slot)[0] for a in a_s], axis=0)  # [n*R, D]
        xa, rank = x @ a.T, a_s[0].shape[1]
        deltas = [xa[:, i * rank:(i + 1) * rank] @ take(bt, slot)[0]
                  for i, bt in enumerate(bt_s)]
        delta = jnp.concatenate(deltas, axis=1)
        return y + jnp.where(lay["token_valid"][:, None], delta, 0).astype(y.dtype)

    def onehot(x, y, lay, a_s, bt_s, by_input=False):
        """The xla backend's "onehot" strategy (PunicaWrapper._onehot_linear): the step's
        S active slots' weights copied out (by DMA, `copy_out`, as the engine does on a
        TPU), every token times all S, a [T, S] one-hot keeping its own.
        A rank-first [N, R, D] as a TPU engine holds it; by_input: [N, D, R], the CPU's
        layout (the engines before 2026-12-07 on a TPU too), whose minor rank axis a TPU
        pads to 128 lanes, read by a gather (jnp.take) as the engine read it then."""
        active = lay["active_slots"]
        rank = a_s[0].shape[2 if by_input else 1]
        hit = lay["token_lora_idx"][:, None] == jnp.arange(active.shape[0])[None, :]
        if by_input:
            a = jnp.concatenate([at[active] for at in a_s], axis=2)  # [S, D, n*R]
            xa = jnp.einsum("td,sdr->tsr", x, a)
        else:
            a = copy_out(a_s, active)  # [S, n*R, D]
            xa = jnp.einsum("td,srd->tsr", x, a)
        xa = xa * hit[:, :, None].astype(x.dtype)
        deltas = [xa[:, :, i * rank:(i + 1) * rank].reshape(x.shape[0], -1)
                  @ (bt[active] if by_input else copy_out([bt], active)).reshape(-1, bt.shape[2])
                  for i, bt in enumerate(bt_s)]
        return y + jnp.concatenate(deltas, axis=1).astype(y.dtype)

    def stacked(x, y, lay, a_s, bt_s):
        """PunicaWrapper._stacked_linear, a TPU graph whose bucket is every slot: each
        token's device slot one-hot over all N, the buffers as they lie (no copy), one
        shrink per slice."""
        hit = lay["token_slot"][:, None] == jnp.arange(a_s[0].shape[0])[None, :]
        deltas = [jnp.einsum("tnr,nro->to",
                             jnp.einsum("td,nrd->tnr", x, a) * hit[:, :, None].astype(x.dtype),
                             bt) for a, bt in zip(a_s, bt_s)]
        return y + jnp.concatenate(deltas, axis=1).astype(y.dtype)

    grouped_lora = load_torch_free("ops.grouped_lora").grouped_lora

    def grouped(x, y, lay, a_s, bt_s):
        """ops/grouped_lora.py: A [N, R, D] and B rank-first [N, R, O] as the slot
        buffers would hold them; the plan (sort, work list) built once per step."""
        delta = grouped_lora(x, list(zip(a_s, bt_s)), lay["token_slot"], plan=lay["plan"],
                             interpret=interpret, precision=precision)
        return y + delta.astype(y.dtype)

    indexed_lora = load_torch_free("ops.indexed_lora").indexed_lora

    def indexed(x, y, lay, a_s, bt_s):
        """ops/indexed_lora.py: onehot's step arrays and the count of the step's adapters
        (as the engine passes them), each adapter's A and B (rank-first) read at its slot
        by the kernel's own DMA, no copy."""
        delta = indexed_lora(x, list(zip(a_s, bt_s)), lay["token_lora_idx"],
                             lay["active_slots"], lay["active_count"], interpret=interpret,
                             precision=precision)
        return y + delta.astype(y.dtype)

    return {"per_slice": per_slice, "single": single, "onehot": onehot, "stacked": stacked,
            "onehot_by_input": functools.partial(onehot, by_input=True), "grouped": grouped,
            "indexed": indexed}


def make_adapters(jnp, rng, n, d, sizes, r, jt, nan_slot=None):
    a_s = [rng.standard_normal((n, r, d)) / np.sqrt(d) for _ in sizes]
    b_s = [rng.standard_normal((n, o, r)) / np.sqrt(r) for o in sizes]
    if nan_slot is not None:
        for w in (*a_s, *b_s):
            w[nan_slot] = np.nan
    return [jnp.asarray(w, jt) for w in a_s], [jnp.asarray(w, jt) for w in b_s]


def transposed(jnp, a_s, b_s, nan_slot=None):
    """A as [N, D, R] and B as [N, R, O] (the xla backend's slot layout); a NaN slot's
    weights are zeroed there, as the one-hot products would spread them (the engine's
    slot buffers hold only finite values: unused slots are zero)."""
    at_s = [jnp.swapaxes(a, 1, 2) for a in a_s]
    bt_s = [jnp.swapaxes(b, 1, 2) for b in b_s]
    if nan_slot is not None:
        at_s = [w.at[nan_slot].set(0) for w in at_s]
        bt_s = [w.at[nan_slot].set(0) for w in bt_s]
    return at_s, bt_s


def jax_precision(precision):
    import jax

    return jax.default_matmul_precision({"default": "bfloat16", "highest": "float32"}[precision])


def layer_check(pk, bs, jnp, linears, t, n, r, dtype, interpret):
    """Per-slice (Pallas path) and onehot deltas of every linear (and single's, when one
    adapter is in play) against float64 numpy."""
    rng = np.random.default_rng(t + n)
    jt = jnp.dtype(dtype)
    block = bs.token_block(dtype, "pallas", t, n)
    used = [s for s in range(n) if s != 1] if n > 1 else [0]
    token_slot = rng.choice(used + [-1], size=t).astype(np.int32)  # -1: base-model tokens
    lay = with_plan(jnp, step_arrays(jnp, token_slot, n, block), n, r)
    precision = "highest" if dtype == "float32" else "default"
    comps = compositions(pk, jnp, block, interpret, precision)
    per_slice = comps.pop("per_slice")
    kernels = {k: comps.pop(k) for k in ("grouped", "indexed")}
    xla_paths = {k: fn for k, fn in comps.items() if k != "single" or len(used) == 1}
    nan_slot = 1 if n > 1 else None  # unused by every token: NaN there must not leak
    for name, d, sizes in linears:
        a_s, b_s = make_adapters(jnp, rng, n, d, sizes, r, jt, nan_slot)
        x = jnp.asarray(rng.standard_normal((t, d)), jt)
        y = jnp.zeros((t, sum(sizes)), jt)
        got = {"per_slice": np.asarray(per_slice(x, y, lay, a_s, b_s).astype(jnp.float32),
                                       np.float64)}
        at_s, bt_s = transposed(jnp, a_s, b_s, nan_slot)
        # The grouped kernel reads A as given (NaN in the unused slot: dropped by its
        # select) and B rank-first with that slot zeroed (the engine's free slots); the
        # indexed kernel never reads the unused slot.
        for what, fn in kernels.items():
            got[what] = np.asarray(fn(x, y, lay, a_s, bt_s).astype(jnp.float32), np.float64)
        with jax_precision(precision):
            a_zeroed = [jnp.swapaxes(at, 1, 2) for at in at_s]  # rank-first, NaN slot zeroed
            for what, fn in xla_paths.items():
                a = at_s if what == "onehot_by_input" else a_zeroed
                got[what] = np.asarray(fn(x, y, lay, a, bt_s).astype(jnp.float32), np.float64)
        x64 = np.asarray(x.astype(jnp.float32), np.float64)
        ref = np.zeros_like(got["per_slice"])
        for s in set(token_slot.tolist()) - {-1}:  # each slot's weights fetched once
            rows = token_slot == s
            ref[rows] = np.concatenate([
                x64[rows] @ np.asarray(a[s].astype(jnp.float32), np.float64).T
                @ np.asarray(b[s].astype(jnp.float32), np.float64).T
                for a, b in zip(a_s, b_s)], axis=1)
        rms = float(np.sqrt(np.mean(ref ** 2))) or 1.0
        errs = {what: float(np.max(np.abs(g - ref))) / rms for what, g in got.items()}
        base_rows_zero = all(bool(np.all(g[token_slot < 0] == 0)) for g in got.values())
        finite = all(bool(np.isfinite(g).all()) for g in got.values())
        tol = 1e-4 if dtype == "float32" else 4e-2
        emit(dict(part="layer_check", linear=name, T=t, N=n, R=r, dtype=dtype, block=block,
                  **{f"{what}_rel_err": err for what, err in errs.items()},
                  base_rows_zero=base_rows_zero, finite=finite,
                  ok=bool(max(errs.values()) < tol and base_rows_zero and finite)))


def step_tokens(rng, t, active, sequence_tokens):
    """Each token's adapter (0..active-1). One token a sequence (a decode step): drawn at
    random. Longer sequences (a prefill): sequence i's `sequence_tokens` tokens in a row
    on adapter i % active, numbered as met, as the engine's host lays a step out."""
    if sequence_tokens <= 1:
        return rng.integers(0, active, size=t).astype(np.int32)
    seqs = -(-t // sequence_tokens)
    return np.repeat(np.arange(seqs) % active, sequence_tokens)[:t].astype(np.int32)


def layer_bench(pk, bs, jax, jnp, linears, t, n, active, r, dtype, k_max, reps, interpret,
                chip, wanted=("per_slice", "onehot", "grouped", "single"), profile_dir=None,
                sequence_tokens=1):
    """N device slots, `active` of them used by this step's tokens (what the Pallas
    path's layout and onehot's graph bucket are sized by)."""
    rng = np.random.default_rng(0)
    jt = jnp.dtype(dtype)
    block = bs.token_block(dtype, "pallas", t, active)
    token_slot = step_tokens(rng, t, active, sequence_tokens)  # every token on an adapter
    lay = with_plan(jnp, step_arrays(jnp, token_slot, active, block), n, r)
    comps = compositions(pk, jnp, block, interpret)
    xla = load_torch_free("lora.step_layout").xla_strategy(t, active, n, on_tpu=True, rank=r)
    row = dict(part="layer", T=t, N=n, active=active, R=r, dtype=dtype, block=block,
               xla_strategy=xla, sequence_tokens=sequence_tokens,
               adapters_used=len(set(token_slot.tolist())))
    paths = tuple(p for p in ("per_slice", "onehot", "stacked", "onehot_by_input", "grouped",
                              "indexed")
                  if p in wanted) + (
        ("single",) if active == 1 and "single" in wanted else ())
    totals = dict.fromkeys(("base", "roofline") + paths, 0.0)
    profiles: dict[str, dict[str, float]] = {}
    for name, d, sizes in linears:
        a_s, b_s = make_adapters(jnp, rng, n, d, sizes, r, jt)
        at_s, bt_s = transposed(jnp, a_s, b_s)
        w = jnp.asarray(rng.standard_normal((d, sum(sizes))) / np.sqrt(d), jt)
        k = int(max(4, min(k_max, (1 << 30) // (t * (d + sum(sizes)) * jt.itemsize))))
        xs = jnp.asarray(rng.standard_normal((k, t, d)), jt)
        # The base output and the layout are arguments, not constants XLA could fold.
        y0 = jnp.asarray(rng.standard_normal((t, sum(sizes))), jt)
        fns = {"base": (lambda x, w: x @ w, (w,)),
               **{k: (fn, (y0, lay, a_s, b_s) if k == "per_slice" else
                      (y0, lay, at_s, bt_s) if k == "onehot_by_input" else (y0, lay, a_s, bt_s))
                  for k, fn in comps.items()}}
        o = sum(sizes)
        roof = roofline_ms(chip, t, d, o, r, row["adapters_used"], jt.itemsize)
        row[f"{name}_roofline_ms"] = round(roof, 4)
        totals["roofline"] += roof
        for what in ("base",) + paths:
            fn, rest = fns[what]
            ms = _device_ms(jax, fn, xs, rest, reps)
            row[f"{name}_{what}_ms"] = round(ms, 4)
            totals[what] += ms
            if profile_dir:
                for op, us in _profile_ops(jax, fn, xs, rest, profile_dir).items():
                    profiles.setdefault(what, {}).setdefault(op, 0.0)
                    profiles[what][op] += us
    for what, ms in totals.items():
        row[f"layer_{what}_ms"] = round(ms, 4)
    for what in paths:
        row[f"ratio_{what}"] = round(totals["base"] / (totals["base"] + totals[what]), 3)
        row[f"{what}_vs_roofline"] = round(totals[what] / totals["roofline"], 2)
    for what in ("grouped", "indexed", "stacked"):
        if what in totals and "onehot" in totals:
            row[f"{what}_vs_onehot"] = round(totals[what] / totals["onehot"], 3)
    if "onehot_by_input" in totals and "onehot" in totals:
        row["onehot_vs_by_input"] = round(totals["onehot"] / totals["onehot_by_input"], 3)
    emit(row)
    for what, ops in profiles.items():
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
        emit(dict(part="layer_profile", T=t, N=n, active=active, R=r, path=what,
                  device_us=round(sum(ops.values()), 1), ops_us={k: round(v, 1) for k, v in top}))


def _profile_ops(jax, fn, xs, rest, trace_dir) -> dict[str, float]:
    """Device microseconds per call of fn by op (summed over the ops of one name), from a
    jax.profiler trace of one dispatch of the same lax.map loop _device_ms times."""
    import os
    import tempfile

    from profile_step import device_ops, perfetto_events

    many = jax.jit(lambda st, *w: jax.lax.map(lambda x: fn(x, *w), st))
    jax.block_until_ready(many(xs, *rest))
    os.makedirs(trace_dir, exist_ok=True)
    log_dir = tempfile.mkdtemp(dir=trace_dir)
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(many(xs, *rest))
    _, by_module = device_ops(perfetto_events(log_dir))
    ops: dict[str, float] = {}
    for entries in by_module.values():
        for op, dur, _ in entries:
            ops[op] = ops.get(op, 0.0) + dur / xs.shape[0]
    return ops


def roofline_ms(chip, t, d, o, r, active, itemsize) -> float:
    """The delta's least time: useful FLOPs at the measured matmul rate, or its bytes
    (active adapters' weights once, x in, delta out) at the measured bandwidth."""
    flops = 2 * t * r * (d + o)
    nbytes = (active * r * (d + o) + t * (d + o)) * itemsize
    return 1e3 * max(flops / chip["flops_per_s"], nbytes / chip["bytes_per_s"])


def chip_rates(jax, jnp, interpret: bool) -> dict:
    """Measured bf16 matmul FLOP/s (an 8192^3 product; 1024^3 under --interpret) and HBM
    bytes/s (x + 1 over four [n, n] inputs, each read and written once). The first runs
    took one flat 512 MiB vector per dispatch and measured 261 GB/s, under what onehot's
    own weight reads then achieved: a 1-D array and one call per sync undercount."""
    n = 1024 if interpret else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    ms = _device_ms(jax, lambda x, b: x @ b, a[None], (a,), 5)
    big = jnp.ones((4, n, n), jnp.bfloat16)
    copy_ms = _device_ms(jax, lambda x: x + 1, big, (), 5)
    return {"flops_per_s": 2 * n ** 3 / (ms / 1e3),
            "bytes_per_s": 2 * n * n * 2 / (copy_ms / 1e3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="check,bench")
    p.add_argument("--out", default=None, help="append the JSON rows to this file too")
    p.add_argument("--paths", nargs="+",
                   default=["per_slice", "onehot", "stacked", "onehot_by_input", "grouped",
                            "indexed", "single"],
                   help="the LoRA compositions to bench (the base matmuls always)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (no TPU)")
    p.add_argument("--quick", action="store_true", help="tiny shapes only (a smoke run)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--slots", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--active", type=int, nargs="+", default=[],
                   help="also bench steps using only this many of the N slots (use slot "
                   "buckets, 1 2 4 8 ...: the engine pads a step's adapters to one)")
    p.add_argument("--ranks", type=int, nargs="+", default=[16], help="of the checks and the bench")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--k", type=int, default=32, help="most inputs per dispatch")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sequence-tokens", type=int, default=1,
                   help="tokens a sequence: 1 = a decode step (adapters drawn per token); "
                   "more = a prefill, each sequence's tokens in a row on one adapter")
    p.add_argument("--profile-dir", default=None,
                   help="also trace each path once per linear and emit its device time by op")
    args = p.parse_args(argv)
    _OUT[:] = [args.out] if args.out else []
    import jax
    import jax.numpy as jnp

    pk, bs = load_kernels()
    dev = jax.devices()[0]
    emit(dict(part="env", jax=jax.__version__, device=str(dev.device_kind),
              platform=dev.platform, interpret=args.interpret))
    linears = QUICK if args.quick else LLAMA3_8B
    parts = args.parts.split(",")
    if "check" in parts:
        for r in args.ranks:
            for t, n in (((24, 3),) if args.quick else ((16, 1), (48, 4), (300, 8))):
                for dtype in ("float32", "bfloat16"):
                    layer_check(pk, bs, jnp, linears, t, n, r, dtype, args.interpret)
    if "bench" in parts:
        chip = chip_rates(jax, jnp, args.interpret)
        emit(dict(part="roofline", matmul_tflops=round(chip["flops_per_s"] / 1e12, 1),
                  hbm_gb_per_s=round(chip["bytes_per_s"] / 1e9, 1)))
        grid = [(16, 2, a, 16) for a in (2, 1)] if args.quick else [
            (t, n, a, r) for r in args.ranks for t in args.tokens for n in args.slots
            for a in sorted({n, *(a for a in args.active if a < n)}, reverse=True)]
        for t, n, a, r in grid:
            layer_bench(pk, bs, jax, jnp, linears, t, n, a, r, args.dtype, args.k, args.reps,
                        args.interpret, chip, args.paths, args.profile_dir,
                        args.sequence_tokens)


if __name__ == "__main__":
    main()
