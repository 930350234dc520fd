"""runtime="jax" (the engine's torch modules as jax.jit graphs through torchax) on CPU:
the same oracles as the torch_xla suite, on the engine that runs through JAX.

- HF greedy parity (Llama GQA/untied, Qwen2 bias/tied), chunked prefill mixed with
  decodes, ids identical and logprobs to 1e-4 (test_hf_parity's oracle);
- PEFT parity of mixed-adapter batches on both LoRA backends (xla; pallas, whose kernels
  run in interpret mode on CPU) with fewer device slots than adapters (test_lora_e2e's);
- seeded sampling (n=2, top-p/top-k, logprobs) equal to the torch_xla runtime's;
- prefix caching (base and adapter) and adapter remove/re-add/load_inplace, against
  HF/PEFT;
- a real `vllm-tpu-lora serve --runtime jax` process queried with the openai client;
- torchax_compat's tolerance of removed named-tensor overloads, and bad arguments.

Nothing compiles after warm-up, counted by the engine and by JAX's own compile events.
"""

import contextlib
import itertools
import logging
import sys

import numpy as np
import openai
import pytest
import torch

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.lora import step_layout
from vllm_tpu_lora.runner.jax_runtime import jax_compile_count
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model
from vllm_tpu_lora.testing.server import RemoteServer

from .conftest import SMALL_ENGINE
from .test_hf_parity import _assert_matches_hf, _check_parity
from .test_lora_e2e import (
    ADAPTER_SPECS,
    GREEDY,
    MAX_NEW,
    _assert_batched_slot_writes,
    _assert_matches_peft,
    _make_adapters,
    _mixed_workload,
)

# 4 adapters (ranks 4-16) through 2 device slots: slots are evicted and written again.
LORA_ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=16, **SMALL_ENGINE)
FULL_HIT = 32  # a 41-token prompt: 2 full 16-token blocks (the last token is computed)


@contextlib.contextmanager
def no_jax_compiles():
    """No XLA compilation inside the block, by JAX's own compile events (process-wide:
    transfers and slot writes outside the engine's watched regions count too)."""
    before = jax_compile_count()
    yield
    assert jax_compile_count() == before, f"{jax_compile_count() - before} compilation(s)"


def _jax_llm(model_dir: str, **kwargs) -> LLM:
    before = jax_compile_count()
    llm = LLM(model_dir, runtime="jax", **kwargs)
    stats = llm.llm_engine.stats()
    assert stats["runtime"] == "jax" and stats["graph_replay"]
    # The counter the no-compile checks rely on does see this engine's warm-up.
    assert stats["num_graphs"] > 0 and jax_compile_count() - before >= stats["num_graphs"]
    return llm


@pytest.fixture(scope="module")
def jax_llama(llama_dir):
    return _jax_llm(llama_dir, **SMALL_ENGINE)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    return _make_adapters(llama_dir, tmp_path_factory, ADAPTER_SPECS)


@pytest.fixture(scope="module")
def peft_oracle(llama_dir, adapters):
    return load_oracle_model(llama_dir, adapters)


@pytest.fixture(scope="module")
def jax_lora(llama_dir):
    return _jax_llm(llama_dir, lora_backend="xla", **LORA_ENGINE)


def _peft_ids(oracle, prompt, name, max_new=MAX_NEW) -> list[int]:
    return hf_greedy(oracle, [prompt], max_new, adapter_names=[name])[0].token_ids


def _prompt(seed: int, n: int = 41) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=n).tolist()


# ---- 1. HF greedy parity ------------------------------------------------------------------

def test_llama_gqa_untied_matches_hf(llama_dir, jax_llama):
    with no_jax_compiles():
        _check_parity(jax_llama, llama_dir, seed=0)
    stats = jax_llama.llm_engine.stats()
    assert stats["runtime"] == "jax" and stats["compilations_after_warmup"] == 0
    # Prompts of up to 200 tokens through a 32-token budget: chunked, in both token buckets.
    assert {key.split("/")[0] for key, n in stats["forward_graph_steps"].items() if n} == {
        "T16", "T32"}


def test_qwen2_bias_tied_matches_hf(qwen2_dir):
    llm = _jax_llm(qwen2_dir, **SMALL_ENGINE)
    with no_jax_compiles():
        _check_parity(llm, qwen2_dir, seed=1)
    assert llm.llm_engine.stats()["compilations_after_warmup"] == 0


# ---- 2. PEFT parity, mixed adapters, slot pressure -----------------------------------------

@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_mixed_adapter_batch_matches_peft(request, llama_dir, adapters, backend):
    llm = (request.getfixturevalue("jax_lora") if backend == "xla"
           else _jax_llm(llama_dir, lora_backend="pallas", **LORA_ENGINE))
    assert llm.llm_engine.runner.punica.backend == backend
    engine = llm.llm_engine
    loads = engine.stats()["lora_slot_loads"]
    prompts, picks = _mixed_workload(adapters, n_prompts=12, seed=3)
    assert None in picks and set(adapters) <= set(picks)
    with no_jax_compiles():
        _assert_matches_peft(llm, llama_dir, adapters, prompts, picks)
    stats = engine.stats()
    assert stats["lora_slot_loads"] - loads > 2  # 4 adapters through 2 slots
    assert stats["lora_slots_in_use"] <= 2 and stats["compilations_after_warmup"] == 0
    # The loader thread moved the images of queued requests' adapters to the device
    # ahead of their writes (lora/staging.py), and every staged copy was dropped once its
    # slot was written: none is left holding device memory.
    staging = engine.lora_manager.staging
    assert staging.num_staged > 0 and staging.staged_bytes == 0


def test_tpu_strategies_and_dma_slot_copies_match_peft(llama_dir, adapters, caplog):
    """The TPU's LoRA graphs on this runtime, on CPU: its strategy table ("single" for one
    adapter, "onehot" over the step's adapters, "stacked" over every slot where the
    bucket is all of them, the fused grouped kernel (interpreted here) where T*S*R is
    large: its threshold lowered so that the 32-token bucket of 3-4 adapters reaches it)
    and its reads of the step's slots by the DMA copy a TPU runs (ops.take_slots,
    interpreted here), against PEFT, through fewer slots than adapters, graphs of every
    kind in one engine; the table logged at precompile; then a padded batch of slot
    writes (ops.put_slots) read back."""
    llm = LLM(llama_dir, runtime="jax", precompile=False, **{**LORA_ENGINE, "max_loras": 4})
    engine = llm.llm_engine
    punica = engine.runner.punica
    assert punica.grouped_kernel_from == step_layout.GROUPED_KERNEL_FROM  # "auto"
    punica.tpu_strategies = True
    assert punica.slot_copy == "dma"
    punica.grouped_kernel_from = (32 * 4 * 16, 4 * 16)  # T32 with 3-4 adapters of rank 16
    with caplog.at_level(logging.INFO, logger="vllm_tpu_lora.runner.model_runner"):
        engine.runner.precompile()
    assert ("T16: S1 single, S2 onehot, S4 stacked; T32: S1 single, S2 onehot, "
            "S4 grouped_kernel") in caplog.text
    prompts, picks = _mixed_workload(adapters, n_prompts=12, seed=5)
    with no_jax_compiles():
        _assert_matches_peft(llm, llama_dir, adapters, prompts, picks)
    kinds = {key.split("/")[-1] for key, n in engine.stats()["forward_graph_steps"].items() if n}
    assert {"single", "onehot", "stacked", "grouped_kernel"} <= kinds, kinds
    _assert_batched_slot_writes(llm)  # this runtime's writes: a dynamic update per slot


def test_forced_indexed_kernel_matches_peft(llama_dir, adapters):
    """The indexed Pallas kernel (interpreted here), forced on every LoRA graph of the
    TPU's table as a benchmark forces it to check the table's verdict: each step's
    adapters read at their slots, through fewer slots than adapters, equal to PEFT."""
    # Compiled lazily, only the graphs the workload runs (interpreted kernels are slow to
    # build; warm-up and replay are other tests' business).
    llm = LLM(llama_dir, runtime="jax", precompile=False, **{**LORA_ENGINE, "max_loras": 4})
    engine = llm.llm_engine
    engine.runner.punica.tpu_strategies = True
    engine.runner.punica.force_strategy = "indexed"
    prompts, picks = _mixed_workload(adapters, n_prompts=8, seed=7)
    _assert_matches_peft(llm, llama_dir, adapters, prompts, picks)
    # Every step with an adapter ran the kernel, the one-adapter ones too ("single"
    # otherwise); steps of base requests alone (while adapters load) run no LoRA.
    kinds = {key.split("/")[-1] for key, n in engine.stats()["forward_graph_steps"].items() if n}
    assert "indexed" in kinds and kinds <= {"indexed", "base"}, kinds


# ---- 3. seeded sampling: jax == torch_xla -------------------------------------------------

def test_seeded_sampling_equals_torch_xla(llama_dir, jax_llama):
    # CI installs torch_xla; an install of the core package alone (current torch and JAX,
    # no torch_xla) has nothing to compare with.
    pytest.importorskip("torch_xla", reason="the torch_xla runtime is not installed")
    xla_llm = LLM(llama_dir, runtime="torch_xla", **SMALL_ENGINE)
    assert xla_llm.llm_engine.stats()["runtime"] == "torch_xla"
    rng = np.random.default_rng(21)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=n).tolist()} for n in (5, 40, 17, 2)]
    params = [SamplingParams(n=2, temperature=t, top_p=p, top_k=k, seed=s, max_tokens=10,
                             ignore_eos=True, logprobs=2)
              for t, p, k, s in ((0.8, 0.9, 40, 1), (1.0, 1.0, 0, 2), (1.3, 0.7, 0, 3),
                                 (0.9, 1.0, 100, 2**40))]
    with no_jax_compiles():
        got = jax_llama.generate(prompts, params, use_tqdm=False)
    want = xla_llm.generate(prompts, params, use_tqdm=False)
    assert jax_llama.llm_engine.stats()["compilations_after_warmup"] == 0
    sampled_differs = False
    for g, w in zip(got, want):
        gc, wc = (sorted(out.outputs, key=lambda c: c.index) for out in (g, w))
        assert len(gc) == len(wc) == 2
        sampled_differs |= gc[0].token_ids != gc[1].token_ids
        for a, b in zip(gc, wc):
            assert a.token_ids == b.token_ids, g.request_id
            for entry_a, entry_b in zip(a.logprobs, b.logprobs):
                assert entry_a.keys() == entry_b.keys()
                np.testing.assert_allclose([entry_a[t].logprob for t in entry_a],
                                           [entry_b[t].logprob for t in entry_a],
                                           atol=1e-5, rtol=0)
    assert sampled_differs, "the n=2 samples were all identical: not sampling"


# ---- 4. prefix caching ---------------------------------------------------------------------

def _hits(llm) -> int:
    return llm.llm_engine.stats()["prefix_cache_hits"]


def test_prefix_cache_hits_and_matches_hf(llama_dir, jax_llama):
    prompt = _prompt(99)
    before = _hits(jax_llama)
    with no_jax_compiles():
        _assert_matches_hf(jax_llama, llama_dir, [prompt])
        assert _hits(jax_llama) == before
        _assert_matches_hf(jax_llama, llama_dir, [prompt])
        assert _hits(jax_llama) - before == FULL_HIT
        # Three requests reading the cached blocks in one batch, with other continuations.
        others = [prompt, prompt[:35] + _prompt(5, 6), prompt[:33] + _prompt(6, 20)]
        _assert_matches_hf(jax_llama, llama_dir, others)
    assert _hits(jax_llama) - before == 4 * FULL_HIT


def test_prefix_cache_with_adapter_matches_peft(jax_lora, peft_oracle, adapters):
    prompt = _prompt(98)
    lora = LoRARequest("cached-rs16", 700, adapters["rs16"])
    want = _peft_ids(peft_oracle, prompt, "rs16")
    assert want != _peft_ids(peft_oracle, prompt, None)
    hits = []
    with no_jax_compiles():
        for _ in range(2):
            before = _hits(jax_lora)
            out = jax_lora.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=lora,
                                    use_tqdm=False)
            assert out[0].outputs[0].token_ids == want
            hits.append(_hits(jax_lora) - before)
    assert hits == [0, FULL_HIT]
    assert jax_lora.llm_engine.stats()["loras"]["cached-rs16"]["prefix_cache_hits"] >= FULL_HIT
    jax_lora.llm_engine.remove_lora(700)


# ---- 5. adapter lifecycle ------------------------------------------------------------------

def test_remove_readd_and_load_inplace_serve_new_weights(jax_lora, peft_oracle, adapters):
    engine = jax_lora.llm_engine
    prompt = _prompt(97, 9)
    want = {n: _peft_ids(peft_oracle, prompt, n) for n in ("all8", "qv4", "pattern")}
    assert len({tuple(ids) for ids in want.values()}) == 3  # the versions are told apart

    def run(req):
        out = jax_lora.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=req,
                                use_tqdm=False)
        return out[0].outputs[0].token_ids

    with no_jax_compiles():
        assert run(LoRARequest("tenant", 800, adapters["all8"])) == want["all8"]
        assert engine.remove_lora(800) is True
        assert 800 not in engine.list_loras() and 800 not in engine.lora_manager.slots
        v2 = LoRARequest("tenant", 800, adapters["qv4"])  # same id, other weights
        assert run(v2) == want["qv4"]
        v3 = LoRARequest("tenant", 800, adapters["pattern"])
        assert engine.add_lora(v3, load_inplace=True) is True
        assert run(v3) == want["pattern"]
    stats = engine.stats()
    assert stats["compilations_after_warmup"] == 0 and stats["captures_after_warmup"] == 0
    assert engine.remove_lora(800) is True


# ---- 6. the server -------------------------------------------------------------------------

SERVE = [sys.executable, "-m", "vllm_tpu_lora.entrypoints.cli", "serve"]


def test_server_adapter_completion_matches_peft(llama_dir, adapters, peft_oracle):
    from transformers import AutoTokenizer

    args = [llama_dir, "--runtime", "jax", "--served-model-name", "base", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "16", "--max-model-len", "128", "--enable-lora",
            "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
            f"all8={adapters['all8']}", "--disable-uvicorn-access-log"]
    with RemoteServer(args, command=SERVE, wait=False) as server:
        # The oracle runs while the server starts.
        tok = AutoTokenizer.from_pretrained(llama_dir)
        text = "The cat sat on the mat because"
        ids = tok(text).input_ids
        want = hf_greedy(peft_oracle, [ids], 10, adapter_names=["all8"])[0]
        assert want.token_ids != _peft_ids(peft_oracle, ids, None, 10)
        server.wait_healthy()
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)
        cards = {m.id: m for m in client.models.list().data}
        assert list(cards) == ["base", "all8"]
        assert cards["all8"].root == adapters["all8"]
        got = client.completions.create(model="all8", prompt=text, max_tokens=10, temperature=0,
                                        logprobs=0, extra_body={"ignore_eos": True})
        choice = got.choices[0]
        assert got.model == "all8" and choice.finish_reason == "length"
        assert choice.logprobs.tokens == [tok.decode([t]) for t in want.token_ids]
        np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs, atol=1e-4,
                                   rtol=0)
        # The text is the ids' decoding (an incomplete last character is held back).
        full = tok.decode(want.token_ids, skip_special_tokens=True)
        assert choice.text == full.rstrip("\ufffd")
        stats = server.stats()
        assert stats["runtime"] == "jax" and stats["compilations_after_warmup"] == 0


# ---- 6b. the capture's state --------------------------------------------------------------

def test_read_only_state_is_read_not_donated():
    """Mutable FixedTensors are donated and updated in place; read-only ones (the LoRA slot
    buffers in the forward) are plain inputs: new contents are seen without a second
    capture, the caller's array survives the call, and an in-place update is refused."""
    from vllm_tpu_lora.runner.jax_runtime import JaxRuntime
    from vllm_tpu_lora.runner.lazy_capture import FixedTensors

    rt = JaxRuntime()
    cap = rt.make_capture(lambda: [])

    def fn(x, acc: FixedTensors, read: FixedTensors):
        acc.value[0].add_(x)
        return x * read.value[0].sum()

    graph = cap.compile(fn)
    acc = rt.to_device(np.zeros(2, np.float32))
    read = rt.to_device(np.ones(3, np.float32))
    x = rt.to_device(np.array([1.0, 2.0], np.float32))
    acc_state, read_state = FixedTensors([acc]), FixedTensors([read], read_only=True)
    acc_before, read_before = acc._elem, read._elem
    assert rt.to_host(graph(x, acc_state, read_state)).tolist() == [3.0, 6.0]
    assert acc_before.is_deleted() and not read_before.is_deleted()
    read._elem = rt.to_device(np.array([1.0, 2.0, 4.0], np.float32))._elem  # a slot write
    assert rt.to_host(graph(x, acc_state, read_state)).tolist() == [7.0, 14.0]
    assert rt.to_host(acc).tolist() == [2.0, 4.0] and cap.captures == 1

    def writes_read_only(x, read: FixedTensors):
        read.value[0].mul_(2)
        return x
    with pytest.raises(TypeError, match="not read_only"):
        cap.compile(writes_read_only)(x, read_state)


# ---- 7. torchax_compat ---------------------------------------------------------------------

def test_tolerate_removed_named_overloads():
    from vllm_tpu_lora.torchax_compat import RemovedOverload, tolerate_removed_named_overloads

    packet_type = torch._ops.OpOverloadPacket
    original = packet_type.__getattr__
    prod = torch.ops.aten.prod
    cached = prod.dim_int
    # A packet whose overloads are not cached yet: each lookup goes through __getattr__
    # (a private constructor, but one that leaves torch's own packets untouched).
    fresh = packet_type(prod._qualified_op_name, prod.__name__, prod._op, prod._overload_names)
    has_named = hasattr(prod, "dim_Dimname")  # torch >= 2.13 removed it
    with tolerate_removed_named_overloads():
        gone = prod.dim_Dimname_gone_for_test
        assert isinstance(gone, RemovedOverload)
        with pytest.raises(NotImplementedError, match=r"aten::prod\.dim_Dimname_gone_for_test"):
            gone(torch.ones(2))
        with pytest.raises(AttributeError, match="not_an_overload"):
            prod.not_an_overload  # noqa: B018
        assert prod.dim_int is cached
        looked_up = fresh.dim_int
        assert isinstance(looked_up, torch._ops.OpOverload)
        assert looked_up._schema == cached._schema
        assert looked_up(torch.tensor([[2.0, 3.0]]), 1).tolist() == [6.0]
        if has_named:
            assert isinstance(fresh.dim_Dimname, torch._ops.OpOverload)
    assert packet_type.__getattr__ is original
    with pytest.raises(AttributeError):
        prod.dim_Dimname_gone_for_test  # noqa: B018
    with pytest.raises(AttributeError):
        fresh.names_gone_for_test  # noqa: B018
    # Undone when the block raises, too.
    with pytest.raises(KeyError), tolerate_removed_named_overloads():
        raise KeyError("x")
    assert packet_type.__getattr__ is original


# ---- 8. bad arguments ----------------------------------------------------------------------

def test_bad_runtime_arguments(llama_dir):
    with pytest.raises(ValueError, match="runtime"):
        LLM(llama_dir, runtime="nope", **SMALL_ENGINE)
    # This process started JAX with one CPU device (tensor parallel runs get more in a
    # process of their own: tests/test_tensor_parallel_jax.py).
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) is larger than the "
                                         r"number of CPU devices \(1\)"):
        LLM(llama_dir, runtime="jax", tensor_parallel_size=2, **SMALL_ENGINE)


def test_compiles_past_the_mapping_limit_are_refused_with_the_reason(llama_dir, monkeypatch):
    """XLA's CPU executables take memory mappings of their own; a warm-up that would cross
    vm.max_map_count is refused with the limit and the fix named, before LLVM fails and
    the process dies (a 16-layer model with LoRA did, ~90 graphs in). The process's map
    count is replaced by one that grows 1,000 a reading (a real one moves with whatever
    else this test process frees and maps), so that a compile soon would cross; with a
    budget of its own, as a fresh process has (the real one is per process)."""
    from vllm_tpu_lora.runner import map_budget

    monkeypatch.setattr(map_budget, "BUDGET", map_budget.MapBudget())
    llm = LLM(llama_dir, runtime="jax", precompile=False, **SMALL_ENGINE)
    assert llm.llm_engine.runner.capture.map_budget is map_budget.BUDGET  # a CPU device
    readings = itertools.count(10_000, 1_000)
    monkeypatch.setattr(map_budget, "count_maps", lambda: next(readings))
    monkeypatch.setattr(map_budget, "max_map_count", lambda: 14_500 + map_budget.RESERVE)
    # (Two compile threads may interleave their readings: the counts in the message vary.)
    with pytest.raises(RuntimeError, match=r"vm.max_map_count = 16548\): the \d graphs "
                                           r"compiled so far took up to ~\d+ mappings each.*"
                                           r"sudo sysctl -w vm.max_map_count=262144"):
        llm.llm_engine.runner.precompile()


def test_compile_threads_bound_how_many_warm_up_compiles_run_at_once(llama_dir, monkeypatch):
    """VLLM_TPU_LORA_COMPILE_THREADS=1: warm-up's compiles run one at a time (each holds
    its graph's compiler state in host memory), and every graph still compiles; a value
    that is not a positive integer is refused with the variable's name."""
    from vllm_tpu_lora.runner import jax_runtime
    from vllm_tpu_lora.runner.jax_runtime import JaxGraphCapture

    pools = []

    class RecordedPool(jax_runtime.ThreadPoolExecutor):
        def __init__(self, max_workers, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(jax_runtime, "ThreadPoolExecutor", RecordedPool)
    running, most = [0], [0]
    compile_one = JaxGraphCapture._compile

    def counted(self, lowered, name):
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            return compile_one(self, lowered, name)
        finally:
            running[0] -= 1

    monkeypatch.setattr(JaxGraphCapture, "_compile", counted)
    monkeypatch.setenv("VLLM_TPU_LORA_COMPILE_THREADS", "1")
    llm = LLM(llama_dir, runtime="jax", **SMALL_ENGINE)
    assert pools == [1] and most[0] == 1 and llm.llm_engine.runner.num_graphs > 1
    monkeypatch.setenv("VLLM_TPU_LORA_COMPILE_THREADS", "0")
    with pytest.raises(ValueError, match="VLLM_TPU_LORA_COMPILE_THREADS must be a positive "
                                         "integer, got '0'"):
        LLM(llama_dir, runtime="jax", **SMALL_ENGINE)


def test_device_staging_is_bounded_by_bytes_and_freed_with_its_copy():
    """lora/staging.py: images staged beyond the byte budget are left to the write (one
    is always allowed), and a staged copy's bytes come back once it is dropped."""
    from vllm_tpu_lora.lora.manager import HostAdapter
    from vllm_tpu_lora.lora.staging import DeviceStaging
    from vllm_tpu_lora.runner.jax_runtime import JaxRuntime

    hosts = [HostAdapter(f"a{i}", torch.full((1024,), float(i))) for i in range(3)]
    staging = DeviceStaging(JaxRuntime(), limit_bytes=6000)  # one 4 KB image fits, not two
    assert staging.stage(hosts[0]) and not staging.stage(hosts[1])
    assert hosts[1].device is None and staging.staged_bytes == 4096
    assert np.array_equal(np.asarray(hosts[0].device._elem), np.zeros(1024))
    hosts[0].device = None  # written (or its host copy evicted): the budget is free again
    assert staging.staged_bytes == 0 and staging.stage(hosts[2])
    assert np.array_equal(np.asarray(hosts[2].device._elem), np.full(1024, 2.0))
