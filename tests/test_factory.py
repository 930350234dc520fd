"""The test-checkpoint factory and the HF/PEFT oracles that every correctness test leans on."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from vllm_tpu_lora.testing import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    build_tokenizer,
    hf_greedy,
    load_oracle_model,
    make_peft_adapter,
    make_tiny_llama,
    make_tiny_qwen2,
    peft_mixed_batch_greedy,
    sample_prompt_token_ids,
)

pytest.importorskip("peft")
# PEFT 0.21 calls a transformers-5 API that warns of its own deprecation; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

MAX_NEW = 16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    qwen = make_tiny_qwen2(str(root / "qwen2"), shard_size="100KB")
    return {
        "llama": make_tiny_llama(str(root / "llama")),
        "qwen2": qwen,
        "a1": make_peft_adapter(qwen, str(root / "a1")),
        "a2": make_peft_adapter(qwen, str(root / "a2"), r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj"], seed=1),
        "a3": make_peft_adapter(qwen, str(root / "a3"), r=16, target_modules="all-linear",
                                use_rslora=True, rank_pattern={"down_proj": 4}, seed=2),
        "root": root,
    }


@pytest.fixture(scope="module")
def prompts():
    return sample_prompt_token_ids(4, seed=1)


def test_tokenizer_roundtrip_chat_template_and_determinism(tmp_path):
    build_tokenizer(str(tmp_path / "a"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    for text in ["Hello, world!", "café naïve 日本 Straße 🙂", " leading space\n\ttab", "π≈3.14"]:
        ids = tok.encode(text)
        assert ids[0] == BOS_TOKEN_ID
        assert tok.decode(ids, skip_special_tokens=True) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("<|assistant|>\n")
    build_tokenizer(str(tmp_path / "b"))
    for name in os.listdir(tmp_path / "a"):  # byte-identical on a rebuild
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(str(tmp_path / "c"), vocab_size=100_000)


def _max_run(ids):
    run = best = 1
    for a, b in zip(ids, ids[1:], strict=False):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_models_load_and_generate_varied_tokens(ckpts, prompts, arch):
    model = AutoModelForCausalLM.from_pretrained(ckpts[arch])
    cfg = model.config
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)
    assert cfg.num_key_value_heads == 2 and cfg.num_attention_heads == 4
    assert cfg.tie_word_embeddings == (arch == "qwen2")
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID
    assert AutoTokenizer.from_pretrained(ckpts[arch]).pad_token_id == PAD_TOKEN_ID
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))  # randomized, so loaders must load it
    if arch == "qwen2":  # HF zero-inits biases; the factory must not
        assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0
    for out in hf_greedy(ckpts[arch], prompts, 24):
        assert len(out.token_ids) == 24
        assert len(set(out.token_ids)) >= 8 and _max_run(out.token_ids) <= 4


def test_sharded_checkpoint_has_index_and_same_weights(ckpts, tmp_path):
    index = json.loads((ckpts["root"] / "qwen2" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((ckpts["root"] / "qwen2" / s).exists() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied: not saved, as in real Qwen2
    single = make_tiny_qwen2(str(tmp_path / "single"))
    whole = load_file(os.path.join(single, "model.safetensors"))
    for shard in shards:
        for name, tensor in load_file(str(ckpts["root"] / "qwen2" / shard)).items():
            torch.testing.assert_close(tensor, whole[name], rtol=0, atol=0)


def test_legacy_config_format_is_equivalent(tmp_path, prompts):
    rope = {"rope_type": "linear", "factor": 2.0}
    new = make_tiny_llama(str(tmp_path / "new"), rope_scaling=rope)
    old = make_tiny_llama(str(tmp_path / "old"), rope_scaling=rope, legacy_config=True)
    raw = json.loads((tmp_path / "old" / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_theta"] == 10000.0
    assert raw["rope_scaling"] == rope and raw["torch_dtype"] == "float32"
    assert AutoConfig.from_pretrained(old).rope_parameters["factor"] == 2.0
    a, b = hf_greedy(new, prompts[:2], 8), hf_greedy(old, prompts[:2], 8)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_adapter_files_keys_and_determinism(ckpts, tmp_path):
    a1 = ckpts["root"] / "a1"
    cfg = json.loads((a1 / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (8, 16, "LORA")
    assert cfg["target_modules"] == sorted(cfg["target_modules"])
    weights = load_file(str(a1 / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    assert weights[f"{prefix}.lora_A.weight"].shape == (8, 64)  # [r, in]
    assert weights[f"{prefix}.lora_B.weight"].shape == (64, 8)  # [out, r]
    assert len(weights) == 2 * 7 * 2  # A and B, 7 modules, 2 layers
    a3 = load_file(str(ckpts["root"] / "a3" / "adapter_model.safetensors"))
    assert a3["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape[0] == 4
    again = load_file(make_peft_adapter(ckpts["qwen2"], str(tmp_path / "again"))
                      + "/adapter_model.safetensors")
    assert all(torch.equal(again[k], weights[k]) for k in weights)


@pytest.mark.parametrize("kwargs, field", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
])
def test_extra_lora_kwargs_reach_the_config(ckpts, tmp_path, kwargs, field):
    out = make_peft_adapter(ckpts["llama"], str(tmp_path / "x"), target_modules=["q_proj"], **kwargs)
    cfg = json.loads(open(os.path.join(out, "adapter_config.json")).read())
    assert cfg[field] == next(iter(kwargs.values()))


def test_adapters_change_greedy_output(ckpts, prompts):
    dirs = {n: ckpts[n] for n in ("a1", "a2", "a3")}
    model = load_oracle_model(ckpts["qwen2"], dirs)
    base = [o.token_ids for o in hf_greedy(ckpts["qwen2"], prompts, MAX_NEW)]
    peft_base = hf_greedy(model, prompts, MAX_NEW, adapter_names=[None] * len(prompts))
    assert [o.token_ids for o in peft_base] == base
    for name in dirs:
        outs = hf_greedy(model, prompts, MAX_NEW, adapter_names=[name] * len(prompts))
        assert all(o.token_ids != b for o, b in zip(outs, base, strict=True)), name


def test_peft_mixed_batch_matches_per_prompt(ckpts):
    dirs = {n: ckpts[n] for n in ("a1", "a2", "a3")}
    model = load_oracle_model(ckpts["qwen2"], dirs)
    prompts = sample_prompt_token_ids(5, min_len=3, max_len=20, seed=2)  # ragged: left padding
    names = ["a1", None, "a2", "a3", "a1"]
    single = hf_greedy(model, prompts, MAX_NEW, adapter_names=names)
    mixed = peft_mixed_batch_greedy(model, prompts, MAX_NEW, adapter_names=names)
    for s, m in zip(single, mixed, strict=True):
        assert s.token_ids == m.token_ids
        np.testing.assert_allclose(s.full_logprobs, m.full_logprobs, atol=1e-4)


def test_logprobs_and_ignore_eos(ckpts, prompts):
    model = load_oracle_model(ckpts["llama"])
    out = hf_greedy(model, prompts[:1], MAX_NEW)[0]
    assert out.full_logprobs.shape == (MAX_NEW, 512)
    assert out.token_ids == out.full_logprobs.argmax(-1).tolist()
    np.testing.assert_allclose(out.logprobs, out.full_logprobs[np.arange(MAX_NEW), out.token_ids])
    np.testing.assert_allclose(np.exp(out.full_logprobs).sum(-1), 1.0, rtol=1e-5)
    # Make the 3rd generated token the eos: generation stops there unless ignore_eos.
    eos = out.token_ids[2]
    model.generation_config.eos_token_id = eos
    stopped = hf_greedy(model, prompts[:1], MAX_NEW, ignore_eos=False)[0].token_ids
    assert stopped == out.token_ids[: out.token_ids.index(eos) + 1]
    assert hf_greedy(model, prompts[:1], MAX_NEW)[0].token_ids == out.token_ids
    with pytest.raises(ValueError, match="no adapters"):
        hf_greedy(model, prompts[:1], 2, adapter_names=["a1"])
