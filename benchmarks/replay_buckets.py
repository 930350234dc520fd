"""Per-bucket LoRA cost inside the engine: its captured forward graphs replayed one at a time.

Builds the multi-LoRA engine of benchmark_lora.py (or any shape via the model flags), then
for each token bucket T replays, serialized, the base graph (S = 0) and the LoRA graph of
slot bucket S = max_loras, and, where that bucket has a fallback graph (the xla "slots"
strategy, lora/step_layout.py), the fallback graph too. Every adapter's slot holds tokens
(an even share each); weights are the warm-up adapter's, which does not change the time.
One JSON row per T: median ms of each graph and the LoRA ms over the base. This is where
lora/step_layout.py's choice between slots and its fallbacks was measured: the op-level
benchmark_ops.py --packed leaves out the rest of the model, which changed the verdict at
decode sizes.

    python benchmarks/replay_buckets.py                         # the benchmark_lora shape
    python benchmarks/replay_buckets.py --tokens 32 64 512 --hidden 1024 --layers 8 \\
        --heads 16 --intermediate 2816 --max-num-seqs 32 --max-num-batched-tokens 512 \\
        --max-loras 16                                          # the vs-PEFT shape
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import add_model_args, apply_small, make_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--token-order", choices=["interleaved", "sorted", "both"],
                   default="interleaved",
                   help="adapters of consecutive tokens: cycling (warm-up's dummy step) or "
                        "grouped by adapter, as the engine orders a step's requests")
    p.set_defaults(hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=4,
                   prompt_len=[16, 64], output_len=[32, 32], max_num_seqs=16,
                   max_num_batched_tokens=256)
    args = apply_small(p.parse_args(argv))
    if args.small:
        args.rank, args.max_loras, args.tokens, args.iters = 8, 2, [16, 64], 3
    return args


def main(argv=None) -> list[dict]:
    from vllm_tpu_lora import LLM, platform
    from vllm_tpu_lora.lora import step_layout
    from vllm_tpu_lora.runner import buckets

    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(make_model(args, os.path.join(tmp, "model")), enable_lora=True,
                  max_loras=args.max_loras, max_lora_rank=args.rank,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.prompt_len[1] + args.output_len[1])
        runner = llm.llm_engine.runner
        manager = runner.lora_manager
        warm = manager.warmup_adapter()
        for slot in range(manager.max_loras):
            manager.write_slot(slot, warm)
        s_b = runner.slot_ladder[-1]
        # Only the token buckets whose steps can bring every slot's adapter (warm-up
        # compiles no other graph at S = max_loras; see buckets.slots_reachable).
        for t_b in [t for t in args.tokens if t in runner.token_ladder and buckets.slots_reachable(
                t, s_b, runner.slot_ladder, runner.max_num_seqs)]:
            graphs = {"base": (0, False, False)}
            orders = ([False, True] if args.token_order == "both"
                      else [args.token_order == "sorted"])
            for srt in orders:
                tag = "_sorted" if srt and len(orders) > 1 else ""
                graphs["lora" + tag] = (s_b, False, srt)
                if runner.punica.fallback_graph(t_b, s_b):
                    graphs["fallback" + tag] = (s_b, True, srt)
            times = {name: [] for name in graphs}
            for _ in range(args.iters):  # interleaved: this host's speed drifts
                for name, (s, fallback, srt) in graphs.items():
                    step = runner._dummy(t_b, runner.request_ladder[0], s)
                    if srt:
                        step.token_lora_idx[:] = np.sort(step.token_lora_idx)
                    t0 = time.perf_counter()
                    runner._forward(step, s, fallback)
                    platform.wait_device_ops()
                    times[name].append(1e3 * (time.perf_counter() - t0))
            med = {name: statistics.median(v) for name, v in times.items()}
            strategy = runner.punica.xla_strategy(t_b, s_b)
            row = {"name": "replayed_forward", "T": t_b, "S": s_b, "strategy": strategy,
                   **{f"{k}_ms": v for k, v in med.items()}}
            for name in med:
                if name.startswith("fallback"):
                    row["fallback_strategy"] = step_layout.fallback_strategy(t_b, s_b)
                if name != "base":
                    row[f"{name}_over_base_ms"] = med[name] - med["base"]
            row["compilations_after_warmup"] = llm.llm_engine.stats()[
                "compilations_after_warmup"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        manager.clear_all_slots()
    return rows


if __name__ == "__main__":
    main()
