"""Side-by-side timing of the LoRA op strategies on the XLA device (PJRT CPU here).

One JSON row per config (T, D, O, R, N, dtype). Each variant is one lazy graph
of --layers LoRA shrink + expand pairs (own adapter weights per layer, the
expands accumulating into one output), so the ~1 ms fixed cost of a PJRT CPU
graph execution is amortised as it is inside a model forward:

  onehot          bgmv_xla one-hot einsum over the N slots (no layout)
  segment         make_segment_layout + segment shrink/expand (layout built in-graph)
  segment_reuse   segment shrink/expand with a layout computed once beforehand
                  (what every layer after the first costs when a step shares the layout)
  pallas          layout + Pallas kernels via call_jax (interpret mode off-TPU)
  pallas_reuse    Pallas kernels with a precomputed layout
  dispatch_xla    vllm_tpu_lora.ops.segment_* with backend="xla" (one-hot behind the
                  layout API, what the runner gets off-TPU), precomputed layout
  layout          make_segment_layout alone (once per step, not per layer)
  dense_base      --layers base linears x @ W ([T, D] x [D, O]), for scale

Times are medians of wall time per graph, including lazy-tensor tracing,
torch_xla.sync() and waiting for the device; *_ms_per_layer divides by --layers.
compile_s is the first call (trace + compile + run).

Usage: python benchmarks/benchmark_ops.py [--iters 10] [--slots 1 4 8] [--layers 8]

`--packed` measures what the runner's graphs actually run instead: per (T, S) the LoRA
cost of a Llama layer's four linears (qkv and gate_up with fused slices) over the full
stacked slot buffers, for each xla strategy (single adapter, one-hot over the active
slots, grouped matmul at token block B), captured once and replayed (device time):

    python benchmarks/benchmark_ops.py --packed [--tokens 16 64 256] [--slots 1 2 4 8]

`--packed --mixed H` instead gives every layer its own weights (as in a model: the
default reuses one layer's, which then stay in cache) and makes each step look like
continuous batching: H adapters share the prefill tokens, every other active adapter has
one decode token. This is where the split strategy (lora/step_layout.py) was measured:

    python benchmarks/benchmark_ops.py --packed --mixed 4 --tokens 64 128 256 --slots 8 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vllm_tpu_lora import ops, platform  # platform picks PJRT_DEVICE, imports torch_xla
from vllm_tpu_lora.ops import bgmv_pallas, bgmv_xla
from vllm_tpu_lora.ops.block_sizes import token_block


def _materialize(*tensors) -> None:
    """Cut the lazy graph, run it and wait until the device is idle."""
    import torch_xla.core.xla_model as xm  # after platform has set PJRT_DEVICE

    platform.sync()
    xm.wait_device_ops()
    del tensors


def _time_all(variants: dict, iters: int) -> tuple[dict, dict]:
    """Compile every variant, then time them round-robin (interleaved, so a burst of
    load from other processes on this shared CPU hits all variants alike).
    Returns ({name: first-call seconds}, {name: median ms})."""
    first, times = {}, {name: [] for name in variants}
    for name, fn in variants.items():
        t0 = time.perf_counter()
        _materialize(fn())
        first[name] = time.perf_counter() - t0
    for _ in range(iters):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            _materialize(fn())
            times[name].append((time.perf_counter() - t0) * 1e3)
    return first, {name: statistics.median(ts) for name, ts in times.items()}


def _inputs(t, d, o, r, n, layers, dtype, dev):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype).to(dev)

    v = dict(
        x=rnd(t, d),
        base=rnd(t, o),
        idx=torch.randint(0, n, (t,), generator=g, dtype=torch.int32).to(dev),
    )
    v["a"] = [rnd(n, r, d, std=0.05) for _ in range(layers)]
    v["b"] = [rnd(n, o, r, std=0.05) for _ in range(layers)]
    v["w"] = [rnd(d, o, std=0.05) for _ in range(layers)]
    v["scale"] = torch.full((n,), 0.5).to(dev)
    _materialize()
    return v


def _variants(v: dict, n: int, layers: int, lay_x, lay_p) -> dict:
    """name -> zero-argument function tracing one graph of `layers` LoRA layers."""
    x, a, b, idx, s, base = v["x"], v["a"], v["b"], v["idx"], v["scale"], v["base"]

    def chain(shrink, expand, layout):
        h = base
        for layer in range(layers):
            h = expand(shrink(x, a[layer], layout, s), b[layer], layout, h)
        return h

    def onehot():
        h = base
        for layer in range(layers):
            y = bgmv_xla.onehot_shrink(x, a[layer], idx, s)
            h = bgmv_xla.onehot_expand(y, b[layer], idx, h)
        return h

    def seg(mod, block, layout=None):
        # layout=None: the layout is rebuilt inside the timed graph.
        return lambda: chain(
            mod.segment_shrink,
            mod.segment_expand,
            layout or bgmv_xla.make_segment_layout(idx, n, block),
        )

    def dispatch_xla():
        return chain(
            lambda *args: ops.segment_shrink(*args, backend="xla"),
            lambda *args: ops.segment_expand(*args, backend="xla"),
            lay_x,
        )

    return {
        "onehot": onehot,
        "segment": seg(bgmv_xla, lay_x.block),
        "segment_reuse": seg(bgmv_xla, lay_x.block, lay_x),
        "pallas": seg(bgmv_pallas, lay_p.block),
        "pallas_reuse": seg(bgmv_pallas, lay_p.block, lay_p),
        "dispatch_xla": dispatch_xla,
        "layout": lambda: bgmv_xla.make_segment_layout(idx, n, lay_x.block).perm,
        "dense_base": lambda: sum(x @ w for w in v["w"]),
    }


def bench_config(t, d, o, r, n, layers, dtype, iters: int) -> dict:
    v = _inputs(t, d, o, r, n, layers, dtype, platform.xla_device())
    bx, bp = token_block(dtype, "xla"), token_block(dtype, "pallas")
    lay_x = bgmv_xla.make_segment_layout(v["idx"], n, bx)
    lay_p = bgmv_xla.make_segment_layout(v["idx"], n, bp)
    _materialize()
    t_pad_x, t_pad_p = lay_x.perm.shape[0], lay_p.perm.shape[0]
    row = dict(T=t, D=d, O=o, R=r, N=n, layers=layers, dtype=str(dtype).split(".")[-1])
    row.update(block_xla=bx, block_pallas=bp, T_pad_xla=t_pad_x, T_pad_pallas=t_pad_p)
    row["mflop_per_layer_onehot"] = round(2 * n * t * r * (d + o) / 1e6, 1)
    row["mflop_per_layer_segment"] = round(2 * t_pad_x * r * (d + o) / 1e6, 1)
    compile_s, median_ms = _time_all(_variants(v, n, layers, lay_x, lay_p), iters)
    for name, ms in median_ms.items():
        row[f"{name}_ms"] = round(ms, 2)
        if name != "layout":
            row[f"{name}_ms_per_layer"] = round(ms / layers, 3)
    row["compile_s"] = {k: round(val, 2) for k, val in compile_s.items()}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    for dname in args.dtypes:
        for n in args.slots:
            row = bench_config(
                args.tokens,
                args.in_features,
                args.out_features,
                args.rank,
                n,
                args.layers,
                getattr(torch, dname),
                args.iters,
            )
            print(json.dumps(row), flush=True)


def packed_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description="--packed: " + packed_rows.__doc__)
    p.add_argument("--packed", action="store_true")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--inter", type=int, default=1408)
    p.add_argument("--kv", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="token blocks B of the grouped variants")
    p.add_argument("--mixed", type=int, default=0, metavar="H",
                   help="distinct weights per layer; H heavy adapters, one token for the rest")
    packed_rows(p.parse_args(argv))


# ---- --packed: the per-layer strategies of the runner's LoRA layers, replayed ----------


def _packed_layers(dim: int, inter: int, kv: int, rank: int, slots: int, dev) -> list:
    """(in, [out slices], lora_a list, lora_b list, base weight [in, out]) for a Llama
    layer's qkv, o, gate_up and down linears, LoRA buffers of `slots` slots as the fused
    xla path holds them ([slots, in, R] and [slots, R, out])."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(dim, [dim, kv, kv]), (dim, [dim]), (dim, [inter, inter]), (inter, [dim])]
    layers = []
    for d, outs in shapes:
        a = [(torch.randn(slots, d, rank, generator=gen) * 0.05).to(dev) for _ in outs]
        b = [(torch.randn(slots, rank, o, generator=gen) * 0.05).to(dev) for o in outs]
        w = (torch.randn(d, sum(outs), generator=gen) * 0.05).to(dev)
        layers.append((d, outs, a, b, w))
    return layers


def packed_rows(args) -> list[dict]:
    """One row per (T, S, strategy): replayed device ms of --layers decoder layers' worth of
    LoRA linears (qkv, o, gate_up, down), next to the base linears alone."""
    import numpy as np

    from vllm_tpu_lora.lora.punica import PunicaWrapper
    from vllm_tpu_lora.lora.step_layout import SPLIT_FROM_TOKENS
    from vllm_tpu_lora.runner.buckets import slot_buckets
    from vllm_tpu_lora.runner.lazy_capture import LazyGraphCapture

    dev = platform.xla_device()
    per_layer = [_packed_layers(args.dim, args.inter, args.kv, args.rank, max(args.slots), dev)
                 for _ in range(args.layers if args.mixed else 1)]
    layers = per_layer[0]
    bufs = [t_ for lays in per_layer for lay in lays for t_ in lay[2] + lay[3]]
    rows = []
    for t in args.tokens:
        for s in args.slots:
            rng = np.random.default_rng(t * 31 + s)
            if args.mixed:  # one decode token per light adapter, the rest prefill chunks
                h = min(args.mixed, s)
                decode = list(range(h, s))
                pos = np.array(decode + [h - 1 - i * h // (t - len(decode))
                                         for i in range(t - len(decode))], np.int32)
            else:
                pos = rng.integers(-1, s, size=t).astype(np.int32)  # some base-model tokens
            x = {d: torch.randn(t, d).to(dev) for d in {lay[0] for lay in layers}}
            variants = {"base_only": (None, None)}
            variants.update({"single": ("single", None)} if s == 1 else {})
            variants.update({"onehot": ("onehot", None), "gathered": ("gathered", None)})
            variants.update({f"grouped_b{b}": ("grouped", b) for b in args.blocks})
            if s > 1 and t >= SPLIT_FROM_TOKENS:
                variants["split"] = ("split", None)
            if s > 1:  # the buffers hold max(--slots) slots: every one is read
                variants["slots"] = ("slots", None)
            runs = {}
            for name, (strategy, block) in variants.items():
                punica = PunicaWrapper("xla", fuse_slices=True)
                punica.force_strategy, punica.force_block = strategy, block
                punica.max_loras = max(args.slots)
                graph_s = s
                if strategy == "split":  # S of a split graph counts the heavy adapters
                    graph_s = punica.graph_slots(pos, s, slot_buckets(max(args.slots)))
                plan = (punica.plan_step(pos, list(range(s)), graph_s, torch.float32)
                        if strategy else {})
                step = {k: torch.from_numpy(v).to(dev) for k, v in plan.items()}

                def graph(xs, step, bufs, punica=punica, strategy=strategy, s=graph_s):
                    punica.set_step(s, step)
                    total = []
                    for i in range(args.layers):
                        for d, outs, a, b, w in per_layer[i % len(per_layer)]:
                            y = xs[d] @ w
                            if strategy is not None:
                                y = punica.add_lora_linear(y, xs[d], a, b, outs)
                            total.append(y.sum())
                    return torch.stack(total).sum()

                run = LazyGraphCapture().compile(graph)
                _materialize(run(x, step, bufs))
                runs[name] = (run, step)
            # Interleaved (every variant once per round): this host's speed drifts by tens
            # of percent within a minute, which would bias variants timed one after another.
            samples = {name: [] for name in runs}
            for _ in range(args.iters):
                for name, (run, step) in runs.items():
                    t0 = time.perf_counter()
                    _materialize(run(x, step, bufs))
                    samples[name].append(1e3 * (time.perf_counter() - t0))
            times = {name: statistics.median(v) for name, v in samples.items()}
            base = times.pop("base_only")
            row = {"name": "packed_lora_linears", "T": t, "S": s, "R": args.rank,
                   "dim": args.dim, "inter": args.inter, "layers": args.layers,
                   "mixed_heavy": args.mixed, "base_ms": base}
            row.update({f"{k}_lora_ms": v - base for k, v in times.items()})
            row["best"] = min(times, key=times.get)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    import sys

    if "--packed" in sys.argv:
        packed_main(sys.argv[1:])
    else:
        main()
