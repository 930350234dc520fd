"""Where a step's wall time goes, phase by phase: base, LoRA unused, N distinct adapters.

The LoRA benchmark's shape and workload (`benchmark_lora.py`), run greedy with the graphs
serialized as there (`step_timing.timed`), with a timer around each phase of the engine's
step. One JSON row per configuration (interleaved rounds in one process, the best round
kept), each phase in ms/step of its own time (a phase's callees are not counted in it):

  lora_loads     harvesting background adapter reads (engine)
  schedule       the scheduler's choice of the step
  activate       the step's adapters into device slots (LRU, slot writes)
  prepare        the step's host arrays (tokens, positions, attention metadata)
  lora_plan      the LoRA strategy's arrays and slot bucket (punica)
  upload         packing and moving the host arrays (both graphs)
  forward_call   replaying the forward graph (lookup, launch, KV buffer swap)
  sample_call    replaying the logits/sampler graph
  wait           waiting for each graph to finish (benchmark mode only)
  execute_rest   the runner's own code around these, and fetching the sampled tokens
  update         the scheduler's bookkeeping after the step
  step_rest      appending tokens, stop checks, request outputs (and the engine's waits
                 for adapter reads, and steps that scheduled nothing)

plus device_ms_per_step (torch_xla's ExecuteTime) as in the other benchmarks. The calls
that touch the device (forward_call, sample_call, wait, execute_rest) may contain device
time; the others are pure host work. Made to say where the host time of a LoRA step goes
on a machine where it cannot be profiled at leisure (a lent TPU), and on this one.

    python benchmarks/step_phases.py                  # 8 adapters, full size
    python benchmarks/step_phases.py --num-adapters 1 8 --layers 32
    python benchmarks/step_phases.py --small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_lora import LORA_SHAPE, best_of, engine, make_adapters  # noqa: E402
from benchmark_throughput import add_model_args, apply_small, make_model, make_workload  # noqa: E402
from step_timing import timed_generate  # noqa: E402


class PhaseTimer:
    """Exclusive wall time per wrapped callable: time spent in a wrapped callee counts for
    the callee, not its caller."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[float] = []  # callees' time of each open call

    def wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                inner = self._stack.pop()
                self.totals[name] = self.totals.get(name, 0.0) + elapsed - inner
                if self._stack:
                    self._stack[-1] += elapsed

        return timed

    @contextmanager
    def patched(self, targets: list[tuple[object, str, str]]):
        """targets: (owner, attribute, phase name); restored on exit (an attribute the
        owner only inherited, a method, is removed again rather than set)."""
        saved = [(owner, attr, vars(owner).get(attr)) for owner, attr, _ in targets]
        try:
            for owner, attr, name in targets:
                setattr(owner, attr, self.wrap(getattr(owner, attr), name))
            yield self
        finally:
            for owner, attr, fn in saved:
                if fn is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, fn)


def phase_targets(llm) -> list[tuple[object, str, str]]:
    from vllm_tpu_lora.runner import model_runner

    eng = llm.llm_engine
    runner = eng.runner
    targets = [(eng, "step", "step_rest"), (eng.scheduler, "schedule", "schedule"),
               (eng.scheduler, "update", "update"), (runner, "execute", "execute_rest"),
               (runner, "_activate_loras", "activate"), (model_runner, "prepare_step", "prepare"),
               (runner, "_upload", "upload"), (runner, "_forward_graph", "forward_call"),
               (runner, "_sample_graph", "sample_call"), (runner, "_launched", "wait")]
    if eng.lora_manager is not None:
        targets.append((eng, "_advance_lora_loads", "lora_loads"))
    if runner.punica is not None:
        targets += [(runner.punica, "plan_step", "lora_plan"),
                    (runner.punica, "graph_slots", "lora_plan")]
    return targets


PHASES = ["lora_loads", "schedule", "activate", "prepare", "lora_plan", "upload",
          "forward_call", "sample_call", "wait", "execute_rest", "update", "step_rest"]


def phased_generate(llm, work, loras) -> dict:
    timer = PhaseTimer()
    with timer.patched(phase_targets(llm)):
        row = timed_generate(llm, work, loras)
    row["phases_ms"] = {p: 1e3 * timer.totals.get(p, 0.0) / row["steps"] for p in PHASES}
    row["phases_sum_ms"] = sum(row["phases_ms"].values())
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--num-adapters", type=int, nargs="+", default=[8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runtime", default="auto", choices=["auto", "torch_xla", "jax"])
    p.set_defaults(**LORA_SHAPE)
    args = apply_small(p.parse_args(argv))
    if args.small:
        args.rank, args.max_loras, args.num_adapters, args.rounds = 8, 2, [2], 1
    return args


def main(argv=None) -> list[dict]:
    from vllm_tpu_lora import LoRARequest

    args = parse_args(argv)
    work = make_workload(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args, os.path.join(tmp, "model"))
        paths = make_adapters(model_dir, tmp, max(args.num_adapters), args.rank)
        lora_llm = engine(model_dir, args, enable_lora=True, max_loras=args.max_loras,
                          max_lora_rank=args.rank, max_cpu_loras=max(args.num_adapters))
        configs = {"enable_lora=False": (engine(model_dir, args), None),
                   "lora_enabled_unused": (lora_llm, None)}
        for n in args.num_adapters:
            reqs = [LoRARequest(f"lora{i}", i + 1, paths[i]) for i in range(n)]
            configs[f"{n}_distinct_adapters"] = (lora_llm,
                                                 [reqs[i % n] for i in range(len(work))])
        results = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, (llm, loras) in configs.items():
                results[name].append(phased_generate(llm, work, loras))
        for name, rounds in results.items():
            best = best_of(rounds)
            row = {"name": name, "layers": args.layers, "rounds": args.rounds,
                   **{k: best[k] for k in ("output_tokens_per_s", "steps", "ms_per_step",
                                           "device_ms_per_step", "host_ms_per_step",
                                           "phases_sum_ms", "phases_ms")}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
