"""Capture once, replay always: after precompile a step runs no model Python code, and the
compile guard catches every late XLA compile and every late graph capture.

The probe is `sys.setprofile`: it sees every Python frame that runs. Under replay, the runner
runs the cached graph without executing the model's frames; a lazily re-traced step
(`enforce_eager=True`) runs all of them, which shows the probe can fail.
"""

import collections
import os
import sys

import numpy as np
import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams, platform
from vllm_tpu_lora.runner.compile_guard import RecompilationError
from vllm_tpu_lora.testing.factory import make_peft_adapter

from .conftest import SMALL_ENGINE

PKG = os.path.dirname(os.path.abspath(sys.modules["vllm_tpu_lora"].__file__))
# Code that belongs inside the graphs: the model, its layers, the LoRA ops, and the LoRA
# layers' and Punica wrapper's forward math (their host-side helpers, such as the slot
# writes' buffer lists and the per-step layout planning, legitimately run every step).
GRAPH_CODE = tuple(os.path.join(PKG, p) + os.sep for p in ("models", "layers", "ops"))
LORA_FORWARD = {os.path.join(PKG, "lora", "layers.py"): ("forward", "forward_slices"),
                os.path.join(PKG, "lora", "punica.py"): ("add_", "_")}


def _is_graph_code(code) -> bool:
    if code.co_filename.startswith(GRAPH_CODE):
        return True
    prefixes = LORA_FORWARD.get(code.co_filename)
    return prefixes is not None and code.co_name.startswith(prefixes)


class ModelCodeCounter:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, frame, event, arg) -> None:
        if event == "call" and _is_graph_code(frame.f_code):
            key = f"{os.path.relpath(frame.f_code.co_filename, PKG)}:{frame.f_code.co_name}"
            self.calls[key] = self.calls.get(key, 0) + 1

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("capture_adapters")
    return [LoRARequest(f"a{i}", i + 1, make_peft_adapter(llama_dir, str(root / f"a{i}"), r=8,
                                                          seed=20 + i)) for i in range(5)]


@pytest.fixture(scope="module")
def lora_llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
               **SMALL_ENGINE)


def _random_lora_workload(engine, adapters, rng, num_requests: int) -> dict:
    """Requests arrive while others run, over the base model and 5 adapters (2 slots, 3 host
    cache entries): adapters load, swap between slots and reload from disk."""
    pending = [(rng.integers(3, 500, size=int(rng.integers(1, 60))).tolist(),
                adapters[rng.integers(len(adapters))] if rng.integers(3) else None)
               for _ in range(num_requests)]
    finished, steps = {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                ids, lora = pending.pop()
                params = SamplingParams(temperature=float(rng.integers(2)), top_k=5,
                                        max_tokens=int(rng.integers(1, 12)), seed=7)
                engine.add_request(f"r{len(finished)}-{len(pending)}",
                                   {"prompt_token_ids": ids}, params, lora_request=lora)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < 1000
    return finished


def test_steady_state_steps_run_no_model_code(lora_llm, adapters):
    engine = lora_llm.llm_engine
    before = engine.stats()
    loads_before = before["lora_slot_loads"]
    with ModelCodeCounter() as counter:
        finished = _random_lora_workload(engine, adapters, np.random.default_rng(7), 40)
    assert len(finished) == 40
    stats = engine.stats()
    # Every step is counted on the graph it ran: its buckets and what its LoRA ops did.
    served = collections.Counter(stats["forward_graph_steps"])
    served.subtract(before["forward_graph_steps"])
    assert sum(served.values()) == stats["num_steps"] - before["num_steps"]
    runner = engine.runner
    for key in [k for k, n in served.items() if n]:
        t_b, s_b, w_b, kind = key.split("/")
        assert int(t_b[1:]) in runner.token_ladder and int(s_b[1:]) in runner.slot_ladder
        assert int(w_b[1:]) in [w * runner.block_size for w in runner.window_ladder]
        assert (kind == "base") == (s_b == "S0"), key
    assert any(n and not k.endswith("/base") for k, n in served.items()), served
    assert stats["lora_slot_loads"] - loads_before > 2  # adapters swapped between slots
    assert counter.calls == {}
    assert stats["compilations_after_warmup"] == 0 and stats["captures_after_warmup"] == 0
    assert stats["graph_replay"] is True


def test_enforce_eager_retraces_the_model_every_step(llama_dir):
    llm = LLM(llama_dir, enforce_eager=True, **SMALL_ENGINE)
    assert llm.llm_engine.stats()["graph_replay"] is False
    with ModelCodeCounter() as counter:
        llm.generate({"prompt_token_ids": [5, 6, 7]},
                     SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    layers = counter.calls.get("models/llama.py:forward", 0)
    assert layers >= 3 * 2  # every step ran the decoder layers' Python again


def test_replayed_outputs_equal_eager_outputs(llama_dir, lora_llm, adapters):
    """Replay is an optimisation only: the same requests give the same tokens and logprobs
    with lazy re-tracing."""
    eager = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                enforce_eager=True, **SMALL_ENGINE)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 3 * i))} for i in range(5)]
    loras = [None, adapters[0], adapters[1], adapters[0], None]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    got = lora_llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    want = eager.generate(prompts, params, lora_request=loras, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for tok, lp in lw.items():
                assert abs(lg[tok].logprob - lp.logprob) < 1e-4


# What torch_xla says when a consumed (donated) buffer is read again: "deleted" for a
# transferred buffer, no value any more for one a graph produced.
GONE = "is deleted|HasValue"


def _device_buffer(tensor):
    """A second handle on the device buffer a tensor holds now (once nothing is in flight)."""
    import torch_xla

    platform.wait_device_ops()
    _, (buffer,) = torch_xla._XLAC._get_tensors_xla_device_data_node([tensor])
    return buffer


def test_forward_updates_the_kv_cache_in_place_and_only_it(lora_llm, adapters):
    """The forward graph consumes the KV cache's buffers (donated: aliased to the updated
    cache, no copy of every layer's cache per step), and never the LoRA slot buffers it
    only reads (a donated slot buffer would lose the adapters in it)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    lora_llm.generate(prompt, params, lora_request=adapters[0], use_tqdm=False)  # resident
    runner = lora_llm.llm_engine.runner
    writes = lora_llm.llm_engine.stats()["lora_slot_loads"]
    cache, slot_buffer = runner.kv_caches[0][0], runner.lora_manager.buffers[0]
    old_cache, old_slots = _device_buffer(cache), _device_buffer(slot_buffer)
    slots_before = old_slots.cpu().clone()
    lora_llm.generate(prompt, params, lora_request=adapters[0], use_tqdm=False)
    platform.wait_device_ops()
    assert lora_llm.llm_engine.stats()["lora_slot_loads"] == writes  # no slot write ran
    with pytest.raises(RuntimeError, match=GONE):
        old_cache.cpu()
    assert (old_slots.cpu() == slots_before).all()
    assert (slot_buffer.cpu() == slots_before).all()
    # A slot write, in turn, updates the slot buffers in place.
    absent = next(a for a in adapters if a.lora_int_id not in runner.lora_manager.slots)
    lora_llm.generate(prompt, params, lora_request=absent, use_tqdm=False)
    platform.wait_device_ops()
    assert lora_llm.llm_engine.stats()["lora_slot_loads"] == writes + 1
    with pytest.raises(RuntimeError, match=GONE):
        old_slots.cpu()


def test_a_step_moves_its_host_arrays_in_three_transfers_at_most(lora_llm, adapters):
    """Each host -> device transfer costs a fixed latency (a DMA each on a TPU): a step
    packs its token rows, attention metadata, LoRA plan and sampling rows into one int64
    buffer per graph plus one per float dtype (runner/packed_inputs.py), instead of one
    transfer per array (13 per greedy base step, 19-21 per sampled LoRA step before
    packing; 5-6 per sampled LoRA step with one buffer per dtype)."""
    import torch_xla.debug.metrics as met

    def transfers() -> int:
        data = met.metric_data("TransferToDeviceTime")
        return int(data[0]) if data else 0

    engine = lora_llm.llm_engine
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(3)]
    loras = [adapters[0], adapters[1], None]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, seed=1)
    want = lora_llm.generate(prompts, params, lora_request=loras, use_tqdm=False)  # slots filled
    steps0, n0, loads0 = engine.num_steps, transfers(), engine.stats()["lora_slot_loads"]
    got = lora_llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    steps = engine.num_steps - steps0
    assert steps >= 6 and engine.stats()["lora_slot_loads"] == loads0  # no slot write
    # forward: one int64 buffer (its int64, int32 and bool arrays); sampling: int64 and
    # the float32 parameters
    assert 0 < transfers() - n0 <= 3 * steps, (transfers() - n0, steps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_guard_catches_a_recapture_after_warmup(lora_llm):
    """A shape that was not precompiled is captured (traced and compiled) late: the guard
    raises in checking mode. Runs last in this module: it leaves the counters non-zero."""
    runner = lora_llm.llm_engine.runner
    assert runner.guard.strict
    with pytest.raises(RecompilationError, match="graph capture"):
        with runner.guard.watch("test"):
            runner._forward(runner._dummy(48, runner.request_ladder[0], 1), 1)
    assert runner.guard.captures_after_warmup >= 1


def test_persistent_cache_after_earlier_xla_work_warns_and_goes_on(monkeypatch, tmp_path, caplog):
    """torch_xla takes its persistent compilation cache only before the process's first XLA
    computation; an engine made after tensor work (on the TPU, tests/test_tpu.py's engines
    after its kernel test) failed at start with torch_xla's assertion. It must start without
    the cache, saying so. The TPU-only path is taken here on CPU by answering is_tpu()."""
    import logging

    import torch

    (torch.ones(2, device=platform.xla_device()) + 1).cpu()  # an XLA computation has run
    monkeypatch.setattr(platform, "is_tpu", lambda: True)
    monkeypatch.setattr(platform, "_cache_initialized", False)
    with caplog.at_level(logging.WARNING, logger=platform.__name__):
        assert platform.enable_persistent_cache(str(tmp_path / "xla_cache")) is False
    assert "persistent compilation cache not enabled" in caplog.text
    assert not (tmp_path / "xla_cache").exists()
