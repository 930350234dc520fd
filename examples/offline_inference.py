"""Offline generation with vllm_tpu_lora.

    python examples/offline_inference.py /path/to/hf/model
With no argument a tiny random Llama is built locally (nothing is downloaded).
"""

import sys
import tempfile

from vllm_tpu_lora import LLM, SamplingParams


def main() -> None:
    if len(sys.argv) > 1:
        model_dir = sys.argv[1]
    else:
        from vllm_tpu_lora.testing.factory import make_tiny_llama

        model_dir = make_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    llm = LLM(model_dir, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    prompts = ["The cat looks at", "Seven bridges", "Our team builds"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=16)
    for out in llm.generate(prompts, [greedy, sampled, greedy]):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    print(llm.llm_engine.stats())


if __name__ == "__main__":
    main()
