"""`benchmark_lora.py --many-adapters`: one engine, far more adapters than slots.

max_loras = max_num_seqs = 16 (the default max_cpu_loras, 16, bounds the idle host cache).
The same requests (default 1,000; prompts 16-64 tokens, 32 greedy new tokens) run twice:
spread over 8 adapters, and each with its own rank-16 adapter (1,000 distinct, read from
disk during the run by the background loader: fresh adapter ids every round, so nothing is
cached), in --rounds interleaved rounds, the two halves in alternating order. Rows: the
best round of each with the host/device split, the ratio of the two (target >= 0.9) and
each round's own ratio with their median, adapter reads and slot writes; the cost of one
slot write; and adapter cold start: an idle engine gets a request whose adapter it has
never seen (arrival -> first token), against the same request with the adapter already
in a slot. --breakdown adds two diagnostic halves: as many adapters as slots (16), and
the distinct adapters read into the host cache before the timed run (slot writes, no
disk); the engine then gets max_cpu_loras = requests + 16 to hold them. --profile-host
runs each half once more first, untimed, under cProfile (the engine thread), and adds a row of the
functions whose cumulative time grew most from the 8-adapter half to the distinct one,
in ms per adapter: where the engine thread's extra host time per step goes.

The first adapter is made with peft; the others are copies with re-drawn weights (the same
files and format, written with safetensors: ~50x cheaper than running peft 1,000 times).
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import statistics
import time

import torch
from safetensors.torch import load_file, save_file


def make_many_adapters(model_dir: str, root: str, n: int, rank: int) -> list[str]:
    import shutil

    from vllm_tpu_lora.testing.factory import make_peft_adapter

    first = make_peft_adapter(model_dir, os.path.join(root, "many0"), r=rank,
                              lora_alpha=2 * rank, seed=0, init_std=0.02)
    tensors = load_file(os.path.join(first, "adapter_model.safetensors"))
    paths = [first]
    for i in range(1, n):
        dst = os.path.join(root, f"many{i}")
        os.makedirs(dst)
        shutil.copy(os.path.join(first, "adapter_config.json"), dst)
        gen = torch.Generator().manual_seed(i)
        save_file({k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in tensors.items()},
                  os.path.join(dst, "adapter_model.safetensors"))
        paths.append(dst)
    return paths


def slot_write_row(llm, path: str, repeats: int = 20) -> dict:
    """Mean host->device slot write of one adapter (one transfer + one cached graph)."""
    from vllm_tpu_lora import LoRARequest

    engine = llm.llm_engine
    manager = engine.lora_manager
    req = LoRARequest("slot-probe", 10**7, path)
    engine.add_lora(req)
    host = manager.registry.host_copy(req.lora_int_id)
    free = manager.slots.index(None) if None in manager.slots else 0
    manager.write_slot(free, host)  # first write of this process: not timed
    t0 = time.perf_counter()
    for _ in range(repeats):
        manager.write_slot(free, host)
    ms = 1e3 * (time.perf_counter() - t0) / repeats
    engine.remove_lora(req.lora_int_id)
    manager.slots[free] = None  # the slot's data is stale now: nothing may index it
    return {"name": "slot_write", "ms": ms, "bytes": host.nbytes}


def cold_start_rows(llm, paths: list[str], first_id: int, trials: int = 5) -> list[dict]:
    """Arrival -> first token on an idle engine, adapter never seen vs already in a slot."""
    from vllm_tpu_lora import LoRARequest, SamplingParams

    engine = llm.llm_engine
    one = SamplingParams(temperature=0.0, max_tokens=1)
    cold, warm = [], []
    for t in range(trials):
        req = LoRARequest(f"cold{t}", first_id + t, paths[t])
        for bucket in (cold, warm):
            rid = f"cold-start-{t}-{len(bucket)}"
            engine.add_request(rid, {"prompt_token_ids": list(range(5, 37))}, one,
                               lora_request=req)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        m = out.metrics
                        bucket.append(1e3 * (m["first_token_time"] - m["arrival_time"]))
        engine.remove_lora(req.lora_int_id)
    return [{"name": "adapter_cold_start", "ttft_ms_median": statistics.median(cold),
             "ttft_ms_all": cold, "trials": trials},
            {"name": "adapter_warm_start", "ttft_ms_median": statistics.median(warm),
             "ttft_ms_all": warm, "trials": trials}]


def _breakdown_rows(results: dict[str, list[dict]], n: int, slots: int) -> list[dict]:
    """--breakdown's halves: best round, and pooled time relative to the 8-adapter half."""
    few_s = sum(r["elapsed_s"] for r in results["8_adapters"])
    return [{"name": f"many_adapters:breakdown:{name}", "requests": n,
             **max(rows, key=lambda r: r["output_tokens_per_s"]),
             "relative_pooled": few_s / sum(r["elapsed_s"] for r in rows)}
            for name, rows in results.items()
            if name in (f"{slots}_adapters_no_swaps", f"{n}_adapters_host_cached")]


def _times(profile: cProfile.Profile, which: int) -> dict[str, float]:
    """{"file:line function": seconds} of a finished profile: which = 2 own time, 3
    cumulative."""
    stats = pstats.Stats(profile).stats
    return {f"{os.path.basename(f)}:{line} {fn}": v[which] for (f, line, fn), v in stats.items()}


def host_profile_row(profiles: dict[str, cProfile.Profile], n: int, top: int = 25) -> dict:
    """The engine thread's functions whose time grew most from the 8-adapter half to the
    distinct-adapter one, ms per distinct adapter: cumulative (where in the engine) and
    own time (what it is)."""
    row = {"name": "many_adapters:host_profile", "adapters": n}
    for key, which in (("extra_ms_per_adapter", 3), ("extra_own_ms_per_adapter", 2)):
        few, many = (_times(profiles[k], which) for k in ("8_adapters", f"{n}_adapters"))
        grew = sorted(((many[k] - few.get(k, 0.0), k) for k in many), reverse=True)[:top]
        row[key] = {k: round(1e3 * d / n, 4) for d, k in grew}
    return row


def run(args, model_dir: str, tmp: str, timed_generate, engine_factory) -> list[dict]:
    from benchmark_throughput import make_workload

    from vllm_tpu_lora import LoRARequest

    n = args.num_requests
    work = make_workload(args)
    paths = make_many_adapters(model_dir, os.path.join(tmp, "many"), n, args.rank)
    breakdown = args.breakdown
    # --breakdown: the host cache must hold a whole half's adapters (diagnostic only).
    cache = {"max_cpu_loras": n + 16} if breakdown else {}
    llm = engine_factory(model_dir, args, enable_lora=True, max_loras=args.max_num_seqs,
                         max_lora_rank=args.rank, **cache)
    manager = llm.llm_engine.lora_manager
    few = [LoRARequest(f"few{i}", i + 1, paths[i]) for i in range(8)]
    slots = args.max_num_seqs  # = max_loras
    as_many = [LoRARequest(f"slots{i}", 100 + i, paths[i]) for i in range(min(slots, n))]
    results: dict[str, list[dict]] = {"8_adapters": [], f"{n}_adapters": []}
    if breakdown:
        results.update({f"{slots}_adapters_no_swaps": [], f"{n}_adapters_host_cached": []})
    fresh = {f"{n}_adapters", f"{n}_adapters_host_cached"}  # halves with new adapter ids
    profiles: dict[str, cProfile.Profile] = {}
    next_id = 1000
    profile_host = getattr(args, "profile_host", False)
    for rnd in range(-1 if profile_host else 0, args.rounds):  # -1: the profiled, untimed round
        # Alternate the halves' order (ABBA...): a host that drifts within a round then
        # favours none of them over the rounds.
        for name in list(results)[::1 if rnd % 2 == 0 else -1]:
            if name == "8_adapters":
                loras = [few[i % 8] for i in range(n)]
            elif name == f"{slots}_adapters_no_swaps":  # as many adapters as slots: no swaps
                loras = [as_many[i % len(as_many)] for i in range(n)]
            else:  # fresh ids: every adapter is read from disk during the run
                loras = [LoRARequest(f"many{i}", next_id + i, paths[i]) for i in range(n)]
                next_id += n
                if name.endswith("host_cached"):  # ... or before it, untimed
                    for lr in loras:
                        llm.llm_engine.add_lora(lr)
            loads0, slots0 = manager.num_host_loads, manager.num_slot_loads
            profiling = rnd < 0
            if profiling:
                profiles[name] = cProfile.Profile()
            with profiles[name] if profiling else contextlib.nullcontext():
                row = timed_generate(llm, work, loras)
            row.update(adapter_reads=manager.num_host_loads - loads0,
                       slot_writes=manager.num_slot_loads - slots0)
            if not profiling:
                results[name].append(row)
            if name in fresh:
                for lr in loras:
                    llm.llm_engine.remove_lora(lr.lora_int_id)
    best = {name: max(rows, key=lambda r: r["output_tokens_per_s"])
            for name, rows in results.items()}
    few_row, many_row = best["8_adapters"], best[f"{n}_adapters"]
    # Each round's own ratio too: its two halves ran back to back, so a slow spell of this
    # shared host moves both best rows less than it moves one round.
    per_round = [m["output_tokens_per_s"] / f["output_tokens_per_s"]
                 for f, m in zip(results["8_adapters"], results[f"{n}_adapters"])]
    stats = llm.llm_engine.stats(per_adapter=False)
    rows = [{"name": "many_adapters:8_adapters", "requests": n, **few_row},
            {"name": f"many_adapters:{n}_distinct_adapters", "requests": n, **many_row,
             "relative_to_8_adapters": many_row["output_tokens_per_s"]
             / few_row["output_tokens_per_s"],
             "relative_per_round": per_round, "relative_median": statistics.median(per_round),
             # Every round of each half pooled (the same requests each round: total time
             # over total time), the estimate that uses all the time measured.
             "relative_pooled": sum(r["elapsed_s"] for r in results["8_adapters"])
             / sum(r["elapsed_s"] for r in results[f"{n}_adapters"]),
             "rounds": args.rounds},
            *_breakdown_rows(results, n, slots),
            *([host_profile_row(profiles, n)] if profiles else []),
            slot_write_row(llm, paths[0]),
            *cold_start_rows(llm, paths, next_id),
            {"name": "compilations_after_warmup", "count": stats["compilations_after_warmup"],
             "captures_after_warmup": stats["captures_after_warmup"]}]
    return rows
