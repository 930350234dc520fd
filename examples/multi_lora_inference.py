"""Several LoRA adapters (and the base model) in one batch.

    python examples/multi_lora_inference.py BASE_DIR NAME=ADAPTER_DIR [NAME=ADAPTER_DIR ...]
With no argument a tiny random Llama and three random PEFT adapters are built locally.
"""

import sys
import tempfile

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams


def _local_models() -> tuple[str, dict[str, str]]:
    from vllm_tpu_lora.testing.factory import make_peft_adapter, make_tiny_llama

    root = tempfile.mkdtemp(prefix="multi-lora-")
    base = make_tiny_llama(f"{root}/base")
    adapters = {name: make_peft_adapter(base, f"{root}/{name}", r=8, seed=i)
                for i, name in enumerate(["alpha", "beta", "gamma"])}
    return base, adapters


def main() -> None:
    if len(sys.argv) > 2:
        base = sys.argv[1]
        adapters = dict(arg.split("=", 1) for arg in sys.argv[2:])
    else:
        base, adapters = _local_models()
    llm = LLM(base, enable_lora=True, max_loras=4, max_lora_rank=16, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=256)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    prompts = ["The cat looks at"] * (len(requests) + 1)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate(prompts, params, lora_request=requests + [None])
    for req, out in zip(requests + [None], outs):
        print(f"{req.lora_name if req else 'base':>8}: {out.outputs[0].text!r}")
    print(llm.llm_engine.stats())


if __name__ == "__main__":
    main()
