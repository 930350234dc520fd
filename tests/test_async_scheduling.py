"""Async scheduling (step N+1 scheduled, prepared and launched while step N runs) changes
nothing a user sees. One engine runs the same random workload with it off and on (the
mode is host-side only, so the same graphs serve both): base model and three adapters
through two slots, greedy and seeded sampling, n = 2, stop strings and stop token ids,
min_tokens, logprobs, prefix-sharing prompts, aborts mid-run and a KV cache small enough
to preempt. The sync run is the oracle: token ids, texts, finish and stop reasons equal,
logprobs within 1e-5, no output after an abort, nothing compiled. Then two real servers,
one with --no-async-scheduling, stream the same requests to the openai client."""

import numpy as np
import openai
import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.server import RemoteServer

from .conftest import SMALL_ENGINE

# 16-token blocks, 14 usable: fewer than the workload's sequences need at once.
ENGINE = dict(SMALL_ENGINE, max_model_len=128, num_kv_blocks=15, block_size=16,
              enable_lora=True, max_loras=2, max_lora_rank=8, async_scheduling=True)
NUM_JOBS = 26


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_loras")
    return [LoRARequest(f"a{i}", i + 1, make_peft_adapter(llama_dir, str(root / f"a{i}"),
                                                          r=8, seed=70 + i))
            for i in range(3)]


@pytest.fixture(scope="module")
def servers(llama_dir):
    """Started first: they compile while the offline engine does."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_ENGINE.items()]
    with RemoteServer(["--model", llama_dir, "--served-model-name", "m", *flags,
                       "--async-scheduling"], wait=False) as on, \
         RemoteServer(["--model", llama_dir, "--served-model-name", "m", *flags,
                       "--no-async-scheduling"], wait=False) as off:
        yield on, off


@pytest.fixture(scope="module")
def llm(llama_dir, servers):
    return LLM(llama_dir, **ENGINE)


@pytest.fixture(scope="module")
def llm_jax(llama_dir):
    """The same engine on the jax runtime: its launches and on-device token hand-off are
    the other runtime's implementation of the same mode."""
    return LLM(llama_dir, runtime="jax", **ENGINE)


def _jobs(llm, adapters):
    """(request id, prompt ids, params, adapter, abort after k tokens or None)."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 500, size=40).tolist()  # a prefix several prompts share
    prompts = [(shared if i % 4 == 0 else []) + rng.integers(3, 500, size=int(rng.integers(
        5, 50))).tolist() for i in range(NUM_JOBS)]
    # Stop strings and ids that do occur: taken from a greedy probe of each prompt.
    probe = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    jobs = []
    for i, (prompt, pr) in enumerate(zip(prompts, probe)):
        toks, text = pr.outputs[0].token_ids, pr.outputs[0].text
        kind = i % 6
        common = dict(max_tokens=int(rng.integers(1, 40)), ignore_eos=bool(i % 2))
        if kind == 0:
            params = SamplingParams(temperature=0.0, stop=[text[4:7]] if len(text) > 7 else None,
                                    **common)
        elif kind == 1:
            params = SamplingParams(temperature=0.0, stop_token_ids=[toks[6]], logprobs=2,
                                    **common)
        elif kind == 2:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, logprobs=0,
                                    min_tokens=4, stop_token_ids=[toks[2]], **common)
        elif kind == 3:
            params = SamplingParams(temperature=0.8, top_k=20, seed=i, n=2, **common)
        elif kind == 4:
            params = SamplingParams(temperature=1.0, seed=i, stop=[text[2:4]], **common)
        else:
            params = SamplingParams(temperature=0.0, **dict(common, max_tokens=35))
        lora = adapters[i % 4] if i % 4 < 3 else None
        abort = 3 if kind == 5 and i % 2 else None
        jobs.append((f"j{i}", prompt, params, lora, abort))
    return jobs


def _run(engine, jobs, async_scheduling: bool) -> tuple[dict, set]:
    """Drive the engine step by step (two arrivals per step); abort a request once it
    has streamed k tokens. Returns each request's last output and the aborted ids."""
    engine.async_scheduling = async_scheduling
    queue, last, aborted = list(jobs), {}, set()
    abort_at = {rid: k for rid, *_, k in jobs if k is not None}
    steps = 0
    while queue or engine.has_unfinished_requests():
        for _ in range(2):
            if queue:
                rid, prompt, params, lora, _ = queue.pop(0)
                engine.add_request(rid, {"prompt_token_ids": prompt}, params, lora_request=lora)
        for out in engine.step():
            assert out.request_id not in aborted, "output after abort"
            last[out.request_id] = out
            k = abort_at.get(out.request_id)
            if k is not None and not out.finished and len(out.outputs[0].token_ids) >= k:
                engine.abort_request(out.request_id)
                aborted.add(out.request_id)
        steps += 1
        assert steps < 3000
    engine.step()  # a step still in flight: its rows are dropped, nothing is emitted
    return last, aborted


@pytest.mark.parametrize("engine_fixture", ["llm", "llm_jax"])
def test_async_scheduling_changes_no_output(engine_fixture, adapters, request):
    llm = request.getfixturevalue(engine_fixture)
    engine = llm.llm_engine
    assert engine.stats()["runtime"] == ("jax" if engine_fixture == "llm_jax" else "torch_xla")
    jobs = _jobs(llm, adapters)
    preempted0 = engine.stats()["num_preemptions"]
    sync, sync_aborted = _run(engine, jobs, async_scheduling=False)
    preempted1 = engine.stats()["num_preemptions"]
    got, got_aborted = _run(engine, jobs, async_scheduling=True)
    stats = engine.stats()

    assert got_aborted == sync_aborted and len(sync_aborted) >= 2
    assert set(got) == set(sync) == {rid for rid, *_ in jobs}
    for rid in sync:
        exp, out = sync[rid], got[rid]
        assert out.finished == exp.finished == (rid not in sync_aborted)
        for e, o in zip(exp.outputs, out.outputs, strict=True):
            assert o.token_ids == e.token_ids, rid
            assert (o.text, o.finish_reason, o.stop_reason) == (e.text, e.finish_reason,
                                                                e.stop_reason), rid
            if e.logprobs is not None:
                for pe, po in zip(e.logprobs, o.logprobs, strict=True):
                    assert pe.keys() == po.keys()
                    for t in pe:
                        assert abs(pe[t].logprob - po[t].logprob) <= 1e-5
                        assert pe[t].rank == po[t].rank
    # The workload covers what it claims (so that the equality above means something).
    finals = [c for o in sync.values() for c in o.outputs if o.finished]
    assert {type(c.stop_reason) for c in finals if c.finish_reason == "stop"} >= {str, int}
    assert any(c.finish_reason == "length" for c in finals)
    assert preempted1 > preempted0 and stats["num_preemptions"] > preempted1
    assert stats["lora_slot_loads"] > 2 and stats["prefix_cache_hits"] > 0
    assert stats["compilations_after_warmup"] == 0
    assert stats["num_free_kv_blocks"] == engine.block_manager.num_usable_blocks
    assert engine.lora_manager.num_slots_in_use <= 2


def test_async_scheduling_default_and_enforce_eager(llama_dir):
    """Default: on a TPU only (off on CPU, where it measured no gain); never eager."""
    def engine(**kw):
        return LLM(llama_dir, precompile=False, **SMALL_ENGINE, **kw).llm_engine

    assert not engine().async_scheduling  # this CPU
    assert engine(async_scheduling=True).async_scheduling
    assert not engine(async_scheduling=True, enforce_eager=True).async_scheduling


def _stream(server, prompt: str, **kw) -> list:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    chunks = list(client.completions.create(model="m", prompt=prompt, stream=True, **kw))
    by_choice: dict[int, list] = {}
    for c in chunks:
        for ch in c.choices:
            lp = ch.logprobs.token_logprobs if ch.logprobs else None
            by_choice.setdefault(ch.index, []).append((ch.text, ch.finish_reason, lp))
    return [by_choice[i] for i in sorted(by_choice)]


def test_server_streams_are_the_same_with_and_without_async_scheduling(servers):
    on, off = servers
    on.wait_healthy()
    off.wait_healthy()
    requests = [
        ("The cat", dict(max_tokens=20, temperature=0)),
        ("A small dog looks at", dict(max_tokens=16, temperature=0.9, seed=3, n=2, logprobs=2)),
        ("Q: What is 7 + 3? A:", dict(max_tokens=24, temperature=0, stop=["e"],
                                      extra_body={"ignore_eos": True})),
    ]
    for prompt, kw in requests:
        a, b = _stream(on, prompt, **kw), _stream(off, prompt, **kw)
        assert ["".join(t for t, _, _ in c) for c in a] == ["".join(t for t, _, _ in c) for c in b]
        assert [[f for _, f, _ in c if f] for c in a] == [[f for _, f, _ in c if f] for c in b]
        for ca, cb in zip(a, b, strict=True):
            la = [x for _, _, lp in ca if lp for x in lp]
            lb = [x for _, _, lp in cb if lp for x in lp]
            np.testing.assert_allclose(la, lb, atol=1e-5)
