"""Attention window buckets against one window of max_model_len, in one process.

On CPU every query block gathers a whole window of KV blocks (layers/attention.py), so a
step's attention cost follows the graph's window, not its sequences' lengths. The runner
keeps graphs for windows of 256, 512, ... tokens up to max_model_len
(runner/buckets.py kv_block_buckets) and runs each step on the smallest that holds its
longest sequence. This runs benchmark_throughput.py's model and workload (greedy, base
model, prefix caching off) on two engines, interleaved rounds, best round each:
  one_window      every step gathers max_model_len (how the runner worked before)
  window_buckets  the runner's ladder
for each --max-model-len (the engine's limit; the prompts and outputs stay the same, so a
larger limit is a server sized for longer requests than this traffic).

    python benchmarks/benchmark_kv_window.py                          # 384 and 2048
    python benchmarks/benchmark_kv_window.py --max-model-len 384 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import add_model_args, apply_small, make_model, make_workload  # noqa: E402
from step_timing import timed_generate  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--max-model-len", type=int, nargs="+", default=[384, 2048])
    p.add_argument("--rounds", type=int, default=2)
    args = apply_small(p.parse_args(argv))
    if args.small:
        args.max_model_len, args.rounds = [512], 1
    return args


def build(model_dir: str, args, max_model_len: int, one_window: bool):
    from vllm_tpu_lora import LLM
    from vllm_tpu_lora.runner import buckets

    saved = buckets.KV_MIN_WINDOW
    if one_window:  # the ladder's first rung at max_model_len: a single window
        buckets.KV_MIN_WINDOW = max_model_len
    try:
        # No prefix caching: every round prefills every prompt (a later round would
        # otherwise find the earlier one's blocks and skip most prefill steps).
        return LLM(model_dir, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   enable_prefix_caching=False)
    finally:
        buckets.KV_MIN_WINDOW = saved


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    work = make_workload(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args, os.path.join(tmp, "model"),
                               max_position_embeddings=max(args.max_model_len))
        for max_len in args.max_model_len:
            llms = {name: build(model_dir, args, max_len, name == "one_window")
                    for name in ("one_window", "window_buckets")}
            results = {name: [] for name in llms}
            for _ in range(args.rounds):
                for name, llm in llms.items():
                    results[name].append(timed_generate(llm, work, keep_outputs=True))
            best = {name: max(r, key=lambda x: x["output_tokens_per_s"])
                    for name, r in results.items()}
            same = sum(a == b for a, b in zip(best["one_window"].pop("outputs"),
                                              best["window_buckets"].pop("outputs")))
            for name, res in best.items():
                runner = llms[name].llm_engine.runner
                stats = llms[name].llm_engine.stats()
                row = {"name": name, "max_model_len": max_len,
                       "windows": [w * runner.block_size for w in runner.window_ladder],
                       **res, "num_graphs": stats["num_graphs"],
                       "warmup_s": stats["warmup_seconds"],
                       "compilations_after_warmup": stats["compilations_after_warmup"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
            ratio = {"name": "ratio", "max_model_len": max_len,
                     "window_buckets_over_one_window": best["window_buckets"]["output_tokens_per_s"]
                     / best["one_window"]["output_tokens_per_s"],
                     "greedy_outputs_identical": f"{same}/{len(work)}"}
            print(json.dumps(ratio), flush=True)
            rows.append(ratio)
    return rows


if __name__ == "__main__":
    main()
