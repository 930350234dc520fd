"""LoRA on the token embedding (PEFT's lora_embedding_A/B) and on lm_head, served in mixed
batches with plain, LoRA-bias and DoRA adapters and the base model, on Llama and Qwen2 (tied
embeddings: each LoRA stays on its own side of the tie), both backends, with more adapters
than device slots (loads and evictions while the batch runs).

Oracle: PEFT in float32 (greedy ids identical, logprobs within 1e-4), one prompt at a time
with the prompt's adapter active.
"""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.config import LORA_TARGET_MODULES
from vllm_tpu_lora.lora.punica import PunicaWrapper
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

from .conftest import SMALL_ENGINE

MAX_NEW = 6
ALL = [*LORA_TARGET_MODULES, "embed_tokens", "lm_head"]
KINDS = {
    "embed": dict(target_modules=["embed_tokens"]),
    "head": dict(target_modules=["lm_head"]),
    "vocab": dict(target_modules=ALL),  # both, and every linear
    "plain": {},
    "bias": dict(lora_bias=True),
    "dora": dict(use_dora=True),
}
ENGINE = dict(enable_lora=True, enable_lora_bias=True, enable_dora=True, max_lora_rank=8,
              lora_target_modules=ALL, **SMALL_ENGINE)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    root = tmp_path_factory.mktemp(f"vocab_{request.param}")
    adapters = {kind: make_peft_adapter(model_dir, str(root / kind), r=8, seed=30 + i,
                                        init_std=0.05, **kw)
                for i, (kind, kw) in enumerate(KINDS.items())}
    return request.param, model_dir, adapters, load_oracle_model(model_dir, adapters)


def _requests(adapters) -> dict[str, LoRARequest]:
    return {kind: LoRARequest(kind, i + 1, path) for i, (kind, path) in enumerate(adapters.items())}


def _check(outs, expected, names, what):
    for name, out, exp in zip(names, outs, expected):
        got = out.outputs[0]
        assert got.token_ids == exp.token_ids, (what, name)
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(lps, exp.logprobs, atol=1e-4, rtol=0, err_msg=f"{what} {name}")


# 64-token steps: the xla slots strategy's graphs (embedding LoRA, bias and DoRA included);
# "tpu_table": the xla backend's strategy table as on a TPU (onehot for 2+ adapters)
@pytest.mark.parametrize("backend,batched_tokens", [("xla", 32), ("pallas", 32), ("xla", 64),
                                                    ("tpu_table", 32)])
def test_mixed_batch_with_embedding_and_lm_head_lora_matches_peft(setup, backend,
                                                                   batched_tokens, monkeypatch):
    arch, model_dir, adapters, oracle = setup
    if backend == "tpu_table":  # the TPU's buffer layout too: A rank-first
        monkeypatch.setattr(PunicaWrapper, "a_by_input", property(lambda self: False))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 500, size=int(rng.integers(3, 40))).tolist() for _ in range(14)]
    names = [(None, *KINDS)[i % (len(KINDS) + 1)] for i in range(14)]
    expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=names)
    # 6 adapters over 3 slots: adapters load, evict and come back during the run.
    llm = LLM(model_dir, max_loras=3, lora_backend="xla" if backend == "tpu_table" else backend,
              precompile=backend != "tpu_table",
              **{**ENGINE, "max_num_batched_tokens": batched_tokens})
    punica, slot_steps = llm.llm_engine.runner.punica, []
    if backend == "tpu_table":  # capture the graphs with the TPU's table
        punica.on_tpu = True
        llm.llm_engine.runner.precompile()
    plan_step = punica.plan_step
    punica.plan_step = lambda *a, **k: _note_slots(plan_step(*a, **k), slot_steps)
    reqs = _requests(adapters)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=[reqs[n] if n else None for n in names], use_tqdm=False)
    _check(outs, expected, names, f"{arch} {backend}")
    # The embedding-only and lm_head-only adapters do change the output (else parity
    # would hold for an engine that ignored them).
    base = hf_greedy(oracle, prompts[:1], 1, adapter_names=[None])[0].full_logprobs[0]
    for kind in ("embed", "head"):
        mine = hf_greedy(oracle, prompts[:1], 1, adapter_names=[kind])[0].full_logprobs[0]
        assert np.abs(mine - base).max() > 0.01, kind
    stats = llm.llm_engine.stats()
    assert stats["compilations_after_warmup"] == 0
    assert sum(a["slot_evictions"] for a in stats["loras"].values()) > 0
    assert bool(slot_steps) == (backend == "xla" and batched_tokens == 64), len(slot_steps)
    kinds = {key.rsplit("/", 1)[1] for key in stats["forward_graph_steps"]}
    if backend == "tpu_table":
        assert kinds <= {"base", "onehot", "single"} and "onehot" in kinds, kinds


def _note_slots(plan: dict, slot_steps: list) -> dict:
    if "slot_perm" in plan:
        slot_steps.append(plan)
    return plan


def test_refused_unless_targeted(setup):
    _, model_dir, adapters, _ = setup
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, **SMALL_ENGINE)
    for kind, module in (("embed", "model.embed_tokens"), ("head", "lm_head")):
        with pytest.raises(ValueError, match=rf"Loading lora {kind} failed: LoRA on {module} is "
                                             r"served only by an engine whose lora_target_modules"):
            llm.generate("x", SamplingParams(max_tokens=1),
                         lora_request=LoRARequest(kind, 1, adapters[kind]), use_tqdm=False)


def _copy_with(src: str, dst: str, edit) -> str:
    os.makedirs(dst)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    edit(cfg, tensors)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return dst


def test_rejections_name_the_reason(llama_dir, tmp_path):
    src = make_peft_adapter(llama_dir, str(tmp_path / "src"), r=8, init_std=0.05,
                            target_modules=["embed_tokens", "lm_head", "q_proj"])
    key = "base_model.model.model.embed_tokens.base_layer.weight"

    def retrained(cfg, t):
        t[key] = t[key] + 0.5

    def resized(cfg, t):
        t[key] = torch.cat([t[key], torch.zeros(8, t[key].shape[1])])

    def dora(cfg, t):
        cfg["use_dora"] = True
        t["base_model.model.lm_head.lora_magnitude_vector"] = torch.ones(512)
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = \
            torch.ones(64)
        t["base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector"] = \
            torch.ones(64)

    def tied(cfg, t):
        cfg["ensure_weight_tying"] = True

    cases = {"retrained": (retrained, "differs from the base model's weights"),
             "tied": (tied, r"ensure_weight_tying=True .* is not supported"),
             "resized": (resized, r"resized vocabulary"),
             "dora": (dora, r"DoRA and lora_bias on lm_head are not supported")}
    llm = LLM(llama_dir, max_loras=2, **ENGINE)
    for i, (name, (edit, message)) in enumerate(cases.items()):
        path = _copy_with(src, str(tmp_path / name), edit)
        with pytest.raises(ValueError, match=f"Loading lora {name} failed: .*{message}"):
            llm.generate("x", SamplingParams(max_tokens=1),
                         lora_request=LoRARequest(name, i + 1, path), use_tqdm=False)
    # The untouched adapter (its saved base copies are the base model's) is served.
    out = llm.generate("x", SamplingParams(max_tokens=2, ignore_eos=True),
                       lora_request=LoRARequest("src", 9, src), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_under_tensor_parallelism_matches_peft(setup, tmp_path):
    """bias, DoRA, embedding and lm_head LoRA with tensor_parallel_size=2 (tests/tp_worker.py,
    4 virtual CPU devices): every kind in one mixed batch, against PEFT."""
    import subprocess
    import sys

    arch, model_dir, adapters, oracle = setup
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 500, size=int(rng.integers(3, 30))).tolist() for _ in range(7)]
    names = [None, *KINDS]
    args = {"model": model_dir, "adapters": adapters, "prompts": prompts, "names": names,
            "tp": 2, "max_tokens": MAX_NEW, "out": str(tmp_path / "out.json"),
            "engine": {**ENGINE, "max_loras": 4, "max_num_batched_tokens": 64}}
    with open(tmp_path / "args.json", "w") as f:
        json.dump(args, f)
    worker = os.path.join(os.path.dirname(__file__), "tp_worker.py")
    env = dict(os.environ, CPU_NUM_DEVICES="4", PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, worker, str(tmp_path / "args.json"), "--features"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    with open(args["out"]) as f:
        got = json.load(f)
    expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=names)
    for name, ids, lps, exp in zip(names, got["token_ids"], got["logprobs"], expected):
        assert ids == exp.token_ids, (arch, name)
        np.testing.assert_allclose(lps, exp.logprobs, atol=1e-4, rtol=0, err_msg=f"{arch} {name}")
    assert got["compilations_after_warmup"] == 0
