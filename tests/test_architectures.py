"""The architectures beyond Llama/Qwen2, each from a real `save_pretrained` checkpoint:
Mistral with a sliding window, Qwen3 (q/k norms), Gemma (GeGLU, scaled embeddings, 1 + w
norms, tied), Gemma2 (plus sandwich norms, soft-capping, query_pre_attn_scalar, sliding
window on alternate layers) and Phi-3 (q/k/v and gate/up packed in the checkpoint, PEFT
adapters on the packed modules, sliding window).

Oracles: HF transformers greedy in float32 (ids identical, logprobs within 1e-4) for the
base model, PEFT's per-adapter forward for adapters, in mixed batches of base and two
adapters, with chunked prefill (16-token budget) and prompts longer than the window.
"""

import numpy as np
import pytest
import torch

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.models.loader import load_model
from vllm_tpu_lora.testing.factory import make_peft_adapter, make_tiny_model
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

ARCHS = ["mistral", "qwen3", "gemma", "gemma2", "phi3"]
MAX_NEW = 8
# Phi-3 checkpoints hold qkv_proj / gate_up_proj: PEFT adapters name those.
WINDOWED = ("mistral", "gemma2", "phi3")
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model_dir = make_tiny_model(arch, str(root / "model"))
    kw = {"target_modules": TARGETS[arch]} if arch in TARGETS else {}
    adapters = {f"{arch}-a{i}": make_peft_adapter(model_dir, str(root / f"a{i}"), r=8, seed=i,
                                                  init_std=0.1, **kw) for i in range(2)}
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
              max_num_batched_tokens=16, max_model_len=128)
    return arch, model_dir, adapters, llm, load_oracle_model(model_dir, adapters)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)  # up to 45 tokens: past every window, 3 prefill chunks
    return [rng.integers(3, 500, size=n).tolist() for n in (5, 19, 45, 30, 12, 40)]


def test_mixed_batch_matches_hf_and_peft(arch_setup):
    arch, model_dir, adapters, llm, oracle = arch_setup
    names = [None, *adapters, None, *adapters]
    prompts = _prompts(1)
    expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=names)
    loras = [None if n is None else LoRARequest(n, list(adapters).index(n) + 1, adapters[n])
             for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                       logprobs=0), lora_request=loras, use_tqdm=False)
    for name, out, exp in zip(names, outs, expected):
        got = out.outputs[0]
        assert got.token_ids == exp.token_ids, (arch, name)
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(lps, exp.logprobs, atol=1e-4, rtol=0, err_msg=f"{arch} {name}")
    # The adapters move the distributions a lot (a LoRA bug could not hide in the 1e-4).
    base_only = hf_greedy(oracle, prompts[1:3], 1, adapter_names=[None] * 2)
    for b, e in zip(base_only, expected[1:3]):
        assert np.abs(b.full_logprobs[0] - e.full_logprobs[0]).max() > 0.1, arch
    assert llm.llm_engine.stats()["compilations_after_warmup"] == 0
    if arch in WINDOWED:  # the window really cuts context: without it HF decodes otherwise
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager", sliding_window=4096)
        base = [i for i, n in enumerate(names) if n is None]
        unwindowed = hf_greedy(full.eval(), [prompts[i] for i in base], MAX_NEW)
        assert any(u.token_ids != expected[i].token_ids for u, i in zip(unwindowed, base))


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint_loads_the_same_weights(arch, tmp_path):
    import json
    import os

    single = make_tiny_model(arch, str(tmp_path / "single"))
    sharded = make_tiny_model(arch, str(tmp_path / "sharded"), shard_size="40KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    with open(os.path.join(single, "config.json")) as f:
        cfg = json.load(f)
    a = load_model(single, cfg, 16, torch.float32).state_dict()
    b = load_model(sharded, cfg, 16, torch.float32).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
