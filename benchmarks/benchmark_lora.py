"""Multi-LoRA throughput against the base model, all rows measured in one run.

The workload of benchmark_throughput.py (random Llama, hidden 1024, 8 layers, GQA) with
rank-16 adapters on all linear layers and max_loras=8. One JSON row each for:
enable_lora=False; LoRA enabled but unused; 1, 2, 4 and 8 distinct adapters spread over
the requests (per backend); plus the time to load one adapter (disk -> host cache ->
device slot) and the compilation count after warm-up.

    python benchmarks/benchmark_lora.py                 # xla backend, full size
    python benchmarks/benchmark_lora.py --small         # smoke run
    python benchmarks/benchmark_lora.py --backends xla pallas
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import add_model_args, apply_small, make_model, make_workload  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--num-adapters", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--backends", nargs="+", default=["xla"], choices=["xla", "pallas"])
    args = apply_small(p.parse_args())
    if args.small:
        args.rank, args.max_loras, args.num_adapters = 8, 2, [1, 2]
    return args


def make_adapters(model_dir: str, out_root: str, n: int, rank: int) -> list[str]:
    from vllm_tpu_lora.testing.factory import make_peft_adapter

    return [make_peft_adapter(model_dir, os.path.join(out_root, f"lora{i}"), r=rank,
                              lora_alpha=2 * rank, seed=i, init_std=0.02) for i in range(n)]


def timed_generate(llm, work, loras) -> dict:
    from vllm_tpu_lora import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests_per_s": len(work) / elapsed, "output_tokens_per_s": n_out / elapsed,
            "elapsed_s": elapsed}


def engine(model_dir: str, args, **lora_kwargs):
    from vllm_tpu_lora import LLM

    return LLM(model_dir, max_num_seqs=args.max_num_seqs,
               max_model_len=args.prompt_len[1] + args.output_len[1],
               max_num_batched_tokens=args.max_num_batched_tokens, **lora_kwargs)


def adapter_load_row(llm, path: str, backend: str) -> dict:
    """Disk -> host cache (parse + validate) and host -> device slot, timed separately."""
    from vllm_tpu_lora import LoRARequest

    manager = llm.llm_engine.lora_manager
    req = LoRARequest("load-probe", 999, path)
    t0 = time.perf_counter()
    llm.llm_engine.add_lora(req)
    t1 = time.perf_counter()
    slot_of = manager.activate({999: req})
    t2 = time.perf_counter()
    llm.llm_engine.remove_lora(999)
    return {"name": "adapter_load", "backend": backend, "disk_to_host_ms": 1e3 * (t1 - t0),
            "host_to_slot_ms": 1e3 * (t2 - t1), "slot": slot_of[999]}


def main() -> None:
    from vllm_tpu_lora import LoRARequest

    args = parse_args()
    work = make_workload(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args, os.path.join(tmp, "model"))
        paths = make_adapters(model_dir, tmp, max(args.num_adapters), args.rank)
        base = timed_generate(engine(model_dir, args), work, None)
        rows.append({"name": "enable_lora=False", **base, "relative_to_base": 1.0})
        for backend in args.backends:
            llm = engine(model_dir, args, enable_lora=True, max_loras=args.max_loras,
                         max_lora_rank=args.rank, max_cpu_loras=max(args.num_adapters),
                         lora_backend=backend)
            stats = llm.llm_engine.stats()
            unused = timed_generate(llm, work, None)
            rows.append({"name": "lora_enabled_unused", "backend": backend, **unused,
                         "relative_to_base": unused["output_tokens_per_s"] / base["output_tokens_per_s"],
                         "warmup_s": stats["warmup_seconds"], "num_graphs": stats["num_graphs"]})
            for n in args.num_adapters:
                reqs = [LoRARequest(f"lora{i}", i + 1, paths[i]) for i in range(n)]
                loras = [reqs[i % n] for i in range(len(work))]
                res = timed_generate(llm, work, loras)
                rows.append({"name": f"{n}_distinct_adapters", "backend": backend, **res,
                             "relative_to_base": res["output_tokens_per_s"] / base["output_tokens_per_s"]})
            rows.append(adapter_load_row(llm, paths[0], backend))
            rows.append({"name": "compilations_after_warmup", "backend": backend,
                         "count": llm.llm_engine.stats()["compilations_after_warmup"]})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
