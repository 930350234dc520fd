"""Greedy parity with HF transformers (float32): identical token ids, logprobs to 1e-4.

The engine runs with a 32-token budget, so prompts of up to 200 tokens are prefilled in
chunks and steps mix prefill chunks with other sequences' decodes.
"""

import numpy as np
import pytest

from vllm_tpu_lora import LLM, SamplingParams
from vllm_tpu_lora.testing.factory import make_tiny_llama
from vllm_tpu_lora.testing.oracle import hf_greedy

from .conftest import SMALL_ENGINE

PROMPT_LENS = [1, 2, 7, 16, 33, 64, 120, 200, 5]
MAX_NEW = 12


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=n).tolist() for n in PROMPT_LENS]


def _check_parity(llm: LLM, model_dir: str, seed: int) -> None:
    _assert_matches_hf(llm, model_dir, _prompts(seed))


def _assert_matches_hf(llm: LLM, model_dir: str, prompts: list[list[int]]) -> None:
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, exp, out in zip(prompts, expected, outs):
        got = out.outputs[0]
        assert got.token_ids == exp.token_ids, f"prompt of {len(p)} tokens"
        lps = [entry[t].logprob for t, entry in zip(got.token_ids, got.logprobs)]
        np.testing.assert_allclose(lps, exp.logprobs, atol=1e-4, rtol=0)
    assert llm.llm_engine.stats()["compilations_after_warmup"] == 0


def test_llama_gqa_untied_matches_hf(llama_dir, llama_llm):
    _check_parity(llama_llm, llama_dir, seed=0)


def test_qwen2_bias_tied_matches_hf(qwen2_dir):
    _check_parity(LLM(qwen2_dir, **SMALL_ENGINE), qwen2_dir, seed=1)


@pytest.mark.parametrize("variant", ["llama3_rope_sharded", "mha_linear_rope"])
def test_llama_variants_match_hf(tmp_path, variant):
    if variant == "llama3_rope_sharded":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model_dir = make_tiny_llama(str(tmp_path / "m"), rope_scaling=rope, shard_size="40KB")
        import os
        assert os.path.exists(os.path.join(model_dir, "model.safetensors.index.json"))
    else:
        model_dir = make_tiny_llama(str(tmp_path / "m"), num_kv_heads=4, legacy_config=True,
                                    rope_scaling={"rope_type": "linear", "factor": 2.0})
    _check_parity(LLM(model_dir, **SMALL_ENGINE), model_dir, seed=2)


def test_attention_window_buckets_match_hf(llama_dir):
    """max_model_len 512: attention windows of 256 and 512 tokens, a graph each. Prompts
    below, at and across the 256-token boundary (250 + 12 new tokens changes window
    mid-generation) decode as HF does, with no compilation after warm-up."""
    llm = LLM(llama_dir, **{**SMALL_ENGINE, "max_model_len": 512})
    assert llm.llm_engine.runner.window_ladder == [16, 32]
    rng = np.random.default_rng(3)
    _assert_matches_hf(llm, llama_dir, [rng.integers(3, 512, size=n).tolist()
                                         for n in (250, 20, 300, 244)])
    stats = llm.llm_engine.stats()
    windows = {key.split("/")[2] for key, n in stats["forward_graph_steps"].items() if n}
    assert windows == {"W256", "W512"}
