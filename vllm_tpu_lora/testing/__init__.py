"""Test helpers shipped with the package: tiny real HF checkpoints, PEFT adapters, oracles.

Nothing can be downloaded from a model hub where this project is tested, so tests, benchmarks
and examples build their own small checkpoints with `transformers`/`peft` (see DESIGN.md §6).
`peft` is a dev dependency; it is imported lazily, only by the functions that need it.
"""

from vllm_tpu_lora.testing.factory import (
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,
    DEFAULT_TARGET_MODULES,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    build_tokenizer,
    make_peft_adapter,
    make_tiny_llama,
    make_tiny_qwen2,
    sample_prompt_token_ids,
)
from vllm_tpu_lora.testing.oracle import (
    PEFT_BASE_NAME,
    GreedyOutput,
    hf_greedy,
    load_oracle_model,
    peft_mixed_batch_greedy,
)

__all__ = [
    "BOS_TOKEN_ID",
    "CHAT_TEMPLATE",
    "DEFAULT_TARGET_MODULES",
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "PEFT_BASE_NAME",
    "GreedyOutput",
    "build_tokenizer",
    "hf_greedy",
    "load_oracle_model",
    "make_peft_adapter",
    "make_tiny_llama",
    "make_tiny_qwen2",
    "peft_mixed_batch_greedy",
    "sample_prompt_token_ids",
]
