"""The engine on its runtimes at the Llama-3.2-1B shape, against a plain-`jax.jit` decode
step of the same weights (the anchor); all rows in one process.

Model: a random Llama with Llama-3.2-1B's shape (hidden 2048, intermediate 8192, 16
layers, 32 / 8 heads, vocab 128256), bf16. Workload: 64 requests, prompts of 128-512
tokens, 128 greedy new tokens, max_num_seqs 32. One engine per runtime (LoRA enabled,
max_loras = the largest adapter count, rank 16 on all seven linears) serves the base
model and N distinct adapters in turn. An `engine_run` row per (runtime, adapters):
  - `serialized`: step_timing's split of a step into device and host ms (synchronous,
    every graph waited for: device = the waits, host = the rest), and the device ms of
    a full-batch decode step;
  - `serving_sync` / `serving_async`: the same run as the engine serves, with async
    scheduling off and on: throughput and the median wall time of the steps that
    launched a full-batch decode; `async_host_visible_ms`: that wall time minus the
    decode step's device ms (host work the device waited for);
then `lora_vs_base` per mode. Before them, right after warm-up, one `anchor` row: the
same weights and batch in a hand-written jax.jit decode step (ragged paged attention over
contexts like the engine's, KV donated): the median synced call, and pipelined calls
(launched back to back, one wait); then `anchor_lora` rows: that step with each adapter
count's one-hot LoRA from the engine's slot buffers, plain JAX's cost of the same LoRA.

    python benchmarks/benchmark_jax_runtime.py --out docs/results/jax_runtime.jsonl  # TPU
    python benchmarks/benchmark_jax_runtime.py --small      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import add_model_args, apply_small, make_workload  # noqa: E402
from many_adapters import make_many_adapters  # noqa: E402
from step_timing import timed_generate  # noqa: E402

# How jax_anchor's step may read its n adapters (its docstring); here, not there, so that
# parsing the arguments imports no jax.
LORA_FORMS = ("stacked", "all", "gathered", "sliced", "dma")

# What --force-strategy may name (punica's xla strategies; a TPU's rank-first buffers take
# the first five only, and the engine says so; "indexed" is the jax runtime's only).
from vllm_tpu_lora.ops import SLOT_COPIES  # noqa: E402

FORCEABLE = ["single", "onehot", "stacked", "grouped_kernel", "indexed", "slots", "gathered",
             "split", "grouped"]

LLAMA_1B = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256,
                num_requests=64, prompt_len=[128, 512], output_len=[128, 128], max_num_seqs=32,
                max_num_batched_tokens=256)


def parse_args() -> argparse.Namespace:
    from vllm_tpu_lora import platform

    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.set_defaults(**LLAMA_1B)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, nargs="+", default=[8, 32])
    p.add_argument("--lora-backend", default="auto")
    p.add_argument("--force-strategy", default=None, choices=FORCEABLE,
                   help="every LoRA graph runs this xla strategy instead of the table's "
                   "pick (xla backend): the table's choice side by side with another")
    p.add_argument("--slot-copy", default=None, choices=SLOT_COPIES,
                   help="how the TPU table's graphs copy a step's slots out (default: the "
                   "engine's, DMA on a TPU)")
    default_runtimes = ["jax"] + (["torch_xla"] if platform.torch_xla_available() else [])
    p.add_argument("--runtimes", nargs="+", default=default_runtimes)
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--model-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the random model's dtype (--small: float32)")
    p.add_argument("--anchor-calls", type=int, default=30)
    # Each variant is a compile of its own (~30 s on the v5e): one by default.
    p.add_argument("--anchor-lora-forms", nargs="*", default=["stacked"],
                   choices=LORA_FORMS,
                   help="the anchor's LoRA variants per adapter count (jax_anchor.py; "
                   "none: base only)")
    p.add_argument("--out", default=None, help="append the JSON rows to this file too")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   help="the engine's logging (DEBUG: each warm-up compile's start and end); "
                   "other libraries stay at WARNING")
    args = apply_small(p.parse_args())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("vllm_tpu_lora").setLevel(args.log_level)
    if args.small:
        args.num_adapters, args.rank, args.anchor_calls = [2], 8, 5
    return args


def force_strategy(engine, strategy: str | None, slot_copy: str | None = None) -> None:
    """Every LoRA graph of `engine` traced from now on runs `strategy` (None: the table's
    pick), its slots copied out by `slot_copy` (ops.take_slots; None: the engine's pick).
    Only the xla backend's fused path has strategies: refused elsewhere rather than
    ignored."""
    punica = engine.runner.punica
    fused_xla = punica.backend == "xla" and punica.fuse_slices
    for flag, value in (("--force-strategy", strategy), ("--slot-copy", slot_copy)):
        if value is not None and not fused_xla:
            raise ValueError(f"{flag} needs the xla backend's fused path; this engine "
                             f"runs {punica.backend!r}")
    punica.force_strategy = strategy
    punica.force_slot_copy = slot_copy


def emit(row: dict, out) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def make_model(args, out_dir: str) -> str:
    import torch

    from vllm_tpu_lora.testing.factory import make_tiny_llama

    return make_tiny_llama(out_dir, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=args.heads, num_kv_heads=args.kv_heads,
                           intermediate_size=args.intermediate, vocab_size=args.vocab,
                           max_position_embeddings=2048, seed=args.seed,
                           dtype=torch.float32 if args.small else getattr(torch, args.model_dtype),
                           initializer_range=0.02, tokenizer_vocab_size=min(args.vocab, 8192))


class StepClock:
    """Wall time of each engine step that launched a decode of the full batch, and the
    time the host waited for the device in it (all of the device time when every graph
    is waited for: serialize_graphs). Every step's wall and device ms are also summed per
    forward graph ("T<tokens>/S<slots>/W<window>/<strategy>"): where a run's time went,
    to set base and LoRA runs side by side by token bucket."""

    def __init__(self, engine, batch: int) -> None:
        self.engine, self.batch = engine, batch
        self.decode_ms, self.device_ms = [], []
        self.all_steps_ms = 0.0  # every step's wall time, launching or not
        self.by_graph: dict[str, list[float]] = {}  # key -> [steps, wall ms, device ms]
        runner, step, rt = engine.runner, engine.step, engine.runtime
        launch = runner.launch
        self.full_decode, self.graph = False, None

        def timed_launch(scheduled, want_top):
            self.full_decode = (len(scheduled) == batch
                                and all(s.num_tokens == 1 for s in scheduled))
            before = dict(runner.forward_graph_steps)
            launched = launch(scheduled, want_top)
            self.graph = next((k for k, n in runner.forward_graph_steps.items()
                               if n != before.get(k, 0)), None)
            return launched

        def timed_step():
            self.full_decode, self.graph = False, None
            waited0, t0 = rt.execution_stats()[1], time.perf_counter()
            out = step()
            wall, device = 1e3 * (time.perf_counter() - t0), (rt.execution_stats()[1] - waited0) / 1e6
            self.all_steps_ms += wall
            if self.full_decode:
                self.decode_ms.append(wall)
                self.device_ms.append(device)
            if self.graph is not None:
                acc = self.by_graph.setdefault(self.graph, [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += wall
                acc[2] += device
            return out

        runner.launch, engine.step = timed_launch, timed_step

    def close(self) -> None:
        del self.engine.runner.launch, self.engine.step

    def median(self, which: str) -> float | None:
        values = getattr(self, which)
        return statistics.median(values) if values else None

    def graphs(self) -> dict:
        """Per forward graph: steps, total wall ms and total device ms (the device ms
        count only what the host waited for: all of it in a serialized run)."""
        return {k: {"steps": n, "wall_ms": round(w, 3), "device_ms": round(d, 3)}
                for k, (n, w, d) in sorted(self.by_graph.items())}


def serving_row(llm, work, loras, batch: int) -> dict:
    """A generate run as the engine serves (nothing waited for but the results)."""
    from vllm_tpu_lora import SamplingParams

    clock = StepClock(llm.llm_engine, batch)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
    t0 = time.perf_counter()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params,
                            lora_request=loras, use_tqdm=False)
    finally:
        clock.close()
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"async_scheduling": llm.llm_engine.async_scheduling,
            "output_tokens_per_s": n_out / elapsed, "elapsed_s": elapsed,
            "full_decode_steps": len(clock.decode_ms), "decode_step_ms": clock.median("decode_ms"),
            # adding the requests, and the loop around the steps
            "outside_steps_ms": 1e3 * elapsed - clock.all_steps_ms, "by_graph": clock.graphs()}


def serialized_row(llm, work, loras, batch: int) -> dict:
    """step_timing's split of the run's steps into device and host ms (synchronous
    scheduling, every graph waited for), and the device ms of a full-batch decode step."""
    clock = StepClock(llm.llm_engine, batch)
    try:
        ser = timed_generate(llm, work, lora_request=loras)
    finally:
        clock.close()
    return {**{k: ser[k] for k in ("output_tokens_per_s", "ms_per_step", "device_ms_per_step",
                                   "host_ms_per_step", "steps")},
            "decode_step_ms": clock.median("decode_ms"),
            "decode_device_ms": clock.median("device_ms"), "by_graph": clock.graphs()}


def engine_rows(runtime: str, model_dir: str, paths: list[str], work, args, out) -> list[dict]:
    """Per adapter count: the serialized split (sync), then serving with async scheduling
    off and on. Host time visible in an async decode step = its wall time minus the
    device time of a decode step (from the serialized run)."""
    from vllm_tpu_lora import LLM, LoRARequest

    t0 = time.perf_counter()
    max_len = args.prompt_len[1] + args.output_len[1]
    llm = LLM(model_dir, runtime=runtime, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
              enable_lora=True, max_loras=max(args.num_adapters), max_lora_rank=args.rank,
              lora_backend=args.lora_backend, enable_prefix_caching=False,
              kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
              precompile=args.force_strategy is None and args.slot_copy is None)
    engine = llm.llm_engine
    if args.force_strategy is not None or args.slot_copy is not None:
        force_strategy(engine, args.force_strategy, args.slot_copy)  # before warm-up traces
        engine.runner.precompile()
    stats = engine.stats()
    emit({"row": "engine", "runtime": runtime, "startup_s": time.perf_counter() - t0,
          "num_graphs": stats["num_graphs"], "warmup_s": stats["warmup_seconds"],
          "device": stats["device"], "lora_backend": engine.runner.punica.backend,
          "force_strategy": args.force_strategy, "slot_copy": engine.runner.punica.slot_copy,
          # tracing in the engine's thread; compiles summed over the threads they ran in
          "trace_s": getattr(engine.runner.capture, "trace_seconds", None),
          "compile_s": getattr(engine.runner.capture, "compile_seconds", None)}, out)
    # The anchor first: a call cut off at its time limit still has it beside the engine.
    anchors = anchor_rows(llm, work, args)
    for row in anchors:
        emit(row, out)
    anchor = anchors[0]
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    for r in reqs:  # read into the host cache now: the timed runs measure serving
        engine.add_lora(r)
    rows = []
    for n in [0, *args.num_adapters]:
        loras = [reqs[i % n] for i in range(len(work))] if n else None
        serving_row(llm, work[: args.max_num_seqs], loras and loras[: args.max_num_seqs],
                    args.max_num_seqs)  # warm slots
        engine.async_scheduling = False
        ser = serialized_row(llm, work, loras, args.max_num_seqs)
        sync = serving_row(llm, work, loras, args.max_num_seqs)
        engine.async_scheduling = True
        asyn = serving_row(llm, work, loras, args.max_num_seqs)
        row = {"row": "engine_run", "runtime": runtime, "adapters": n, "serialized": ser,
               "serving_sync": sync, "serving_async": asyn,
               "compilations_after_warmup": engine.stats()["compilations_after_warmup"]}
        if asyn["decode_step_ms"] and ser["decode_device_ms"]:
            visible = asyn["decode_step_ms"] - ser["decode_device_ms"]
            row["async_host_visible_ms"] = visible
            row["async_host_visible_frac"] = visible / asyn["decode_step_ms"]
        row["async_vs_sync_throughput"] = (asyn["output_tokens_per_s"]
                                           / sync["output_tokens_per_s"])
        emit(row, out)
        rows.append(row)
    for mode in ("serving_sync", "serving_async"):
        base = rows[0][mode]["output_tokens_per_s"]
        for row in rows[1:]:
            emit({"row": "lora_vs_base", "runtime": runtime, "adapters": row["adapters"],
                  "mode": mode, "throughput_ratio": row[mode]["output_tokens_per_s"] / base,
                  "by_tokens": by_tokens(rows[0][mode]["by_graph"], row[mode]["by_graph"])},
                 out)
    decode = rows[0]["serving_async"]["decode_step_ms"]
    if anchor["ms"] and decode:
        emit({"row": "decode_vs_anchor", "runtime": runtime, "engine_decode_step_ms": decode,
              "anchor_ms": anchor["ms"], "ratio": decode / anchor["ms"],
              "anchor_pipelined_ms": anchor["pipelined_ms"],
              "ratio_pipelined": decode / anchor["pipelined_ms"]}, out)
    return rows


def by_tokens(base: dict, lora: dict) -> dict:
    """Base and LoRA runs' steps and wall ms per token bucket, side by side: which steps
    the LoRA run's extra time went to (full decode, prefill chunks, the tail)."""
    out = {}
    for side, graphs in (("base", base), ("lora", lora)):
        for key, g in graphs.items():
            acc = out.setdefault(key.split("/")[0], {"base_steps": 0, "base_wall_ms": 0.0,
                                                     "lora_steps": 0, "lora_wall_ms": 0.0})
            acc[f"{side}_steps"] += g["steps"]
            acc[f"{side}_wall_ms"] += g["wall_ms"]
    return out


def anchor_rows(llm, work, args) -> list[dict]:
    """The engine's own weights (its device arrays, on the jax runtime) in a plain jax.jit
    decode step: batch max_num_seqs, contexts as the engine's first decode wave had. Then
    the same step with each adapter count's one-hot LoRA from the engine's slot buffers
    (jax_anchor: "stacked" over the first slots as they lie, "all" over every slot,
    "gathered" by index, "sliced" as dynamic slices, "dma" by the engine's copy kernel),
    over as many adapters as a step of this batch uses: the cost of LoRA in plain JAX on
    this chip, like against like for the engine's ratios."""
    engine = llm.llm_engine
    if engine.runtime.name != "jax":
        return [{"row": "anchor", "ms": None, "why": "weights are read from a jax-runtime engine"}]
    from jax_anchor import build_anchor

    b = args.max_num_seqs
    ctx = anchor_contexts(work, b)
    block = engine.config.cache_config.block_size
    base = time_anchor(*build_anchor(engine.runner.model, ctx, block), args.anchor_calls)
    rows = [{"row": "anchor", **base, "batch": b, "mean_context": float(np.mean(ctx)),
             "calls": args.anchor_calls}]
    for n in args.num_adapters:
        # A decode step of the anchor's batch uses at most that many of the n adapters, as
        # the engine's: "stacked" then reads those alone, "all" every slot of the engine.
        active = min(n, len(ctx))
        for form in args.anchor_lora_forms:
            t = time_anchor(*build_anchor(engine.runner.model, ctx, block, active, form),
                            args.anchor_calls)
            rows.append({"row": "anchor_lora", "adapters": n, "active": active, "form": form,
                         **t,
                         "vs_base": base["ms"] / t["ms"],
                         "vs_base_pipelined": base["pipelined_ms"] / t["pipelined_ms"]})
    return rows


def anchor_contexts(work, batch: int) -> list[int]:
    """The anchor's contexts: the first decode wave's requests halfway through their
    outputs."""
    return [len(p) + o // 2 for p, o in work[:batch]]


def time_anchor(step, state, inputs, calls: int) -> dict:
    """The median synced call, and pipelined calls: launched back to back, one wait at the
    end (what the engine's async decode steps are, minus the engine): device time plus
    what dispatch cannot hide."""
    import jax

    state = step(state, *inputs)[1]
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        tok, state = step(state, *inputs)
        jax.block_until_ready(tok)
        ts.append(1e3 * (time.perf_counter() - t0))
    t0 = time.perf_counter()
    for _ in range(calls):
        tok, state = step(state, *inputs)
    jax.block_until_ready(tok)
    return {"ms": statistics.median(ts),
            "pipelined_ms": 1e3 * (time.perf_counter() - t0) / calls}


def main() -> int:
    args = parse_args()
    import jax
    import torch

    emit({"row": "setup", "jax": jax.__version__, "torch": torch.__version__,
          "devices": str(jax.devices()), "args": vars(args)}, args.out)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = make_model(args, os.path.join(tmp, "model"))
        paths = make_many_adapters(model_dir, os.path.join(tmp, "adapters"),
                                   max(args.num_adapters), args.rank)
        emit({"row": "made_model_and_adapters", "s": time.perf_counter() - t0}, args.out)
        work = make_workload(args)
        for runtime in args.runtimes:
            engine_rows(runtime, model_dir, paths, work, args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
