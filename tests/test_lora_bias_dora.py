"""LoRA bias (`lora_bias=True`) and DoRA (`use_dora=True`) adapters, served in mixed batches
with plain LoRA adapters and the base model, on Llama and Qwen2 (tied embeddings, q/k/v
bias), both backends.

Oracle: PEFT in float32 (greedy ids identical, logprobs within 1e-4), one prompt at a
time with the prompt's adapter active (PEFT's mixed batch refuses DoRA). The magnitudes of
the DoRA adapters are moved off their initial value, so the rescale is visible.
"""

import numpy as np
import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

from .conftest import SMALL_ENGINE

MAX_NEW = 6
KINDS = {"plain": {}, "bias": {"lora_bias": True}, "dora": {"use_dora": True}}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    root = tmp_path_factory.mktemp(f"bias_dora_{request.param}")
    adapters = {kind: make_peft_adapter(model_dir, str(root / kind), r=8, seed=90 + i,
                                        init_std=0.05, **kw)
                for i, (kind, kw) in enumerate(KINDS.items())}
    return request.param, model_dir, adapters, load_oracle_model(model_dir, adapters)


def _requests(adapters) -> dict[str, LoRARequest]:
    return {kind: LoRARequest(kind, i + 1, path) for i, (kind, path) in enumerate(adapters.items())}


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_mixed_batch_of_bias_dora_and_plain_matches_peft(setup, backend):
    arch, model_dir, adapters, oracle = setup
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist() for _ in range(8)]
    names = [(None, "plain", "bias", "dora")[i % 4] for i in range(8)]
    expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=names)
    llm = LLM(model_dir, enable_lora=True, enable_lora_bias=True, enable_dora=True, max_loras=3,
              max_lora_rank=8, lora_backend=backend, **SMALL_ENGINE)
    reqs = _requests(adapters)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                       logprobs=0),
                        lora_request=[reqs[n] if n else None for n in names], use_tqdm=False)
    for name, out, exp in zip(names, outs, expected):
        got = out.outputs[0]
        assert got.token_ids == exp.token_ids, (arch, backend, name)
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(lps, exp.logprobs, atol=1e-4, rtol=0,
                                   err_msg=f"{arch} {backend} {name}")
    # The bias and the rescale each move the output away from what plain LoRA math gives.
    for kind in ("bias", "dora"):
        i = names.index(kind)
        plain_math = _without(oracle, kind, prompts[i])
        assert np.abs(plain_math - expected[i].full_logprobs[0]).max() > 0.01, kind
    assert llm.llm_engine.stats()["compilations_after_warmup"] == 0


def _without(oracle, kind: str, prompt) -> np.ndarray:
    """First-token logprobs of adapter `kind` computed as plain LoRA: its lora_B bias
    zeroed, or its DoRA magnitude reset to the weight norm (a rescale by 1)."""
    import torch

    touched = []
    with torch.no_grad():
        for module in oracle.modules():
            lora_b = getattr(module, "lora_B", {})
            if kind == "bias" and kind in lora_b and lora_b[kind].bias is not None:
                touched.append((lora_b[kind].bias, lora_b[kind].bias.clone()))
                lora_b[kind].bias.zero_()
            magnitudes = getattr(module, "lora_magnitude_vector", {})
            if kind == "dora" and kind in magnitudes:
                m = magnitudes[kind].weight
                touched.append((m, m.clone()))
                delta = module.lora_B[kind].weight @ module.lora_A[kind].weight
                weight = module.get_base_layer().weight + module.scaling[kind] * delta
                m.copy_(torch.linalg.norm(weight, dim=1))
        try:
            return hf_greedy(oracle, [prompt], 1, adapter_names=[kind])[0].full_logprobs[0]
        finally:
            for param, value in touched:
                param.copy_(value)


def test_rejected_unless_enabled(setup):
    _, model_dir, adapters, _ = setup
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, **SMALL_ENGINE)
    reqs = _requests(adapters)
    with pytest.raises(ValueError, match="Loading lora bias failed: .*enable_lora_bias"):
        llm.generate("x", SamplingParams(max_tokens=1), lora_request=reqs["bias"], use_tqdm=False)
    with pytest.raises(ValueError, match="Loading lora dora failed: .*enable_dora"):
        llm.generate("x", SamplingParams(max_tokens=1), lora_request=reqs["dora"], use_tqdm=False)
    out = llm.generate("x", SamplingParams(max_tokens=2, ignore_eos=True),
                       lora_request=reqs["plain"], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_phi3_packed_bias_and_dora_split_at_the_slices(tmp_path):
    """Phi-3's adapters are on the packed qkv_proj / gate_up_proj: lora_B's bias and DoRA's
    magnitude cover the packed output and are split with B at the slice boundaries."""
    from vllm_tpu_lora.testing.factory import make_tiny_model

    model_dir = make_tiny_model("phi3", str(tmp_path / "phi3"))
    packed = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapters = {kind: make_peft_adapter(model_dir, str(tmp_path / kind), r=8, seed=i,
                                        init_std=0.05, target_modules=packed, **kw)
                for i, (kind, kw) in enumerate(KINDS.items()) if kind != "plain"}
    oracle = load_oracle_model(model_dir, adapters)
    prompts = [np.random.default_rng(3).integers(3, 500, size=n).tolist() for n in (9, 20)]
    llm = LLM(model_dir, enable_lora=True, enable_lora_bias=True, enable_dora=True, max_loras=2,
              max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
    for i, kind in enumerate(adapters):
        expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=[kind] * len(prompts))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                           logprobs=0),
                            lora_request=LoRARequest(kind, i + 1, adapters[kind]), use_tqdm=False)
        for out, exp in zip(outs, expected):
            got = out.outputs[0]
            assert got.token_ids == exp.token_ids, kind
            lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
            np.testing.assert_allclose(lps, exp.logprobs, atol=1e-4, rtol=0, err_msg=kind)
