"""Adapter lifecycle under load (engine level): references, no disk in the step, pins that
never hang, unload/reload, load_inplace, per-adapter stats, and a chaos run with adapters
broken on disk while their requests are queued and running.

Oracle: HF transformers + PEFT in float32 (greedy ids), computed before any damage.
"""

import os
import shutil
import sys
import time

import numpy as np
import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

from .conftest import SMALL_ENGINE

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
MAX_STEPS = 3000  # far above what any workload here needs: a hang fails, it doesn't block


@pytest.fixture(scope="module")
def adapter_src(llama_dir, tmp_path_factory):
    """Eight real PEFT adapters (name -> dir); tests copy them before damaging any."""
    root = tmp_path_factory.mktemp("lifecycle_src")
    return {f"a{i}": make_peft_adapter(llama_dir, str(root / f"a{i}"), r=8, seed=40 + i,
                                       init_std=0.05) for i in range(8)}


@pytest.fixture(scope="module")
def oracle(llama_dir, adapter_src):
    return load_oracle_model(llama_dir, adapter_src)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8,
               **SMALL_ENGINE)


_ids = iter(range(1000, 10**6))


def _copy_adapters(src: dict, root) -> dict[str, LoRARequest]:
    """Fresh copies under fresh ids (ids are never reused across tests)."""
    return {name: LoRARequest(name, next(_ids), shutil.copytree(path, str(root / name)))
            for name, path in src.items()}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def _drain(engine, done: dict, max_steps: int = MAX_STEPS) -> int:
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            return step
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps: "
                         f"{engine.stats(per_adapter=False)}")


class LoaderProbe:
    """sys.setprofile on the engine thread: calls into the adapter file reader while a step
    runs (the background loader thread is not profiled, and may read all it wants)."""

    READERS = ("_read_config", "_read_weights", "_header_tensors", "adapter_fingerprint",
               "load_peft_adapter", "plain_slices", "read_adapter_bytes")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, frame, event, arg) -> None:
        if (event == "call" and frame.f_code.co_name in self.READERS
                and frame.f_code.co_filename.endswith("peft_loader.py")):
            self.calls.append(frame.f_code.co_name)

    def step(self, engine):
        sys.setprofile(self)
        try:
            return engine.step()
        finally:
            sys.setprofile(None)


# ---- references --------------------------------------------------------------------------

def test_queued_request_does_not_evict_running_adapters(llm, adapter_src, tmp_path):
    engine = llm.llm_engine
    reqs = _copy_adapters({k: adapter_src[k] for k in ("a0", "a1", "a2")}, tmp_path)
    manager = engine.lora_manager
    long = SamplingParams(temperature=0.0, max_tokens=30)
    engine.add_request("r0", {"prompt_token_ids": [5, 6, 7]}, long, lora_request=reqs["a0"])
    engine.add_request("r1", {"prompt_token_ids": [8, 9]}, long, lora_request=reqs["a1"])
    done: dict = {}
    while len(engine.scheduler.running) < 2:
        engine.step()
    loads = {n: manager.registry.entries[r.lora_int_id].counters.copy() for n, r in reqs.items()
             if r.lora_int_id in manager.registry.entries}
    # A third adapter queues while both slots are in use; max_cpu_loras=2 is already full.
    engine.add_request("r2", {"prompt_token_ids": [10, 11]}, GREEDY, lora_request=reqs["a2"])
    for _ in range(10):
        for out in engine.step():
            done[out.request_id] = out
        assert set(manager.slots) == {reqs["a0"].lora_int_id, reqs["a1"].lora_int_id}
        for name in ("a0", "a1"):
            entry = manager.registry.entries[reqs[name].lora_int_id]
            assert entry.host is not None  # referenced: never dropped
            assert entry.counters["host_loads"] == loads[name]["host_loads"] == 1
            assert entry.counters["slot_loads"] == loads[name]["slot_loads"] == 1
    assert "r2" not in engine.running_request_ids()
    _drain(engine, done)
    assert {"r0", "r1", "r2"} <= set(done)


def test_idle_engine_starts_a_burst_as_one_batch(llm, adapter_src, oracle, tmp_path,
                                                 monkeypatch):
    """Requests for adapters on disk reach an idle engine: the first step that runs
    anything runs all of them (it waits for the reads in flight), instead of starting
    each adapter's requests as its read lands (a trickle of small prefill steps)."""
    from vllm_tpu_lora.engine import llm_engine

    monkeypatch.setattr(llm_engine, "_BURST_WAIT_S", 30.0)  # the bound is not under test
    engine = llm.llm_engine
    registry = engine.lora_manager.registry
    read = registry._load

    def slow_read(request):  # a slow disk: 30 ms per adapter, one after the other
        time.sleep(0.03)
        return read(request)

    monkeypatch.setattr(registry, "_load", slow_read)
    reqs = _copy_adapters({k: adapter_src[k] for k in ("a1", "a2")}, tmp_path)
    picks = ["a1", "a2", "a1", "a2"]
    prompts = [[30 + i, 31, 32] for i in range(4)]
    for i, (prompt, name) in enumerate(zip(prompts, picks)):
        engine.add_request(f"burst{i}", {"prompt_token_ids": prompt}, GREEDY,
                           lora_request=reqs[name])
    assert not engine.scheduler.running
    done: dict = {}
    steps = 0
    while not engine.scheduler.running:
        steps += 1
        assert steps < 50, "the burst never started"
        engine.step()
    assert sorted(engine.running_request_ids()) == [f"burst{i}" for i in range(4)]
    _drain(engine, done)
    expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=picks)
    assert [done[f"burst{i}"].outputs[0].token_ids for i in range(4)] == [
        e.token_ids for e in expected]
    for req in reqs.values():
        engine.remove_lora(req.lora_int_id)


def test_waiting_requests_do_not_hold_host_memory(llm, adapter_src, oracle, tmp_path):
    """40 requests over 40 distinct adapters: the host cache holds the running adapters plus
    at most max_cpu_loras others, never the whole queue."""
    engine = llm.llm_engine
    root = tmp_path / "many"
    src = adapter_src["a3"]
    reqs = [LoRARequest(f"m{i}", next(_ids), shutil.copytree(src, str(root / f"m{i}")))
            for i in range(40)]
    for i, req in enumerate(reqs):
        engine.add_request(f"m{i}", {"prompt_token_ids": [3 + i, 4]}, GREEDY, lora_request=req)
    registry = engine.lora_manager.registry
    assert not any(registry.entries[r.lora_int_id].host is not None for r in reqs)  # nothing read yet
    done: dict = {}
    peak = 0
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            done[out.request_id] = out
        held = [e for e in registry.entries.values() if e.host is not None]
        referenced = [e for e in held if e.refs]
        assert len(held) - len(referenced) <= engine.lora_manager.max_cpu_loras
        assert len(referenced) <= engine.scheduler.max_num_seqs
        peak = max(peak, len(held))
    assert len(done) == 40 and all(o.error is None for o in done.values())
    assert peak <= 2 + 2 + 1  # slots' running adapters + the idle cache (+1 in flight)
    # Every id holds a copy of a3: each output is PEFT's a3 output for its prompt.
    expected = hf_greedy(oracle, [[3 + i, 4] for i in range(40)], MAX_NEW,
                         adapter_names=["a3"] * 40)
    assert [done[f"m{i}"].outputs[0].token_ids for i in range(40)] == [e.token_ids for e in expected]
    for req in reqs:
        engine.remove_lora(req.lora_int_id)


# ---- pins ----------------------------------------------------------------------------------

def test_pin_that_would_leave_no_slot_is_refused(llm, adapter_src, tmp_path):
    engine = llm.llm_engine
    reqs = _copy_adapters({k: adapter_src[k] for k in ("a0", "a1", "a2")}, tmp_path)
    a0, a1, a2 = (reqs[k].lora_int_id for k in ("a0", "a1", "a2"))
    engine.add_lora(reqs["a0"])
    assert engine.pin_lora(a0) is True
    for name in ("a1", "a2"):  # max_cpu_loras=2: the pin keeps a0 in host memory too
        engine.add_lora(reqs[name])
    assert engine.lora_manager.is_loaded(a0)
    assert a0 in engine.lora_manager.slots  # pinning activates, as in vLLM
    with pytest.raises(ValueError, match="would leave no device slot"):
        engine.pin_lora(a1)  # max_loras=2: the last slot stays unpinned
    done: dict = {}
    for i, name in enumerate(("a1", "a2", "a1", "a2")):
        engine.add_request(f"p{i}", {"prompt_token_ids": [7, 8 + i]}, GREEDY,
                           lora_request=reqs[name])
    steps = _drain(engine, done, max_steps=200)
    assert len(done) == 4 and steps < 200
    assert a0 in engine.lora_manager.slots  # the pin held through the slot churn
    # Removing a pinned adapter unpins it: one source of truth, no stale scheduler copy.
    assert engine.remove_lora(a0) is True
    assert engine.lora_manager.pinned == set() and a0 not in engine.lora_manager.slots
    assert engine.pin_lora(a1) is True  # the freed pin is usable again
    engine.add_request("p-after", {"prompt_token_ids": [9, 9]}, GREEDY, lora_request=reqs["a2"])
    _drain(engine, done, max_steps=100)
    assert "p-after" in done
    engine.remove_lora(a1)
    engine.remove_lora(a2)


def test_pin_needs_a_loaded_adapter(llm):
    with pytest.raises(ValueError, match="not loaded"):
        llm.llm_engine.pin_lora(987654)


# ---- unload / reload -----------------------------------------------------------------------

def test_unload_frees_and_reload_reads_new_files(llm, adapter_src, oracle, tmp_path):
    engine = llm.llm_engine
    prompt = [11, 12, 13, 14]
    expected = {n: hf_greedy(oracle, [prompt], MAX_NEW, adapter_names=[n])[0].token_ids
                for n in ("a4", "a5")}
    path = str(tmp_path / "swap")
    shutil.copytree(adapter_src["a4"], path)
    req = LoRARequest("swap", next(_ids), path)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=req, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected["a4"]
    assert engine.remove_lora(req.lora_int_id) is True
    stats = engine.stats()
    assert "swap" not in stats["loras"] and req.lora_int_id not in engine.lora_manager.slots
    # New files at the same path, same id: a fresh read, not the old weights (vLLM #54839).
    shutil.rmtree(path)
    shutil.copytree(adapter_src["a5"], path)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=req, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected["a5"]
    # Files replaced on disk while the adapter is cached: the next request sees them too.
    shutil.rmtree(path)
    shutil.copytree(adapter_src["a4"], path)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=req, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected["a4"]
    engine.remove_lora(req.lora_int_id)


def test_requests_between_steps_share_one_check_of_the_files(llm, adapter_src, oracle, tmp_path,
                                                             monkeypatch):
    """A busy engine checks a cached adapter's files once a step, not once a request (a
    stat costs ~0.1 ms on the TPU VM's disk); files replaced on disk are seen by the first
    request after the next step."""
    import vllm_tpu_lora.lora.registry as registry_mod

    engine = llm.llm_engine
    prompt = [31, 32, 33]
    after_change = hf_greedy(oracle, [prompt], MAX_NEW, adapter_names=["a3"])[0].token_ids
    req = LoRARequest("busy", next(_ids), shutil.copytree(adapter_src["a2"], str(tmp_path / "b")))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("busy-long", {"prompt_token_ids": [5, 6]}, long, lora_request=req)
    checks: list[str] = []
    real = registry_mod.adapter_fingerprint
    monkeypatch.setattr(registry_mod, "adapter_fingerprint",
                        lambda path: checks.append(path) or real(path))
    for i in range(8):
        engine.add_request(f"busy-{i}", {"prompt_token_ids": prompt}, GREEDY, lora_request=req)
    assert checks == []  # checked when busy-long named it, in this same round
    done: dict = {}
    for out in engine.step():
        done[out.request_id] = out
    shutil.rmtree(req.lora_path)
    shutil.copytree(adapter_src["a3"], req.lora_path)
    engine.add_request("after", {"prompt_token_ids": prompt}, GREEDY, lora_request=req)
    engine.add_request("after-2", {"prompt_token_ids": prompt}, GREEDY, lora_request=req)
    assert checks == [req.lora_path]
    _drain(engine, done)
    assert done["after"].outputs[0].token_ids == after_change
    assert done["after-2"].outputs[0].token_ids == after_change
    engine.remove_lora(req.lora_int_id)


def test_load_inplace_never_mixes_versions(llm, adapter_src, oracle, tmp_path):
    engine = llm.llm_engine
    prompt = [21, 22, 23]
    old_exp = hf_greedy(oracle, [prompt], 24, adapter_names=["a6"])[0].token_ids
    new_exp = hf_greedy(oracle, [prompt], MAX_NEW, adapter_names=["a7"])[0].token_ids
    req = LoRARequest("live", next(_ids), shutil.copytree(adapter_src["a6"], str(tmp_path / "v1")))
    engine.add_request("old", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), lora_request=req)
    done: dict = {}
    while "old" not in engine.running_request_ids():
        engine.step()
    new_req = LoRARequest("live", req.lora_int_id,
                          shutil.copytree(adapter_src["a7"], str(tmp_path / "v2")))
    assert engine.add_lora(new_req, load_inplace=True) is True
    engine.add_request("new", {"prompt_token_ids": prompt}, GREEDY, lora_request=new_req)
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        # The new version waits until no running sequence uses the old one.
        assert not {"old", "new"} <= engine.running_request_ids()
    assert done["old"].outputs[0].token_ids == old_exp
    assert done["new"].outputs[0].token_ids == new_exp
    engine.remove_lora(req.lora_int_id)


# ---- chaos -----------------------------------------------------------------------------------

def test_chaos_broken_adapters_fail_alone(llm, adapter_src, oracle, tmp_path):
    """max_loras=2, max_cpu_loras=2, 8 adapters, 64 requests (base and adapters) arriving while
    others run; a5's directory is deleted once its first requests were admitted and a6's
    weights are overwritten with garbage. Good requests match PEFT; requests naming a5/a6
    after the damage are refused naming the adapter; nothing hangs, nothing recompiles, and
    no step reads an adapter file."""
    engine = llm.llm_engine
    reqs = _copy_adapters(adapter_src, tmp_path)
    # a5 early in the mix, so it is admitted (and damaged) while most requests still arrive.
    names = [None, "a5", "a0", "a1", "a6", "a2", "a3", "a4", "a7"]
    prompts = _prompts(64, seed=7)
    picks = [names[i % len(names)] for i in range(64)]
    expected = hf_greedy(oracle, prompts, MAX_NEW, adapter_names=picks)
    probe = LoaderProbe()
    done: dict = {}
    rejected: dict[int, str] = {}
    damaged_at = None
    queued_before_damage: set[int] = set()
    next_i = 0
    for step in range(MAX_STEPS):
        if next_i == 64 and not engine.has_unfinished_requests():
            break
        for _ in range(2):  # arrivals while others run
            if next_i < 64:
                i, next_i = next_i, next_i + 1
                lora = reqs[picks[i]] if picks[i] else None
                try:
                    engine.add_request(f"c{i}", {"prompt_token_ids": prompts[i]}, GREEDY,
                                       lora_request=lora)
                    if damaged_at is None:
                        queued_before_damage.add(i)
                except ValueError as e:
                    rejected[i] = str(e)
        if damaged_at is None and any(s.lora_int_id == reqs["a5"].lora_int_id
                                      for s in engine.scheduler.running):
            shutil.rmtree(reqs["a5"].lora_path)
            st = os.path.join(reqs["a6"].lora_path, "adapter_model.safetensors")
            with open(st, "wb") as f:
                f.write(b"\x00garbage, not safetensors" * 100)
            damaged_at = step
        for out in probe.step(engine):
            if out.finished:
                done[f"{out.request_id}"] = out
    else:
        raise AssertionError("chaos workload did not finish")
    assert damaged_at is not None
    assert probe.calls == [], f"adapter files read inside a step: {probe.calls}"
    broken = {"a5", "a6"}
    for i, (pick, exp) in enumerate(zip(picks, expected)):
        if pick not in broken:
            out = done[f"c{i}"]
            assert out.error is None and out.outputs[0].token_ids == exp.token_ids, (i, pick)
        elif i not in queued_before_damage:
            assert i in rejected and pick in rejected[i], (i, pick, rejected.get(i))
        else:  # queued before the damage: served from the host copy, or failed naming it
            out = done[f"c{i}"]
            if out.error is None:
                assert out.outputs[0].token_ids == exp.token_ids, (i, pick)
            else:
                assert pick in str(out.error)
    assert any(picks[i] in broken for i in rejected)
    stats = engine.stats()
    assert stats["compilations_after_warmup"] == 0 and stats["captures_after_warmup"] == 0
    for name in ("a0", "a1", "a2", "a3", "a4", "a7"):
        a = stats["loras"][name]
        assert a["host_loads"] >= 1 and a["slot_loads"] >= 1 and a["running"] == 0
        assert a["waiting"] == 0
    assert sum(a["slot_evictions"] for a in stats["loras"].values()) > 0
    for r in reqs.values():
        if r.lora_int_id in engine.lora_manager.registry.entries:
            engine.remove_lora(r.lora_int_id)


def test_add_lora_that_fails_to_read_leaves_nothing_behind(llm, adapter_src, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(adapter_src["a0"], str(tmp_path / "nan"))
    weights = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")  # the header is fine: only a full read sees it
    save_file(tensors, weights)
    req = LoRARequest("nan", next(_ids), path)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="Loading lora nan failed: .*NaN"):
        engine.add_lora(req)
    assert req.lora_int_id not in engine.lora_manager.registry.entries
    assert "nan" not in engine.stats()["loras"]


def test_validation_memo_never_passes_a_changed_adapter(llm, adapter_src, tmp_path,
                                                       monkeypatch):
    """Naming an adapter whose config, safetensors header and file size match one that
    passed validation skips the parse (adapters of one recipe: a1 after a0); a truncated
    file under that same header, or a changed config, is still validated and refused."""
    import vllm_tpu_lora.lora.manager as manager_mod

    manager = llm.llm_engine.lora_manager
    parses = []
    real = manager_mod.load_peft_adapter
    monkeypatch.setattr(manager_mod, "load_peft_adapter",
                        lambda req, *a, **k: parses.append(req.lora_name) or real(req, *a, **k))
    reqs = _copy_adapters({k: adapter_src[k] for k in ("a0", "a1")}, tmp_path / "same")
    manager.register(reqs["a0"])
    manager.register(reqs["a1"])
    assert parses.count("a1") == 0, "same recipe, same header: no second parse"

    truncated = _copy_adapters({"cut": adapter_src["a2"]}, tmp_path)["cut"]
    weights = os.path.join(truncated.lora_path, "adapter_model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 4)  # the header itself is intact
    with pytest.raises(ValueError, match="Loading lora cut failed: .*data_offsets"):
        manager.register(truncated)

    reranked = _copy_adapters({"rank": adapter_src["a3"]}, tmp_path)["rank"]
    config = os.path.join(reranked.lora_path, "adapter_config.json")
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace('"r": 8', '"r": 4'))
    with pytest.raises(ValueError, match="Loading lora rank failed: .*rank"):
        manager.register(reranked)
    assert parses.count("cut") == 1 and parses.count("rank") == 1
    for req in reqs.values():
        manager.remove_lora(req.lora_int_id)
