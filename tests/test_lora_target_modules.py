"""`lora_target_modules` (vLLM's LoRAConfig.target_modules): only the layers holding a
listed module are wrapped, adapters on those modules serve exactly as PEFT computes them,
and an adapter touching any other module is rejected with an error naming it."""

import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.lora.layers import LoRALinear
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy

from .conftest import SMALL_ENGINE


@pytest.fixture(scope="module")
def qv_llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
               lora_target_modules=["q_proj", "v_proj"], **SMALL_ENGINE)


def test_only_targeted_layers_are_wrapped(qv_llm):
    wrapped = qv_llm.llm_engine.lora_manager.layers
    assert wrapped and all(name.endswith("qkv_proj") for name in wrapped)
    model = qv_llm.llm_engine.runner.model
    others = [n for n, m in model.named_modules()
              if n.rsplit(".", 1)[-1] in ("o_proj", "gate_up_proj", "down_proj")]
    assert others and not any(isinstance(model.get_submodule(n), LoRALinear) for n in others)


def test_adapter_on_targeted_modules_matches_peft(qv_llm, llama_dir, tmp_path):
    path = make_peft_adapter(llama_dir, str(tmp_path / "qv"), r=8,
                             target_modules=["q_proj", "v_proj"], seed=11)
    prompts = [[5, 9, 33, 70, 2], [100, 101, 102]]
    expected = hf_greedy(llama_dir, prompts, 6, adapter_dirs={"qv": path},
                         adapter_names=["qv", None])
    outs = qv_llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           lora_request=[LoRARequest("qv", 1, path), None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [e.token_ids for e in expected]


def test_adapter_touching_another_module_is_rejected(qv_llm, llama_dir, tmp_path):
    path = make_peft_adapter(llama_dir, str(tmp_path / "qo"), r=8,
                             target_modules=["q_proj", "o_proj"], seed=12)
    with pytest.raises(ValueError, match=r"Loading lora qo failed.*o_proj"):
        qv_llm.generate("hello", SamplingParams(max_tokens=2),
                        lora_request=LoRARequest("qo", 2, path), use_tqdm=False)
    # The engine serves on.
    out = qv_llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=2),
                          use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_unknown_target_module_is_a_config_error(llama_dir):
    with pytest.raises(ValueError, match=r"lora_target_modules \['wte'\] are not supported"):
        LLM(llama_dir, enable_lora=True, lora_target_modules=["q_proj", "wte"],
            precompile=False, **SMALL_ENGINE)
