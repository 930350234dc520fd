"""Bad input is a clear ValueError/TypeError and the engine keeps serving."""

import json
import os
import shutil

import pytest

from vllm_tpu_lora import LLM, SamplingParams
from vllm_tpu_lora.testing.factory import sample_prompt_token_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _still_serves(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not llm.llm_engine.has_unfinished_requests()


def test_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(bad))


def test_unknown_engine_argument_is_a_type_error(llama_dir):
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM(llama_dir, max_num_seq=4)


def test_max_model_len_above_the_model_is_rejected(llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=10**6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=-1), "max_tokens must be at least 1"),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(min_p=2.0), "min_p must be in"),
    (dict(n=0), "n must be at least 1"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens must be less than or equal"),
    (dict(logprobs=50), "logprobs of 50"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_model_len(llama_llm):
    too_long = sample_prompt_token_ids(1, min_len=300, max_len=300)[0]
    with pytest.raises(ValueError, match="longer than the maximum model length of 256"):
        llama_llm.generate({"prompt_token_ids": too_long}, GREEDY, use_tqdm=False)
    _still_serves(llama_llm)


def test_empty_prompt(llama_llm):
    with pytest.raises(ValueError, match="prompt cannot be empty"):
        llama_llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    _still_serves(llama_llm)


@pytest.mark.parametrize("salt", ["", 7])
def test_bad_cache_salt(llama_llm, salt):
    with pytest.raises(ValueError, match="'cache_salt' must be a non-empty string"):
        llama_llm.generate({"prompt_token_ids": [5, 6], "cache_salt": salt}, GREEDY,
                           use_tqdm=False)
    _still_serves(llama_llm)


def test_out_of_vocab_token(llama_llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llama_llm.generate({"prompt_token_ids": [1, 10**6]}, GREEDY, use_tqdm=False)
    _still_serves(llama_llm)


def test_bad_prompt_in_a_batch_adds_nothing(llama_llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="prompt cannot be empty"):
        llama_llm.generate([good, {"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    assert not llama_llm.llm_engine.has_unfinished_requests()
    _still_serves(llama_llm)


def test_lora_request_without_enable_lora(llama_llm):
    from vllm_tpu_lora.lora.request import LoRARequest

    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llama_llm.generate("hi", GREEDY, lora_request=LoRARequest("a", 1, "/x"), use_tqdm=False)
    _still_serves(llama_llm)


def test_mismatched_params_list(llama_llm):
    with pytest.raises(ValueError, match="lengths of prompts and sampling_params"):
        llama_llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    _still_serves(llama_llm)


def test_dir_without_config(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="No config.json"):
        LLM(str(tmp_path / "empty"))
