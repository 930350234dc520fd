"""Offline throughput: this engine vs HF transformers `generate` (batched), same run.

A fixed-seed workload of mixed prompt and output lengths on a random Llama (hidden
1024, 8 layers, GQA by default). Prints JSON rows: the engine, HF, their ratio, and the
per-matmul XLA-CPU vs PyTorch-eager ratio that frames the comparison.

    python benchmarks/benchmark_throughput.py            # full size
    python benchmarks/benchmark_throughput.py --small    # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
from step_timing import timed_generate


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model + workload flags shared by the benchmarks (--small applied in apply_small)."""
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128])
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="tiny sizes for a smoke run")


def apply_small(args: argparse.Namespace) -> argparse.Namespace:
    if args.small:
        args.num_requests, args.hidden, args.layers, args.heads, args.kv_heads = 8, 64, 2, 4, 2
        args.intermediate, args.vocab, args.prompt_len, args.output_len = 128, 512, [4, 32], [4, 16]
        args.max_num_seqs, args.max_num_batched_tokens, args.hf_batch_size = 8, 64, 4
    return args


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--skip-hf", action="store_true")
    return apply_small(p.parse_args())


def make_model(args, out_dir: str, max_position_embeddings: int = 1024) -> str:
    from vllm_tpu_lora.testing.factory import make_tiny_llama

    return make_tiny_llama(out_dir, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=args.heads, num_kv_heads=args.kv_heads,
                           intermediate_size=args.intermediate, vocab_size=args.vocab,
                           max_position_embeddings=max_position_embeddings, seed=args.seed)


def make_workload(args) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    work = []
    for _ in range(args.num_requests):
        plen = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        olen = int(rng.integers(args.output_len[0], args.output_len[1] + 1))
        work.append((rng.integers(3, args.vocab, size=plen).tolist(), olen))
    return work


def run_engine(model_dir: str, work, args) -> dict:
    from vllm_tpu_lora import LLM

    max_len = args.prompt_len[1] + args.output_len[1]
    t0 = time.perf_counter()
    llm = LLM(model_dir, max_num_seqs=args.max_num_seqs, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    startup = time.perf_counter() - t0
    row = timed_generate(llm, work, keep_outputs=True)
    stats = llm.llm_engine.stats()
    return {"name": "vllm_tpu_lora", **row,
            "startup_s": startup, "warmup_s": stats["warmup_seconds"],
            "num_graphs": stats["num_graphs"],
            "compilations_after_warmup": stats["compilations_after_warmup"]}


def run_hf(model_dir: str, work, args) -> dict:
    """Batches of `hf_batch_size` in arrival order, left-padded; each batch runs to its
    longest requested output (what static batching costs), counting only requested tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    n_out, outputs = 0, []
    for i in range(0, len(work), args.hf_batch_size):
        batch = work[i:i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max(o for _, o in batch), eos_token_id=None,
                                 pad_token_id=0)
        for row, (_, o) in zip(gen[:, width:].tolist(), batch):
            outputs.append(row[:o])
            n_out += o
    elapsed = time.perf_counter() - t0
    return {"name": "hf_transformers", "requests_per_s": len(work) / elapsed,
            "output_tokens_per_s": n_out / elapsed, "elapsed_s": elapsed,
            "batch_size": args.hf_batch_size, "output_tokens": n_out, "outputs": outputs}


def matmul_ratio(args) -> dict:
    """XLA-CPU vs PyTorch-eager time for the model's largest matmul shape."""
    from vllm_tpu_lora import platform

    m, k, n = 256, args.hidden, args.intermediate * 2
    a, b = torch.randn(m, k), torch.randn(k, n)
    dev = platform.xla_device()
    ax, bx = a.to(dev), b.to(dev)
    (ax @ bx).cpu()

    def best(fn, reps=20):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    eager = best(lambda: a @ b)
    xla = best(lambda: (ax @ bx).cpu())
    return {"name": "matmul_xla_vs_eager", "shape": [m, k, n], "eager_ms": eager * 1e3,
            "xla_ms": xla * 1e3, "xla_slowdown": xla / eager}


def main() -> None:
    args = parse_args()
    work = make_workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args, os.path.join(tmp, "model"))
        eng = run_engine(model_dir, work, args)
        rows = [eng]
        if not args.skip_hf:
            hf = run_hf(model_dir, work, args)
            same = sum(a == b for a, b in zip(eng["outputs"], hf["outputs"]))
            rows.append(hf)
            rows.append({"name": "ratio", "engine_over_hf_output_tokens_per_s":
                         eng["output_tokens_per_s"] / hf["output_tokens_per_s"],
                         "greedy_outputs_identical": f"{same}/{len(work)}"})
        rows.append(matmul_ratio(args))
    for row in rows:
        row.pop("outputs", None)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
