"""Automatic prefix caching on vs off, both engines in one process, interleaved rounds.

The multi-tenant case prefix caching exists for: 64 requests over 4 adapters, each
adapter's requests starting with that adapter's own 1,024-token system prompt followed by
16-64 tokens of their own, 32 greedy new tokens (the benchmark LoRA model: random Llama,
hidden 512, 4 layers, rank-16 adapters on all seven linears, max_num_seqs=16,
max_num_batched_tokens=256). Requests are queued at once in round-robin adapter order.
Every round starts cold (`reset_prefix_cache()`), so each adapter's system prompt is
computed once per round with caching on. One JSON row per mode (its best round) with
throughput, mean time to first token (from queueing, as an offline batch sees it), the
prefix-cache hit rate and the host/device split of a step; then the ratio row, with
whether both modes produced the same greedy tokens.

    python benchmarks/benchmark_prefix_cache.py
    python benchmarks/benchmark_prefix_cache.py --small      # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_lora import LORA_SHAPE, make_adapters  # noqa: E402
from benchmark_throughput import add_model_args, apply_small, make_model  # noqa: E402
from step_timing import timed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--system-len", type=int, default=1024,
                   help="tokens of each adapter's shared system prompt")
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.set_defaults(**{**LORA_SHAPE, "num_requests": 64})
    args = apply_small(p.parse_args(argv))
    if args.small:
        args.system_len, args.num_adapters, args.rank, args.num_requests = 64, 2, 8, 8
    return args


def make_workload(args) -> list[tuple[list[int], int, int]]:
    """(prompt ids, new tokens, adapter index) per request, adapters round-robin."""
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(3, args.vocab, size=args.system_len).tolist()
               for _ in range(args.num_adapters)]
    work = []
    for i in range(args.num_requests):
        own = rng.integers(3, args.vocab, size=int(rng.integers(*args.prompt_len))).tolist()
        work.append((systems[i % args.num_adapters] + own, args.output_len[0],
                     i % args.num_adapters))
    return work


def run_mode(llm, work, loras, caching: bool) -> dict:
    from vllm_tpu_lora import SamplingParams

    engine = llm.llm_engine
    llm.reset_prefix_cache()  # every round starts cold
    before = engine.stats(per_adapter=False)
    prompts = [{"prompt_token_ids": p} for p, _, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o, _ in work]
    row = timed(llm, lambda: llm.generate(prompts, params, lora_request=[loras[a] for *_, a in work],
                                          use_tqdm=False))
    outs = row.pop("_result")
    stats = engine.stats(per_adapter=False)
    queries = stats["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = stats["prefix_cache_hits"] - before["prefix_cache_hits"]
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"name": "prefix_caching_" + ("on" if caching else "off"),
            "output_tokens_per_s": n_out / row["elapsed_s"],
            "requests_per_s": len(work) / row["elapsed_s"], "mean_ttft_ms": 1e3 * np.mean(ttft),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0, **row,
            "compilations_after_warmup": stats["compilations_after_warmup"],
            "_outputs": [o.outputs[0].token_ids for o in outs]}


def main(argv=None) -> list[dict]:
    from vllm_tpu_lora import LLM, LoRARequest

    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        max_len = args.system_len + args.prompt_len[1] + args.output_len[1]
        model_dir = make_model(args, os.path.join(tmp, "model"), max(1024, max_len))
        paths = make_adapters(model_dir, tmp, args.num_adapters, args.rank)
        loras = [LoRARequest(f"tenant{i}", i + 1, p) for i, p in enumerate(paths)]
        work = make_workload(args)
        llms = {on: LLM(model_dir, enable_lora=True, max_loras=args.num_adapters,
                        max_lora_rank=args.rank, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=max_len, enable_prefix_caching=on)
                for on in (True, False)}
        for llm in llms.values():  # adapters in host memory before anything is timed
            for lora in loras:
                llm.llm_engine.add_lora(lora)
        best: dict[bool, dict] = {}
        for _ in range(args.rounds):
            for on, llm in llms.items():
                row = run_mode(llm, work, loras, on)
                if on not in best or row["elapsed_s"] < best[on]["elapsed_s"]:
                    best[on] = row
    outputs = {on: row.pop("_outputs") for on, row in best.items()}
    rows = [best[True], best[False]]
    agree = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    rows.append({"name": "ratio", "throughput_on_over_off": (best[True]["output_tokens_per_s"]
                                                             / best[False]["output_tokens_per_s"]),
                 "mean_ttft_off_over_on": best[False]["mean_ttft_ms"] / best[True]["mean_ttft_ms"],
                 "outputs_agree": f"{agree}/{len(work)}", "num_requests": len(work),
                 "num_adapters": args.num_adapters, "system_len": args.system_len})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
