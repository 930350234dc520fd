"""Cold start of an adapter the server was never told about, resolved by name from a local
S3-compatible store (moto's server, a process of its own) or a directory, against an
adapter already in a slot: time from the request to its first streamed token, through the
real server and HTTP. The server's /stats says how much of it was the download.

    python benchmarks/benchmark_resolver_cold_start.py --out docs/results/resolver_cold_start.jsonl

Needs the dev extra (boto3, moto[server]). Each cold request names a fresh adapter, so
every one lists, downloads, validates, reads and writes a slot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import httpx


def ttft_ms(url: str, model: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return 1e3 * (time.perf_counter() - t0)
    raise RuntimeError(f"{model}: no token streamed")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from vllm_tpu_lora.testing.factory import make_peft_adapter, make_tiny_llama
    from vllm_tpu_lora.testing.s3 import LocalS3Server
    from vllm_tpu_lora.testing.server import RemoteServer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(os.path.join(tmp, "m"), hidden_size=256, num_layers=2,
                                num_heads=4, num_kv_heads=2, intermediate_size=512)
        first = make_peft_adapter(model, os.path.join(tmp, "a0"), r=args.rank, seed=0)
        with LocalS3Server(os.path.join(tmp, "moto.log")) as store:
            env = {**store.env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
            s3 = store.client()
            s3.create_bucket(Bucket="adapters")
            directory = os.path.join(tmp, "dir")
            for i in range(args.trials):
                for f in os.listdir(first):
                    s3.upload_file(os.path.join(first, f), "adapters", f"p/s3-{i}/{f}")
                shutil.copytree(first, os.path.join(directory, f"dir-{i}"))
            server_args = ["--model", model, "--max-num-seqs", "8", "--max-num-batched-tokens",
                           "32", "--max-model-len", "64", "--enable-lora", "--max-loras", "2",
                           "--max-lora-rank", str(args.rank), "--lora-modules", f"warm={first}",
                           "--lora-resolver-uri", "s3://adapters/p", "--lora-resolver-uri", directory,
                           "--lora-resolver-cache-dir", os.path.join(tmp, "cache")]
            with RemoteServer(server_args, env=env) as srv:
                prompt = list(range(5, 15))
                ttft_ms(srv.url, "warm", prompt)  # into a slot
                cases = {"in_slot": ["warm"] * args.trials,
                         "s3": [f"s3-{i}" for i in range(args.trials)],
                         "directory": [f"dir-{i}" for i in range(args.trials)]}
                for source, names in cases.items():
                    times = [ttft_ms(srv.url, n, prompt) for n in names]
                    rows.append({"row": "cold_start", "source": source,
                                 "ttft_ms_median": statistics.median(times),
                                 "ttft_ms_all": times})
                stats = srv.stats()["lora_resolvers"]
                s3_stats = stats[0]
                rows.append({"row": "s3_downloads", **s3_stats,
                             "ms_per_download": 1e3 * s3_stats["download_seconds"]
                             / max(1, s3_stats["hits"])})
    for row in rows:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
