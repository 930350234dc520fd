"""Multi-LoRA throughput against the base model, all rows measured in one run.

A random Llama (hidden 512, intermediate 1408, 4 layers, 8 heads / 4 kv heads), 48
prompts of 16-64 tokens, 32 greedy new tokens, max_num_seqs=16, max_num_batched_tokens=256,
rank-16 PEFT adapters on all seven linears, max_loras=8. One JSON row each for:
enable_lora=False; LoRA enabled but unused; 1, 2, 4 and 8 distinct adapters spread over
the requests (per backend); plus the time to load one adapter (disk -> host cache ->
device slot) and the compilation count after warm-up. Every throughput row splits the
step time into device ms (XLA execution) and host ms (everything else). Configurations
run in interleaved rounds (--rounds, default 3); each row is its best round.
`--enforce-eager` adds the same rows with lazy re-tracing every step, for comparison.

    python benchmarks/benchmark_lora.py                 # xla backend, full size
    python benchmarks/benchmark_lora.py --small         # smoke run
    python benchmarks/benchmark_lora.py --backends xla pallas
    python benchmarks/benchmark_lora.py --many-adapters --rounds 1   # 1,000 adapters
    python benchmarks/benchmark_lora.py --features --num-adapters 8  # bias/DoRA/vocab LoRA

`--features` adds, per backend, N distinct adapters on engines that enable LoRA bias + DoRA
(`bias_dora_enabled`) or LoRA on embed_tokens + lm_head (`vocab_enabled`) while the
adapters use neither (the cost of enabling them), and on an engine with everything enabled
serving adapters that use them (`all_features_used`: in turn lora_bias, DoRA, or LoRA on
embed_tokens and lm_head besides the seven linears).
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
from step_timing import timed_generate  # noqa: E402

# The LoRA benchmark shape and workload (step_phases.py and benchmark_prefix_cache.py
# reuse it).
LORA_SHAPE = dict(num_requests=48, hidden=512, intermediate=1408, layers=4, heads=8,
                  kv_heads=4, prompt_len=[16, 64], output_len=[32, 32], max_num_seqs=16,
                  max_num_batched_tokens=256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--runtime", default="auto", choices=["auto", "torch_xla", "jax"])
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--num-adapters", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--backends", nargs="+", default=["xla"], choices=["xla", "pallas"])
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds per configuration; each row is its best")
    p.add_argument("--enforce-eager", action="store_true",
                   help="also run every row with lazy re-tracing (no graph replay)")
    p.add_argument("--features", action="store_true",
                   help="also rows for engines with LoRA bias / DoRA / embedding + lm_head "
                        "LoRA enabled (unused, then used)")
    p.add_argument("--many-adapters", action="store_true",
                   help="instead: --num-requests (default 1000) requests each with its own "
                        "adapter vs the same requests over 8 adapters (see many_adapters.py)")
    p.add_argument("--breakdown", action="store_true",
                   help="with --many-adapters: two more halves per round that split the cost "
                        "(as many adapters as slots, no swaps; the distinct adapters pre-read into the host "
                        "cache, so slot writes without disk); raises max_cpu_loras to hold them")
    p.add_argument("--profile-host", action="store_true",
                   help="with --many-adapters: the engine thread's extra host time per adapter "
                        "by function (cProfile, in an extra untimed round first)")
    p.set_defaults(**LORA_SHAPE)
    args = apply_small(p.parse_args())
    if args.small:
        args.rank, args.max_loras, args.num_adapters = 8, 2, [1, 2]
    if args.many_adapters and "--num-requests" not in sys.argv:
        args.num_requests = 24 if args.small else 1000
    return args


ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FEATURE_ENGINES = {  # --features: engine flags
    "bias_dora_enabled": dict(enable_lora_bias=True, enable_dora=True),
    "vocab_enabled": dict(lora_target_modules=[*ALL_LINEARS, "embed_tokens", "lm_head"]),
}


def make_adapters(model_dir: str, out_root: str, n: int, rank: int) -> list[str]:
    from vllm_tpu_lora.testing.factory import make_peft_adapter

    return [make_peft_adapter(model_dir, os.path.join(out_root, f"lora{i}"), r=rank,
                              lora_alpha=2 * rank, seed=i, init_std=0.02) for i in range(n)]


def engine(model_dir: str, args, **kwargs):
    from vllm_tpu_lora import LLM

    return LLM(model_dir, max_num_seqs=args.max_num_seqs,
               max_model_len=args.prompt_len[1] + args.output_len[1],
               max_num_batched_tokens=args.max_num_batched_tokens, runtime=getattr(args, "runtime", "auto"),
               **kwargs)


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


def best_of(rounds: list[dict]) -> dict:
    """The fastest of a configuration's rounds (least disturbed by this shared machine)."""
    return max(rounds, key=lambda r: r["output_tokens_per_s"])


def mode_rows(model_dir, paths, work, args, eager: bool) -> list[dict]:
    """Every configuration of one capture mode, measured in --rounds interleaved rounds
    (base, unused, 1, 2, ... adapters, then again), so slow drifts of the machine hit all
    of them alike; each row is its best round."""
    from vllm_tpu_lora import LoRARequest

    base_llm = engine(model_dir, args, enforce_eager=eager)
    configs = {"enable_lora=False": (base_llm, None)}
    llms = {}
    for backend in args.backends:
        llms[backend] = engine(model_dir, args, enable_lora=True, max_loras=args.max_loras,
                               max_lora_rank=args.rank, max_cpu_loras=max(args.num_adapters),
                               lora_backend=backend, enforce_eager=eager)
        configs[f"{backend}:lora_enabled_unused"] = (llms[backend], None)
        for n in args.num_adapters:
            reqs = [LoRARequest(f"lora{i}", i + 1, paths[i]) for i in range(n)]
            configs[f"{backend}:{n}_distinct_adapters"] = (
                llms[backend], [reqs[i % n] for i in range(len(work))])
    if args.features:
        configs.update(feature_configs(model_dir, paths, work, args, eager))
    results = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (llm, loras) in configs.items():
            results[name].append(timed_generate(llm, work, loras))
    base = best_of(results.pop("enable_lora=False"))
    rows = [{"name": "enable_lora=False", "enforce_eager": eager, **base,
             "relative_to_base": 1.0, "rounds": args.rounds}]
    for key, rounds in results.items():
        backend, name = key.split(":")
        res = best_of(rounds)
        row = {"name": name, "backend": backend, "enforce_eager": eager, **res,
               "relative_to_base": res["output_tokens_per_s"] / base["output_tokens_per_s"]}
        if name == "lora_enabled_unused":
            stats = llms[backend].llm_engine.stats()
            row.update(warmup_s=stats["warmup_seconds"], num_graphs=stats["num_graphs"])
        rows.append(row)
    for backend, llm in llms.items():
        rows.append({**adapter_load_row(llm, paths[0], backend), "enforce_eager": eager})
        rows.append({"name": "compilations_after_warmup", "backend": backend,
                     "enforce_eager": eager,
                     "count": llm.llm_engine.stats()["compilations_after_warmup"]})
    return rows


def feature_configs(model_dir, paths, work, args, eager: bool) -> dict:
    """--features: {name: (engine, per-request adapters)} for N = max(--num-adapters)."""
    from vllm_tpu_lora import LoRARequest

    n = max(args.num_adapters)
    # One feature per adapter, in turn (PEFT refuses lora_bias with DoRA, and lora_bias on
    # an embedding; DoRA on embed_tokens / lm_head is not served).
    from vllm_tpu_lora.testing.factory import make_peft_adapter

    kinds = [dict(lora_bias=True), dict(use_dora=True),
             dict(target_modules=[*ALL_LINEARS, "embed_tokens", "lm_head"])]
    used = [make_peft_adapter(model_dir, os.path.join(os.path.dirname(paths[0]), f"all{i}"),
                              r=args.rank, lora_alpha=2 * args.rank, seed=100 + i,
                              init_std=0.02, **kinds[i % 3]) for i in range(n)]
    configs = {}
    for backend in args.backends:
        common = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank,
                      max_cpu_loras=n, lora_backend=backend, enforce_eager=eager)
        for name, flags in FEATURE_ENGINES.items():
            llm = engine(model_dir, args, **common, **flags)
            reqs = [LoRARequest(f"lora{i}", i + 1, paths[i]) for i in range(n)]
            configs[f"{backend}:{n}_distinct_adapters+{name}"] = (
                llm, [reqs[i % n] for i in range(len(work))])
        llm = engine(model_dir, args, **common, **FEATURE_ENGINES["bias_dora_enabled"],
                     **FEATURE_ENGINES["vocab_enabled"])
        reqs = [LoRARequest(f"all{i}", i + 1, used[i]) for i in range(n)]
        configs[f"{backend}:{n}_distinct_adapters+all_features_used"] = (
            llm, [reqs[i % n] for i in range(len(work))])
    return configs


def main() -> None:
    args = parse_args()
    work = make_workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args, os.path.join(tmp, "model"))
        if args.many_adapters:
            from many_adapters import run

            for row in run(args, model_dir, tmp, timed_generate, engine):
                print(json.dumps(row), flush=True)
            return
        paths = make_adapters(model_dir, tmp, max(args.num_adapters), args.rank)
        for eager in [False, True] if args.enforce_eager else [False]:
            for row in mode_rows(model_dir, paths, work, args, eager):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
