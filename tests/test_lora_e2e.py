"""Multi-LoRA end to end: mixed batches equal PEFT, slot pressure, adapter lifecycle.

Oracle: PEFT float32 greedy, one prompt at a time with its own adapter (or none).
"""

import numpy as np
import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.lora import step_layout
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

from .conftest import SMALL_ENGINE

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Ranks 4/8/16, different target sets, rsLoRA and rank/alpha patterns.
ADAPTER_SPECS = {
    "all8": dict(r=8, seed=1),
    "qv4": dict(r=4, target_modules=["q_proj", "v_proj"], seed=2),
    "rs16": dict(r=16, use_rslora=True, seed=3),
    "pattern": dict(r=8, rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}, seed=4),
}


def _make_adapters(base_dir, tmp_path_factory, specs):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(base_dir, str(root / name), **kw) for name, kw in specs.items()}


@pytest.fixture(scope="module")
def llama_adapters(llama_dir, tmp_path_factory):
    return _make_adapters(llama_dir, tmp_path_factory, ADAPTER_SPECS)


@pytest.fixture(scope="module")
def qwen2_adapters(qwen2_dir, tmp_path_factory):
    return _make_adapters(qwen2_dir, tmp_path_factory, ADAPTER_SPECS)


def _requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def _mixed_workload(names, n_prompts=10, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 500, size=int(rng.integers(2, 60))).tolist() for _ in range(n_prompts)]
    choice = list(names) + [None]
    return prompts, [choice[i % len(choice)] for i in range(n_prompts)]


def _assert_matches_peft(llm, base_dir, adapters, prompts, picks):
    reqs = _requests(adapters)
    oracle = load_oracle_model(base_dir, adapters)
    expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=picks)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=[reqs[n] if n else None for n in picks], use_tqdm=False)
    for name, exp, out in zip(picks, expected, outs):
        assert out.outputs[0].token_ids == exp.token_ids, f"adapter {name}"
    assert llm.llm_engine.stats()["compilations_after_warmup"] == 0


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_mixed_adapter_batch_matches_peft(request, model, backend):
    base_dir = request.getfixturevalue(f"{model}_dir")
    adapters = request.getfixturevalue(f"{model}_adapters")
    llm = LLM(base_dir, enable_lora=True, max_loras=4, max_lora_rank=16, lora_backend=backend,
              **SMALL_ENGINE)
    prompts, picks = _mixed_workload(adapters)
    _assert_matches_peft(llm, base_dir, adapters, prompts, picks)
    if model == "llama" and backend == "xla":
        _assert_batched_slot_writes(llm)


def _assert_batched_slot_writes(llm):
    """Three images written by one padded 4-slot write land whole in their slots (and the
    repeat that pads the batch changes nothing): read back, each slot equals its image."""
    manager, rt = llm.llm_engine.lora_manager, llm.llm_engine.runtime
    ids = [lid for lid in manager.slots if lid is not None and manager.is_loaded(lid)][:3]
    assert len(ids) == 3 and manager.write_batch_sizes == [1, 2, 4]
    images = [manager.registry.host_copy(lid) for lid in ids]
    targets = [2, 0, 3]
    manager.write_slots(list(zip(targets, images)))
    for slot, image in zip(targets, images):
        got = np.concatenate([np.asarray(rt.to_host(buf))[slot].ravel()
                              for buf in manager.buffers])
        np.testing.assert_array_equal(got, image.flat.numpy())
    manager.clear_all_slots()


def test_slots_strategy_and_its_fallback_match_peft(llama_dir, llama_adapters):
    """64-token buckets over all 4 device slots run the xla "slots" strategy (each slot's
    rows times its buffers as they lie) when every adapter's tokens fit a slot's rows, and
    the bucket's fallback graph when one adapter's prefill is larger: both equal PEFT, and
    neither compiles after warm-up."""
    llm = LLM(llama_dir, enable_lora=True, max_loras=4, max_lora_rank=16, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=256)
    punica, kinds = llm.llm_engine.runner.punica, []
    plan_step = punica.plan_step

    def spy(token_pos, *args, **kwargs):
        plan = plan_step(token_pos, *args, **kwargs)
        if token_pos.shape[0] == 64 and plan:
            kinds.append("slots" if "slot_perm" in plan else "fallback")
        return plan

    punica.plan_step = spy
    rng = np.random.default_rng(11)
    names = list(llama_adapters)
    # First call: one 40-token prompt over a slot's 2*64/4 = 32 rows; second: 14 each.
    for lengths in ([40, 8, 8, 6], [14, 14, 14, 14]):
        prompts = [rng.integers(3, 500, size=n).tolist() for n in lengths]
        _assert_matches_peft(llm, llama_dir, llama_adapters, prompts, names)
    assert "slots" in kinds and "fallback" in kinds, kinds


def test_slot_pressure_evicts_and_reloads(llama_dir, tmp_path_factory):
    specs = {f"a{i}": dict(r=8, seed=10 + i, init_std=0.05) for i in range(6)}
    adapters = _make_adapters(llama_dir, tmp_path_factory, specs)
    llm = LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8,
              **SMALL_ENGINE)
    prompts, picks = _mixed_workload(adapters, n_prompts=14, seed=5)
    _assert_matches_peft(llm, llama_dir, adapters, prompts, picks)
    manager = llm.llm_engine.lora_manager
    # 6 adapters through a 3-adapter host cache and 2 device slots: every adapter read and
    # written into a slot, the idle host cache back within its bound.
    assert manager.num_host_loads >= len(adapters)
    assert manager.num_slot_loads >= len(adapters)
    assert len(manager.list_loras()) <= 3
    assert manager.num_slots_in_use <= 2


@pytest.fixture(scope="module")
def lora_llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=4, max_lora_rank=16,
               **SMALL_ENGINE)


def test_grouped_kernel_graphs_only_on_the_jax_runtime(lora_llm):
    """lora_backend="auto" lets the TPU table send its largest graphs to the grouped
    Pallas kernel on the jax runtime only: torch_xla reaches Pallas through a JAX bridge
    never verified on a TPU, so there the table stays on XLA ops."""
    engine = lora_llm.llm_engine
    jax_runtime = engine.stats()["runtime"] == "jax"
    assert engine.runner.punica.grouped_kernel_from == (
        step_layout.GROUPED_KERNEL_FROM if jax_runtime else None)


def test_remove_lora_frees_slot_and_host_copy(lora_llm, llama_adapters):
    engine = lora_llm.llm_engine
    req = LoRARequest("all8", 41, llama_adapters["all8"])
    first = lora_llm.generate("The cat", GREEDY, lora_request=req, use_tqdm=False)
    assert 41 in engine.list_loras() and 41 in engine.lora_manager.slots
    assert engine.stats()["lora_slots_in_use"] >= 1
    assert engine.remove_lora(41) is True
    assert 41 not in engine.list_loras() and 41 not in engine.lora_manager.slots
    assert engine.remove_lora(41) is False
    again = lora_llm.generate("The cat", GREEDY, lora_request=req, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_pinned_adapter_keeps_its_slot(lora_llm, llama_adapters):
    engine = lora_llm.llm_engine
    reqs = [LoRARequest(n, 50 + i, p) for i, (n, p) in enumerate(llama_adapters.items())]
    engine.add_lora(reqs[0])
    engine.pin_lora(reqs[0].lora_int_id)
    lora_llm.generate(["a", "b", "c", "d"], GREEDY, lora_request=reqs, use_tqdm=False)
    lora_llm.generate(["e", "f"], GREEDY, lora_request=reqs[2:], use_tqdm=False)
    assert reqs[0].lora_int_id in engine.lora_manager.slots
    with pytest.raises(ValueError, match="not loaded"):
        engine.pin_lora(999)


def _corrupt(src, dst, *, config=None, weights=None):
    """Copy an adapter dir, then edit its config (dict update) or weights (fn on tensors)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        path = f"{dst}/adapter_config.json"
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(path, "w") as f:
            json.dump(cfg, f)
    if weights is not None:
        path = f"{dst}/adapter_model.safetensors"
        save_file(weights(load_file(path)), path)
    return str(dst)


def _nan_first(tensors):
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    return tensors


def _wrong_shape(tensors):
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()
    return tensors


BAD_ADAPTERS = {
    "rank_too_big": (lambda base, src, d: make_peft_adapter(base, d, r=32), "greater than max_lora_rank"),
    "dora": (lambda base, src, d: make_peft_adapter(base, d, r=4, use_dora=True), "served only by an engine started with enable_dora"),
    "modules_to_save": (lambda base, src, d: _corrupt(src, d, config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "bias": (lambda base, src, d: _corrupt(src, d, config={"bias": "all"}), "bias"),
    "unknown_target": (lambda base, src, d: _corrupt(src, d, weights=lambda t: {k.replace("layers.0.", "layers.99."): v for k, v in t.items()}), "expected target modules"),
    "wrong_shape": (lambda base, src, d: _corrupt(src, d, weights=_wrong_shape), "do not match the base model"),
    "nan": (lambda base, src, d: _corrupt(src, d, weights=_nan_first), "NaN or Inf"),
    "missing_dir": (lambda base, src, d: f"{d}/does-not-exist", "No adapter found"),
    "peft_type": (lambda base, src, d: _corrupt(src, d, config={"peft_type": "LOHA"}), "LOHA"),
    "lm_head": (lambda base, src, d: make_peft_adapter(base, d, r=4, target_modules=["q_proj", "lm_head"]), "served only by an engine whose lora_target_modules"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_is_rejected_and_engine_keeps_serving(case, lora_llm, llama_dir, llama_adapters,
                                                          tmp_path):
    make, message = BAD_ADAPTERS[case]
    path = make(llama_dir, llama_adapters["all8"], str(tmp_path / case))
    bad = LoRARequest(case, 77, path)
    engine = lora_llm.llm_engine
    with pytest.raises(ValueError, match=message) as err:
        lora_llm.generate("The cat", GREEDY, lora_request=bad, use_tqdm=False)
    assert case in str(err.value)  # the adapter is named
    assert 77 not in engine.list_loras() and not engine.has_unfinished_requests()
    good = LoRARequest("qv4", 78, llama_adapters["qv4"])
    out = lora_llm.generate("The cat", GREEDY, lora_request=good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == MAX_NEW


def test_corrupt_weights_file_is_rejected(lora_llm, llama_adapters, tmp_path):
    import shutil

    path = tmp_path / "corrupt"
    shutil.copytree(llama_adapters["all8"], path)
    (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read"):
        lora_llm.llm_engine.add_lora(LoRARequest("corrupt", 79, str(path)))


def test_every_precompiled_kernel_shape_lowers_for_tpu(llama_dir):
    """The runner's own LoRA kernel shapes (default ladders) lower to Mosaic."""
    from vllm_tpu_lora.ops.pallas_export import export_shape

    llm = LLM(llama_dir, enable_lora=True, max_loras=4, max_lora_rank=16, precompile=False)
    shapes = llm.llm_engine.runner.lora_kernel_shapes("bfloat16")
    runner = llm.llm_engine.runner
    assert {s.num_tokens for s in shapes} == set(runner.token_ladder)
    assert {s.num_slots for s in shapes} == set(runner.slot_ladder) - {0}
    for shape in shapes:
        exported = export_shape(shape)
        assert "tpu_custom_call" in exported.mlir_module()
