"""`vllm-tpu-lora demo`: the bundled model and adapters in one mixed batch.

The base model copies a word; each adapter rewrites it its own way (upper-case, reverse,
rot13, sort). Every word goes to the base model and to every adapter, all requests in
the same continuously-batched steps, and a table shows what each one wrote.
"""

from __future__ import annotations

import argparse
import time

# Words the demo adapters never saw in training (scripts/make_demo_assets.py holds out
# a random set; these are ordinary words checked by eye).
DEMO_WORDS = ["kitchen", "lantern", "paris", "zebra", "window", "quartz", "mango", "violin"]


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--words", nargs="+", default=DEMO_WORDS,
                        help="lowercase words to send to the base model and every adapter")
    parser.add_argument("--lora-backend", default="auto", choices=["auto", "xla", "pallas"])


def run_demo(args: argparse.Namespace) -> int:
    from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
    from vllm_tpu_lora.assets import demo_adapters, demo_expected, demo_model_dir, demo_prompt

    adapters = demo_adapters()
    llm = LLM(demo_model_dir(), enable_lora=True, max_loras=len(adapters), max_lora_rank=16,
              max_num_seqs=64, max_num_batched_tokens=256, max_model_len=64,
              lora_backend=args.lora_backend)
    requests = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    jobs = [(req, word) for word in args.words for req in requests]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    start = time.perf_counter()
    outs = llm.generate([demo_prompt(w) for _, w in jobs], params,
                        lora_request=[r for r, _ in jobs], use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(f"{'adapter':<8} {'prompt':<12} {'output':<12} expected")
    correct = 0
    for (req, word), out in zip(jobs, outs):
        name = req.lora_name if req else None
        text, want = out.outputs[0].text, demo_expected(name, word)
        correct += text == want
        mark = "ok" if text == want else f"(want {want})"
        print(f"{name or 'base':<8} {demo_prompt(word):<12} {text:<12} {mark}")
    stats = llm.llm_engine.stats()
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"\n{len(jobs)} requests over base + {len(adapters)} adapters in one batch: "
          f"{correct}/{len(jobs)} as expected, {n_tokens / elapsed:.0f} output tokens/s, "
          f"{stats['num_steps']} steps, {stats['num_graphs']} graphs compiled at start-up "
          f"({stats['warmup_seconds']:.1f} s), {stats['compilations_after_warmup']} after")
    return 0
