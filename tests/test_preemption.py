"""A KV cache too small for all requests at once: everything still completes, by
preemption and recompute, with exactly the outputs of an unconstrained run."""

import pytest

from vllm_tpu_lora import LLM, SamplingParams
from vllm_tpu_lora.testing.factory import sample_prompt_token_ids

from .conftest import SMALL_ENGINE


@pytest.fixture(scope="module")
def workload():
    prompts = sample_prompt_token_ids(8, min_len=20, max_len=60, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True)]
    return [{"prompt_token_ids": p} for p in prompts], [params[i % 2] for i in range(len(prompts))]


def test_tiny_kv_cache_preempts_and_matches_unconstrained(llama_dir, llama_llm, workload):
    prompts, params = workload
    expected = llama_llm.generate(prompts, params, use_tqdm=False)
    # 16-token blocks: 14 usable blocks hold two of these ~100-token sequences at full length.
    small = LLM(llama_dir, num_kv_blocks=15, block_size=16, **dict(SMALL_ENGINE, max_model_len=128))
    got = small.generate(prompts, params, use_tqdm=False)
    stats = small.llm_engine.stats()
    assert stats["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert stats["num_free_kv_blocks"] == 14  # everything released at the end
    assert stats["compilations_after_warmup"] == 0


def test_kv_cache_smaller_than_one_sequence_is_refused(llama_dir):
    with pytest.raises(ValueError, match="larger than the maximum number of tokens"):
        LLM(llama_dir, num_kv_blocks=4, block_size=16, **SMALL_ENGINE)
