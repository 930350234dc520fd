"""Offline generation with vllm_tpu_lora.

    python examples/offline_inference.py [MODEL_DIR]
With no argument it runs the bundled demo model (a tiny Llama that copies a word), offline.
"""

import sys

from vllm_tpu_lora import LLM, SamplingParams, demo_assets


def main() -> None:
    if len(sys.argv) > 1:
        model, prompts = sys.argv[1], ["The cat looks at", "Seven bridges", "Our team builds"]
    else:
        model, prompts = demo_assets().model, ["kitchen=", "lantern=", "zebra="]
    # Small buckets: start-up compiles one graph per bucket, and three prompts need few.
    llm = LLM(model, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=16)
    for out in llm.generate(prompts, [greedy, sampled, greedy]):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    print(llm.llm_engine.stats())


if __name__ == "__main__":
    main()
