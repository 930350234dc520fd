"""Behaviour, not just numerics: adapters trained (PEFT, a few hundred steps, in a fixture)
to answer the SAME prompt with DIFFERENT known answers must each give their own answer —
alone, hot-swapped through a single slot, and all together in one batch."""

import pytest
import torch

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams

from .conftest import SMALL_ENGINE

PROMPT = [0, 17, 42, 99, 7, 250]
ANSWERS = {"north": [301, 302, 303, 304], "south": [311, 312, 313, 314],
           "east": [321, 322, 323, 324], "west": [331, 332, 333, 334]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _train_adapter(base_dir: str, answer: list[int], out_dir: str, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))
    ids = torch.tensor([PROMPT + answer])
    labels = ids.clone()
    labels[0, : len(PROMPT)] = -100  # learn the answer only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def trained(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    torch.set_num_threads(1)
    return {name: LoRARequest(name, i + 1, _train_adapter(llama_dir, ans, str(root / name), i))
            for i, (name, ans) in enumerate(ANSWERS.items())}


def _answers(llm, requests):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(requests), GREEDY,
                        lora_request=requests, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_base_model_gives_none_of_the_answers(llama_llm):
    assert _answers(llama_llm, [None])[0] not in ANSWERS.values()


def test_hot_swapping_through_one_slot(llama_dir, trained):
    llm = LLM(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8, **SMALL_ENGINE)
    for name, req in trained.items():  # one at a time
        assert _answers(llm, [req]) == [ANSWERS[name]]
    order = ["west", "north", "west", "east", "south", "north"]  # one batch, one slot
    assert _answers(llm, [trained[n] for n in order]) == [ANSWERS[n] for n in order]
    # 4 adapters one at a time, then 4 distinct in one batch through the one slot (the
    # batch's first may still be in it; admission groups the repeats, so no more are due).
    assert llm.llm_engine.lora_manager.num_slot_loads >= 4 + 3
    assert llm.llm_engine.stats()["compilations_after_warmup"] == 0


def test_all_adapters_at_once(llama_dir, trained):
    llm = LLM(llama_dir, enable_lora=True, max_loras=4, max_lora_rank=8, **SMALL_ENGINE)
    names = list(trained) + [None]
    got = _answers(llm, [trained[n] if n else None for n in names])
    assert got[:4] == [ANSWERS[n] for n in trained]
    assert got[4] not in ANSWERS.values()
