"""This engine vs HF PEFT on the same prompts and adapters, side by side in one run.

For 1, 4, 16 and 64 distinct adapters (rank 16, all linear layers) on a random Llama
(hidden 1024, 8 layers, GQA), the same requests go through
  (a) vllm_tpu_lora (continuous batching, max_loras = min(n, 16), max_cpu_loras = n),
  (b) PEFT's mixed batch: one `generate(..., adapter_names=[...])` per batch,
  (c) PEFT grouped: the requests of each adapter batched after `set_adapter(name)`.
JSON rows give output tokens/s for each and the ratios; the greedy outputs of (a) and (b)
are compared (float32: they must be identical).

    python benchmarks/benchmark_vs_peft.py             # full size
    python benchmarks/benchmark_vs_peft.py --small     # smoke run (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_lora import make_adapters  # noqa: E402
from benchmark_throughput import add_model_args, apply_small, make_model, make_workload  # noqa: E402
from step_timing import timed_generate  # noqa: E402

PEFT_BASE = "__base__"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--peft-batch-size", type=int, default=16)
    p.set_defaults(num_requests=64, prompt_len=[16, 64], output_len=[16, 48])
    args = apply_small(p.parse_args(argv))
    if args.small:
        args.rank, args.num_adapters, args.peft_batch_size = 8, [1, 3], 4
    return args


def run_engine(model_dir, paths, work, args) -> tuple[dict, list]:
    from vllm_tpu_lora import LLM, LoRARequest

    n = len(paths)
    llm = LLM(model_dir, enable_lora=True, max_loras=min(n, 16), max_cpu_loras=n,
              max_lora_rank=args.rank, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prompt_len[1] + args.output_len[1])
    reqs = [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(paths)]
    row = timed_generate(llm, work, [reqs[i % n] for i in range(len(work))], keep_outputs=True)
    tokens = row.pop("outputs")
    return {**row, "compilations_after_warmup":
            llm.llm_engine.stats()["compilations_after_warmup"]}, tokens


def _peft_generate(model, batch, names=None) -> list[list[int]]:
    """Left-padded greedy generate of one batch; each row cut to its own output length."""
    width = max(len(p) for p, _ in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
    kwargs = {"adapter_names": names} if names is not None else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max(o for _, o in batch), eos_token_id=None,
                             pad_token_id=0, **kwargs)
    return [row[:o] for row, (_, o) in zip(out[:, width:].tolist(), batch)]


def run_peft(model_dir, paths, work, args, grouped: bool) -> tuple[dict, list]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, paths[0], adapter_name="lora0",
                                      torch_device="cpu")
    for i, path in enumerate(paths[1:], start=1):
        model.load_adapter(path, adapter_name=f"lora{i}", torch_device="cpu")
    n, bs = len(paths), args.peft_batch_size
    names = [f"lora{i % n}" for i in range(len(work))]
    outputs: list = [None] * len(work)
    t0 = time.perf_counter()
    if grouped:
        for name in dict.fromkeys(names):
            model.set_adapter(name)
            idx = [i for i, nm in enumerate(names) if nm == name]
            for j in range(0, len(idx), bs):
                chunk = idx[j:j + bs]
                for i, toks in zip(chunk, _peft_generate(model, [work[i] for i in chunk])):
                    outputs[i] = toks
    else:
        for j in range(0, len(work), bs):
            chunk = list(range(j, min(j + bs, len(work))))
            rows = _peft_generate(model, [work[i] for i in chunk], [names[i] for i in chunk])
            for i, toks in zip(chunk, rows):
                outputs[i] = toks
    elapsed = time.perf_counter() - t0
    return {"output_tokens_per_s": sum(map(len, outputs)) / elapsed, "elapsed_s": elapsed}, outputs


def compare(n: int, model_dir: str, paths: list[str], work, args) -> list[dict]:
    eng, eng_out = run_engine(model_dir, paths[:n], work, args)
    mixed, mixed_out = run_peft(model_dir, paths[:n], work, args, grouped=False)
    grouped, _ = run_peft(model_dir, paths[:n], work, args, grouped=True)
    same = sum(a == b for a, b in zip(eng_out, mixed_out))
    base = {"num_adapters": n, "num_requests": len(work)}
    return [
        {"name": "vllm_tpu_lora", **base, **eng},
        {"name": "peft_mixed_batch", **base, **mixed},
        {"name": "peft_grouped", **base, **grouped},
        {"name": "ratio", **base,
         "engine_over_peft_mixed": eng["output_tokens_per_s"] / mixed["output_tokens_per_s"],
         "engine_over_peft_grouped": eng["output_tokens_per_s"] / grouped["output_tokens_per_s"],
         "greedy_outputs_identical": f"{same}/{len(work)}", "outputs_agree": same == len(work)},
    ]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    work = make_workload(args)
    torch.manual_seed(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args, os.path.join(tmp, "model"))
        paths = make_adapters(model_dir, tmp, max(args.num_adapters), args.rank)
        for n in args.num_adapters:
            for row in compare(n, model_dir, paths, work, args):
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


if __name__ == "__main__":
    main()
