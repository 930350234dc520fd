"""Online serving benchmark: N concurrent streaming clients against an OpenAI server.

Each client sends a fixed number of streaming /v1/completions requests back to back,
round-robin over the base model or the first A adapters the server lists. Prints one JSON
row per run: throughput, TTFT, inter-token (inter-chunk) latency and end-to-end latency
percentiles, and the server's compilations after warm-up.

    # against a running server
    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000 --num-clients 32
    # self-contained: a tiny random Llama (and A PEFT adapters) served on 127.0.0.1
    python benchmarks/benchmark_serving.py --spawn-tiny --num-clients 32
    python benchmarks/benchmark_serving.py --spawn-tiny --num-clients 32 --num-adapters 6 --max-loras 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import httpx
import numpy as np


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-clients", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--num-adapters", type=int, default=0, help="0: the base model only")
    p.add_argument("--prompt-words", type=int, nargs=2, default=[4, 24])
    p.add_argument("--max-tokens", type=int, nargs=2, default=[16, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    spawn = p.add_argument_group("--spawn-tiny: start a server on a tiny random model")
    spawn.add_argument("--spawn-tiny", action="store_true")
    spawn.add_argument("--hidden", type=int, default=64)
    spawn.add_argument("--layers", type=int, default=2)
    spawn.add_argument("--max-num-seqs", type=int, default=32)
    spawn.add_argument("--max-num-batched-tokens", type=int, default=128)
    spawn.add_argument("--max-loras", type=int, default=2)
    spawn.add_argument("--compare-offline", action="store_true",
                       help="also run the same workload through LLM.generate (server stopped)")
    return p.parse_args()


def make_workload(args, models: list[str]) -> list[list[tuple[str, str, int]]]:
    """Per client: (model, prompt, max_tokens) jobs, fixed by --seed."""
    rng = np.random.default_rng(args.seed)
    words = ["cat", "dog", "engine", "river", "blue", "seven", "the", "of", "runs", "quickly"]
    jobs, k = [], 0
    for _ in range(args.num_clients):
        mine = []
        for _ in range(args.requests_per_client):
            n_words = int(rng.integers(args.prompt_words[0], args.prompt_words[1] + 1))
            prompt = " ".join(rng.choice(words, size=n_words))
            out_len = int(rng.integers(args.max_tokens[0], args.max_tokens[1] + 1))
            mine.append((models[k % len(models)], prompt, out_len))
            k += 1
        jobs.append(mine)
    return jobs


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int, timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunk_times, tokens = [], 0
    async with http.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
    if not chunk_times:
        return {"error": "no text received"}
    return {"ttft": chunk_times[0] - start, "e2e": time.perf_counter() - start,
            "itl": list(np.diff(chunk_times)), "tokens": tokens}


async def run_clients(args, url: str, jobs) -> tuple[list[dict], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.num_clients + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits) as http:
        async def client(mine):
            return [await one_request(http, url, *job, args.timeout) for job in mine]
        start = time.perf_counter()
        per_client = await asyncio.gather(*(client(mine) for mine in jobs))
        return [r for results in per_client for r in results], time.perf_counter() - start


def summarize(args, results: list[dict], duration: float, stats: dict, models) -> dict:
    ok = [r for r in results if "error" not in r]
    ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1000, 2) if xs else None  # noqa: E731
    ttft, e2e = [r["ttft"] for r in ok], [r["e2e"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "clients": args.num_clients, "adapters": args.num_adapters, "models": len(models),
        "requests": len(results), "errors": len(results) - len(ok),
        "duration_s": round(duration, 2), "req_per_s": round(len(ok) / duration, 2),
        "output_tok_per_s": round(tokens / duration, 1),
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
        "e2e_ms_p50": ms(e2e, 50), "e2e_ms_p99": ms(e2e, 99),
        "compilations_after_warmup": stats.get("compilations_after_warmup"),
        "num_preemptions": stats.get("num_preemptions"),
        "first_error": next((r["error"] for r in results if "error" in r), None),
    }


def served_models(url: str, api_key: str | None, num_adapters: int) -> list[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    cards = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    base = [c["id"] for c in cards if not c.get("parent")]
    adapters = [c["id"] for c in cards if c.get("parent")]
    if num_adapters > len(adapters):
        raise SystemExit(f"--num-adapters {num_adapters}: the server lists {len(adapters)}")
    return adapters[:num_adapters] if num_adapters else base[:1]


def offline_row(args, flags: list[str], jobs, models) -> dict:
    """The same requests through LLM.generate in this process: the engine's own speed,
    so the server's overhead is the difference."""
    from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
    from vllm_tpu_lora.entrypoints.args import engine_kwargs
    from vllm_tpu_lora.entrypoints.openai.cli_args import make_arg_parser

    ns = make_arg_parser().parse_args(flags)
    llm = LLM(ns.model, **engine_kwargs(ns))
    paths = {m.name: m.path for m in ns.lora_modules or []}
    flat = [job for mine in jobs for job in mine]
    ids = {name: i + 1 for i, name in enumerate(paths)}  # one id per adapter, as the server
    loras = [LoRARequest(m, ids[m], paths[m]) if m in paths else None for m, _, _ in flat]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, _, n in flat]
    start = time.perf_counter()
    outs = llm.generate([p for _, p, _ in flat], params, use_tqdm=False, lora_request=loras)
    duration = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"offline_LLM_generate": True, "requests": len(flat), "duration_s": round(duration, 2),
            "output_tok_per_s": round(tokens / duration, 1)}


def spawn_tiny(args, workdir: str):
    from vllm_tpu_lora.testing.factory import make_peft_adapter, make_tiny_llama
    from vllm_tpu_lora.testing.server import RemoteServer

    model = make_tiny_llama(f"{workdir}/model", hidden_size=args.hidden, num_layers=args.layers,
                            max_position_embeddings=1024)
    flags = ["--model", model, "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-model-len", "512", "--disable-uvicorn-access-log"]
    if args.num_adapters:
        paths = [make_peft_adapter(model, f"{workdir}/a{i}", r=8, seed=i)
                 for i in range(args.num_adapters)]
        flags += ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", "8",
                  "--max-cpu-loras", str(max(args.num_adapters, args.max_loras)),
                  "--lora-modules", *[f"a{i}={p}" for i, p in enumerate(paths)]]
    return RemoteServer(flags, api_key=args.api_key, startup_timeout=600), flags


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        server, flags = spawn_tiny(args, workdir) if args.spawn_tiny else (None, None)
        url = server.url if server else args.base_url.rstrip("/")
        try:
            models = served_models(url, args.api_key, args.num_adapters)
            jobs = make_workload(args, models)
            asyncio.run(run_clients(args, url, [jobs[0][:1]]))  # one warm request
            results, duration = asyncio.run(run_clients(args, url, jobs))
            stats = httpx.get(url + "/stats", timeout=30).json()
            print(json.dumps(summarize(args, results, duration, stats, models)), flush=True)
        finally:
            if server:
                server.stop()
        if server and args.compare_offline:
            print(json.dumps(offline_row(args, flags, jobs, models)))


if __name__ == "__main__":
    main()
