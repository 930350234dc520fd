"""Several LoRA adapters (and the base model) in one batch.

    python examples/multi_lora_inference.py [BASE_DIR NAME=ADAPTER_DIR ...] [--prompt P]
With no model it runs the bundled demo model and its four adapters (upper, reverse,
rot13, sort), offline.
"""

import argparse

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams, demo_assets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", help="base model directory (default: the demo)")
    parser.add_argument("adapters", nargs="*", help="NAME=ADAPTER_DIR")
    parser.add_argument("--prompt", default=None)
    args = parser.parse_args()
    if args.model:
        base, adapters = args.model, dict(a.split("=", 1) for a in args.adapters)
        prompt = args.prompt or "The cat looks at"
    else:
        (base, adapters), prompt = demo_assets(), args.prompt or "violin="
    llm = LLM(base, enable_lora=True, max_loras=4, max_lora_rank=16, max_num_seqs=8,
              max_num_batched_tokens=32, max_model_len=64)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate([prompt] * (len(requests) + 1), params, lora_request=requests + [None])
    for req, out in zip(requests + [None], outs):
        print(f"{req.lora_name if req else 'base':>8}: {out.outputs[0].text!r}")
    print(llm.llm_engine.stats())


if __name__ == "__main__":
    main()
