"""The LoRA Pallas kernels on a real TPU: Mosaic compile, VMEM, correctness, speed.

JAX only (no torch, no torch_xla), so it runs on a TPU host that has nothing but JAX:

    python benchmarks/tpu_kernels.py                     # all parts, Mosaic on the chip
    python benchmarks/tpu_kernels.py --parts check       # some parts (check,vmem,bench,blocks)
    python benchmarks/tpu_kernels.py --interpret --quick # any host: Pallas interpreter

Prints one JSON row per measurement:
- check: shrink/expand on skewed segment layouts (an unused slot full of NaN, padding
  blocks) against a float64 numpy reference; max error relative to the reference's RMS.
- vmem: every (op, width, rank, dtype, token block) of a set of real model widths
  compiled by Mosaic with the blocks `block_sizes.kernel_blocks` picks (so the VMEM
  estimate's explicit limits are exercised), plus a probe: the largest legal tile under
  Mosaic's default limit, whether or not the estimate allowed it (how conservative
  ops/vmem.py is).
- bench: one LoRA linear's delta (shrink + expand) per strategy against the base
  matmul of the same linear, device time per call (k distinct inputs per dispatch).
- blocks: the Pallas delta per token block B (the table's block for the dtype, then
  2x, 4x and 8x it) over a grid of step sizes (--block-* flags).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np


def load_torch_free(module: str):
    """vllm_tpu_lora.<module> (a torch-free one: the kernels, block sizes, the step
    layout) without the package __init__s (they import torch, which a JAX-only TPU host
    lacks)."""
    root = Path(__file__).resolve().parents[1] / "vllm_tpu_lora"
    for name, path in (("vllm_tpu_lora", root), ("vllm_tpu_lora.ops", root / "ops"),
                       ("vllm_tpu_lora.lora", root / "lora")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
    return importlib.import_module(f"vllm_tpu_lora.{module}")


def load_kernels():
    """ops/pallas_kernels.py and ops/block_sizes.py, torch-free."""
    return load_torch_free("ops.pallas_kernels"), load_torch_free("ops.block_sizes")


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# ---- inputs -------------------------------------------------------------------------


def segment_case(bs, rng, t, n, block, skew=True):
    """A segment layout in numpy: per-slot token counts (slot 1 unused when n > 1, so
    its weights may be NaN), each run padded to `block`, trailing padding blocks -1.
    Returns (block_slot int32 [T_pad/B], row_slot int32 [T_pad] (-1: padding block),
    group_sizes int32 [n] (padded rows per slot))."""
    weights = rng.dirichlet(np.full(n, 0.3 if skew else 5.0))
    if n > 1:
        weights[1] = 0.0
        weights /= weights.sum()
    counts = rng.multinomial(t, weights)
    padded = -(-counts // block) * block
    row_slot = np.full(bs.padded_num_tokens(t, n, block), -1, np.int32)
    row_slot[: padded.sum()] = np.repeat(np.arange(n, dtype=np.int32), padded)
    return row_slot[::block].copy(), row_slot, padded.astype(np.int32)


def _rel_err(got, ref) -> float:
    rms = float(np.sqrt(np.mean(ref**2))) or 1.0
    return float(np.max(np.abs(got.astype(np.float64) - ref))) / rms


# ---- check ----------------------------------------------------------------------------

# Max |err| / RMS(ref), keyed by (activation dtype, precision). On a TPU a float32
# product at "default" precision is one bfloat16 pass (~1e-2); "highest" is float32.
# 16-bit outputs carry 8 (bf16) / 11 (f16, computed in f32) mantissa bits.
CHECK_TOL = {("float32", "default"): 3e-2, ("float32", "highest"): 1e-4,
             ("bfloat16", "default"): 4e-2, ("float16", "default"): 3e-2,
             ("float16", "highest"): 5e-3}


def check(pk, bs, jnp, cases, interpret):
    for case in cases:
        try:
            check_one(pk, bs, jnp, *case, interpret)
        except Exception as e:  # one unsupported shape/dtype must not hide the others
            emit(dict(part="check", case=list(case), ok=False,
                      error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))


def check_one(pk, bs, jnp, t, n, d, o, r, dtype, precision, interpret):
    """What the torch wrappers do: inputs in the kernels' compute dtype (float16 runs
    in float32), outputs cast back to the activation dtype."""
    rng = np.random.default_rng(t * 7 + n * 13 + r)
    block = bs.token_block(dtype, "pallas", t, n)  # the block the engine runs this step with
    block_slot, row_slot, _ = segment_case(bs, rng, t, n, block)
    t_pad = row_slot.size
    jt, act = jnp.dtype(bs.pallas_compute_dtype(dtype)), jnp.dtype(dtype)
    xs = jnp.asarray(rng.standard_normal((t_pad, d)), act).astype(jt)
    a = rng.standard_normal((n, r, d)) / np.sqrt(d)
    b = rng.standard_normal((n, o, r)) / np.sqrt(r)
    if n > 1:  # the unused slot: never read, so NaN must not leak
        a[1], b[1] = np.nan, np.nan
    a, b = jnp.asarray(a, act).astype(jt), jnp.asarray(b, act).astype(jt)
    slots = jnp.asarray(block_slot)
    t0 = time.perf_counter()
    ys = pk.shrink_kernel(slots, xs, a, block=block, interpret=interpret, precision=precision)
    ys = ys.astype(act).astype(jt)
    zs = pk.expand_kernel(slots, ys, b, block=block, interpret=interpret, precision=precision)
    zs = zs.astype(act)
    zs.block_until_ready()
    wall = time.perf_counter() - t0
    x64, a64, b64 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (xs, a, b))
    y64 = np.asarray(ys.astype(jnp.float32), np.float64)
    valid = row_slot >= 0
    ref_y = np.zeros((t_pad, r))
    ref_z = np.zeros((t_pad, o))
    for s in np.unique(row_slot[valid]):
        rows = row_slot == s
        ref_y[rows] = x64[rows] @ a64[s].T
        ref_z[rows] = y64[rows] @ b64[s].T  # expand checked on the kernel's own ys
    got_y = np.asarray(ys.astype(jnp.float32))
    got_z = np.asarray(zs.astype(jnp.float32))
    err_y, err_z = _rel_err(got_y, ref_y), _rel_err(got_z, ref_z)
    pad_zero = bool(np.all(got_y[~valid] == 0) and np.all(got_z[~valid] == 0))
    finite = bool(np.isfinite(got_y).all() and np.isfinite(got_z).all())
    tol = CHECK_TOL[(dtype, precision)]
    emit(dict(part="check", T=t, N=n, D=d, O=o, R=r, dtype=dtype, compute_dtype=str(jt),
              precision=precision, block=block,
              shrink_tile=bs.kernel_blocks("shrink", d, r, dtype, block).feature_block,
              expand_tile=bs.kernel_blocks("expand", o, r, dtype, block).feature_block,
              shrink_rel_err=err_y, expand_rel_err=err_z, padding_zero=pad_zero,
              finite=finite, first_call_s=round(wall, 3),
              ok=bool(err_y < tol and err_z < tol and pad_zero and finite)))


# ---- vmem -----------------------------------------------------------------------------


def _compile(jax, fn, args) -> tuple[bool, str]:
    try:
        jax.jit(fn).lower(*args).compile()
        return True, ""
    except Exception as e:  # Mosaic's refusals come as several exception types
        return False, f"{type(e).__name__}: {' | '.join(str(e).splitlines()[:6])[:600]}"


def vmem_sweep(pk, bs, jax, jnp, widths, ranks, dtypes, which_blocks, t=256, n=4):
    """which_blocks: "base" (each dtype's base token block), "step" (the larger blocks
    of steps with many rows per adapter) or "all"."""
    from vllm_tpu_lora.ops import vmem

    def token_blocks(dtype):
        blocks, base = bs.pallas_token_blocks(dtype), bs.token_block(dtype, "pallas")
        return {"base": [base], "step": [b for b in blocks if b != base],
                "all": list(blocks)}[which_blocks]

    for op in ("shrink", "expand"):
        for f in widths:
            for r in ranks:
                for dtype, block in [(dt, b) for dt in dtypes for b in token_blocks(dt)]:
                    kb = bs.kernel_blocks(op, f, r, dtype, block)
                    t_pad = bs.padded_num_tokens(t, n, kb.token_block)
                    jt = jnp.dtype(dtype)
                    slots = jax.ShapeDtypeStruct((t_pad // kb.token_block,), jnp.int32)
                    if op == "shrink":
                        args = (slots, jax.ShapeDtypeStruct((t_pad, f), jt),
                                jax.ShapeDtypeStruct((n, r, f), jt))
                        call, tile_kw = pk.shrink_pallas_call, "block_d"
                    else:
                        args = (slots, jax.ShapeDtypeStruct((t_pad, r), jt),
                                jax.ShapeDtypeStruct((n, f, r), jt))
                        call, tile_kw = pk.expand_pallas_call, "block_o"
                    refused = kb.vmem_limit_bytes is not None and (
                        vmem.required_limit_bytes(kb.vmem_bytes) > vmem.VMEM_LIMIT_CEILING_BYTES)
                    row = dict(part="vmem", op=op, features=f, R=r, dtype=dtype,
                               block=kb.token_block, tile=kb.feature_block,
                               estimate_mib=round(kb.vmem_bytes / vmem.MiB, 2),
                               limit_mib=(kb.vmem_limit_bytes or 0) // vmem.MiB or None,
                               refused_at_startup=refused)
                    if not refused:
                        kernel = functools.partial(call, block=kb.token_block, interpret=False,
                                                   vmem_limit_bytes=kb.vmem_limit_bytes,
                                                   **{tile_kw: kb.feature_block})
                        row["compiles"], row["error"] = _compile(jax, kernel, args)
                    largest = bs.legal_feature_tiles(f, dtype)[0]
                    if largest != kb.feature_block or kb.vmem_limit_bytes is not None:
                        est = vmem.kernel_vmem_bytes(op, kb.token_block, largest, r, dtype)
                        probe = functools.partial(call, block=kb.token_block, interpret=False,
                                                  **{tile_kw: largest})
                        ok, err = _compile(jax, probe, args)
                        row.update(probe_tile=largest, probe_estimate_mib=round(est / vmem.MiB, 2),
                                   probe_default_limit_compiles=ok, probe_error=err)
                    emit(row)


# ---- bench ----------------------------------------------------------------------------


def _device_ms(jax, fn, stacked, rest, reps):
    """Median ms per call of fn over `reps` dispatches, each mapping fn over the k
    stacked inputs on the device (lax.map: a loop inside one graph), so the host's
    dispatch and sync cost is paid once per k calls, and distinct inputs keep XLA from
    merging them."""
    many = jax.jit(lambda st, *w: jax.lax.map(lambda x: fn(x, *w), st))
    jax.block_until_ready(many(stacked, *rest))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(many(stacked, *rest))
        times.append((time.perf_counter() - t0) * 1e3 / stacked.shape[0])
    return statistics.median(times)


def _stack_size(rows, d, o, itemsize, k_max):
    """Inputs per dispatch: up to k_max, with inputs and outputs under ~2 GB."""
    return int(max(4, min(k_max, (2 << 30) // (rows * (d + o) * itemsize))))


def _stacked_inputs(jnp, rng, t_pad, n, d, o, r, jt, k_max):
    """k stacked activations [k, T_pad, D] (k from _stack_size) and one adapter set:
    A [N, R, D], B [N, O, R], scaled so every product is O(1)."""
    k = _stack_size(t_pad, d, o, jt.itemsize, k_max)
    xs = jnp.asarray(rng.standard_normal((k, t_pad, d)), jt)
    a = jnp.asarray(rng.standard_normal((n, r, d)) / np.sqrt(d), jt)
    b = jnp.asarray(rng.standard_normal((n, o, r)) / np.sqrt(r), jt)
    return xs, a, b


def _strategies(pk, jax, jnp, block, n, r, interpret):
    """One LoRA linear's delta, four ways, on segment-ordered rows; and the base matmul."""

    def pallas(x, s, a, b, precision="default"):
        ys = pk.shrink_kernel(s, x, a, block=block, interpret=interpret, precision=precision)
        return pk.expand_kernel(s, ys, b, block=block, interpret=interpret, precision=precision)

    def ragged(x, g, a_t, b_t):  # XLA's grouped matmul over the same segments
        ys = jax.lax.ragged_dot(x, a_t, g, preferred_element_type=jnp.float32).astype(x.dtype)
        return jax.lax.ragged_dot(ys, b_t, g, preferred_element_type=jnp.float32).astype(x.dtype)

    def onehot_fn(x, m, a_flat, b_flat):  # the xla backend's one-hot: N-fold FLOPs
        h = (x @ a_flat.T).reshape(x.shape[0], n, r) * m[:, :, None]
        return h.reshape(x.shape[0], n * r) @ b_flat

    def gathered(x, rs, a, b):  # per-row weight gather: T*R*(D+O) weight reads
        sl = jnp.maximum(rs, 0)
        ys = jnp.einsum("td,trd->tr", x, a[sl], preferred_element_type=jnp.float32)
        return jnp.einsum("tr,tor->to", ys.astype(x.dtype), b[sl])

    def base(x, w):
        return x @ w

    return pallas, ragged, onehot_fn, gathered, base


def bench(pk, bs, jax, jnp, configs, k_max, reps, interpret):
    for t, n, d, o, r, dtype in configs:
        rng = np.random.default_rng(0)
        block = bs.token_block(dtype, "pallas", t, n)
        block_slot, row_slot, groups = segment_case(bs, rng, t, n, block)
        t_pad, jt = row_slot.size, jnp.dtype(dtype)
        xs, a, b = _stacked_inputs(jnp, rng, t_pad, n, d, o, r, jt, k_max)
        k = xs.shape[0]
        w = jnp.asarray(rng.standard_normal((d, o)) / np.sqrt(d), jt)
        slots, rows, gs = jnp.asarray(block_slot), jnp.asarray(row_slot), jnp.asarray(groups)
        a_t, b_t = jnp.swapaxes(a, 1, 2), jnp.swapaxes(b, 1, 2)  # [N, D, R], [N, R, O]
        a_flat = a.reshape(n * r, d)
        b_flat = b_t.reshape(n * r, o)
        onehot = (rows[:, None] == jnp.arange(n)[None, :]).astype(jt)  # [T_pad, N]

        pallas, ragged, onehot_fn, gathered, base = _strategies(pk, jax, jnp, block, n, r,
                                                                interpret)
        methods = {"base_matmul": (base, (w,)), "pallas": (pallas, (slots, a, b)),
                   "ragged_dot": (ragged, (gs, a_t, b_t)),
                   "onehot": (onehot_fn, (onehot, a_flat, b_flat))}
        if dtype == "float32":
            methods["pallas_highest"] = (functools.partial(pallas, precision="highest"),
                                         (slots, a, b))
        if t_pad * r * (d + o) * 2 <= 256 << 20:  # gathered weights stay under 256 MB
            methods["gathered"] = (gathered, (rows, a, b))
        row = dict(part="bench", T=t, T_pad=t_pad, N=n, D=d, O=o, R=r, dtype=dtype, k=k)
        for name, (fn, rest) in methods.items():
            try:
                row[f"{name}_ms"] = round(_device_ms(jax, fn, xs, rest, reps), 4)
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        for name in methods:
            if name != "base_matmul" and f"{name}_ms" in row and "base_matmul_ms" in row:
                row[f"{name}_vs_base"] = round(row[f"{name}_ms"] / row["base_matmul_ms"], 3)
        emit(row)


def block_sweep(pk, bs, jax, jnp, configs, blocks, k_max, reps, interpret):
    """The Pallas LoRA delta (shrink + expand) per token block B: fewer, fuller grid
    steps against up to N * (B - 1) padded rows."""
    for t, n, d, o, r, dtype in configs:
        jt = jnp.dtype(dtype)
        row = dict(part="blocks", T=t, N=n, D=d, O=o, R=r, dtype=dtype)
        for block in blocks:
            rng = np.random.default_rng(0)
            block_slot, _, _ = segment_case(bs, rng, t, n, block)
            t_pad = block_slot.size * block
            xs, a, b = _stacked_inputs(jnp, rng, t_pad, n, d, o, r, jt, k_max)
            pallas = _strategies(pk, jax, jnp, block, n, r, interpret)[0]
            try:
                row[f"B{block}_ms"] = round(
                    _device_ms(jax, pallas, xs, (jnp.asarray(block_slot), a, b), reps), 4)
            except Exception as e:
                row[f"B{block}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            row[f"B{block}_T_pad"] = t_pad
        emit(row)


# Llama-3-8B's widths (q/o 4096, k/v 1024, gate/up 14336, down in 14336), Qwen2-0.5B's
# (896, 4864, kv 128) and the engine's own test model; ranks up to max_lora_rank's 512.
VMEM_WIDTHS = (128, 896, 1024, 4096, 4864, 14336, 28672)
VMEM_RANKS = (8, 16, 64, 256, 512)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="check,vmem,bench,blocks")
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (no TPU)")
    p.add_argument("--quick", action="store_true", help="tiny shapes only (a smoke run)")
    p.add_argument("--k", type=int, default=64, help="most inputs per dispatch")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--vmem-token-blocks", choices=["base", "step", "all"], default="all",
                   help="vmem part: which Pallas token blocks to compile each shape with")
    blocks = p.add_argument_group("blocks part: the grid of (tokens, slots, width, rank)")
    blocks.add_argument("--block-tokens", type=int, nargs="+", default=[16, 256, 2048])
    blocks.add_argument("--block-slots", type=int, nargs="+", default=[1, 4, 16])
    blocks.add_argument("--block-widths", type=int, nargs="+", default=[4096, 14336])
    blocks.add_argument("--block-ranks", type=int, nargs="+", default=[16])
    blocks.add_argument("--block-dtypes", nargs="+", default=["bfloat16"],
                        choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    pk, bs = load_kernels()
    dev = jax.devices()[0]
    emit(dict(part="env", jax=jax.__version__, device=str(dev.device_kind),
              platform=dev.platform, interpret=args.interpret))
    parts = args.parts.split(",")
    if args.quick:
        check_cases = [(16, 4, 256, 384, 16, "float32", "highest"),
                       (40, 3, 128, 256, 8, "bfloat16", "default"),
                       (24, 2, 128, 256, 8, "float16", "default")]
        bench_cfgs = [(16, 2, 256, 256, 16, "float32")]
    else:
        check_cases = [(t, n, d, o, r, dt, prec)
                       for t, n in ((16, 1), (133, 3), (512, 8), (2048, 16))
                       for d, o, r in ((4096, 1024, 16), (4096, 14336, 64), (14336, 4096, 512))
                       for dt, prec in (("float32", "default"), ("float32", "highest"),
                                        ("bfloat16", "default"), ("float16", "default"),
                                        ("float16", "highest"))]
        bench_cfgs = [(t, n, 4096, o, r, "bfloat16")
                      for t in (16, 256, 2048) for n in (1, 4, 16) for o in (4096, 14336)
                      for r in (16, 64)]
        bench_cfgs += [(256, 4, 4096, 4096, 16, "float32"), (2048, 16, 4096, 14336, 64, "float32")]
    if "check" in parts:
        check(pk, bs, jnp, check_cases, args.interpret)
    if "vmem" in parts and not args.interpret:  # the interpreter runs no Mosaic compile
        vmem_sweep(pk, bs, jax, jnp, VMEM_WIDTHS, VMEM_RANKS, ("float32", "bfloat16"),
                   args.vmem_token_blocks)
    if "blocks" in parts:
        for dtype in args.block_dtypes:
            cfgs = [(t, n, 4096, o, r, dtype) for t in args.block_tokens
                    for n in args.block_slots for o in args.block_widths
                    for r in args.block_ranks]
            base = bs.token_block(dtype, "pallas")  # the table's block, then 2x, 4x, 8x
            block_sweep(pk, bs, jax, jnp, cfgs[:1] if args.quick else cfgs,
                        tuple(base << i for i in range(4)), args.k, args.reps,
                        args.interpret)
    if "bench" in parts:
        bench(pk, bs, jax, jnp, bench_cfgs, args.k, args.reps, args.interpret)


if __name__ == "__main__":
    main()
