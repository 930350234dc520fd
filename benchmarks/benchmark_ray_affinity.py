"""Adapter loads per request on Ray Serve, with and without adapter-affinity routing.

`vllm-tpu-lora serve-ray` with --num-replicas replicas of a random tiny Llama, --adapters
PEFT adapters (rank 8) served through a host cache of --max-cpu-loras per replica. The same
traffic goes to a server with affinity (Serve's multiplexing by model id) and to one
without (--no-adapter-affinity): one round with each adapter (and the base model) coming
into use a second apart, then --rounds bursts over all of them. One JSON row per mode:
adapter host loads summed over the replicas (start-up preloads excluded), loads per
request, requests per second.

    python benchmarks/benchmark_ray_affinity.py [--rounds 8] [--adapters 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import httpx
import numpy as np
import openai


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--adapters", type=int, default=6)
    p.add_argument("--max-cpu-loras", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    return p.parse_args()


def loads(url: str) -> int:
    stats = httpx.get(url + "/stats", timeout=60).json()["replicas"]
    return sum(a["host_loads"] for r in stats for a in r["loras"].values())


async def send(base_url: str, jobs, max_tokens: int, stagger: float) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                  timeout=600) as client:
        async def one(i, model, prompt):
            await asyncio.sleep(i * stagger)
            await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                            temperature=0, extra_body={"ignore_eos": True})

        await asyncio.gather(*(one(i, m, p) for i, (m, p) in enumerate(jobs)))


def measure(model_dir: str, paths: dict, args, affinity: bool) -> dict:
    from vllm_tpu_lora.testing.server import RemoteServer

    flags = [model_dir, "--served-model-name", "base", "--num-replicas", str(args.replicas),
             "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "64",
             "--enable-lora", "--max-loras", "2", "--max-cpu-loras", str(args.max_cpu_loras),
             "--max-lora-rank", "8", "--lora-modules", *[f"{n}={p}" for n, p in paths.items()],
             *([] if affinity else ["--no-adapter-affinity"])]
    cmd = [sys.executable, "-m", "vllm_tpu_lora.entrypoints.cli", "serve-ray"]
    rng = np.random.default_rng(0)
    models = ["base", *paths]

    def rounds(n):
        return [(m, rng.integers(3, 500, size=int(rng.integers(3, 20))).tolist())
                for _ in range(n) for m in models]

    with RemoteServer(flags, command=cmd, startup_timeout=600, stop_timeout=150) as srv:
        while len(httpx.get(srv.url + "/stats", timeout=60).json()["replicas"]) < args.replicas:
            time.sleep(1)
        before = loads(srv.url)
        first, bursts = rounds(1), rounds(args.rounds)
        t0 = time.perf_counter()
        asyncio.run(send(srv.base_url, first, args.max_tokens, stagger=1.0))
        t1 = time.perf_counter()
        asyncio.run(send(srv.base_url, bursts, args.max_tokens, stagger=0.0))
        t2 = time.perf_counter()
        total = loads(srv.url) - before
    n = len(first) + len(bursts)
    return {"name": "affinity" if affinity else "no_affinity", "replicas": args.replicas,
            "adapters": len(paths), "max_cpu_loras": args.max_cpu_loras, "requests": n,
            "adapter_loads": total, "loads_per_request": total / n,
            "burst_requests_per_s": len(bursts) / (t2 - t1), "first_round_s": t1 - t0}


def main() -> None:
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from vllm_tpu_lora.testing.factory import make_peft_adapter, make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_llama(os.path.join(tmp, "model"))
        paths = {f"a{i}": make_peft_adapter(model_dir, os.path.join(tmp, f"a{i}"), r=8,
                                            seed=i, init_std=0.05)
                 for i in range(args.adapters)}
        for affinity in (True, False):
            print(json.dumps(measure(model_dir, paths, args, affinity)), flush=True)


if __name__ == "__main__":
    main()
