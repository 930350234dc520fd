"""Automatic prefix caching through the engine: outputs with caching on equal caching off
(shared system prompts over the base model and 4 adapters, preemption forced by a small KV
cache, chunked prefill, n > 1, aborts mid-run), and isolation: blocks are shared only
under the same weights (adapter id + version: reloads never hit old blocks) and the same
cache_salt, shown by hit counts and by outputs equal to the HF/PEFT float32 oracle.
"""

import shutil

import numpy as np
import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

# 13 usable blocks of 16 tokens for 8 sequences of ~60 tokens: preemption is certain.
# 32 batched tokens: every prompt is prefilled in chunks.
ENGINE = dict(enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=6, max_num_seqs=8,
              max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=14)
ADAPTERS = [f"a{i}" for i in range(6)]  # a0-a3 serve the workload, a4/a5 replace weights
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_adapters")
    return {n: make_peft_adapter(llama_dir, str(root / n), r=8, seed=70 + i, init_std=0.05)
            for i, n in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def oracle(llama_dir, adapters):
    return load_oracle_model(llama_dir, adapters)


@pytest.fixture(scope="module")
def cached_llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


def _lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, ADAPTERS.index(name) + 1, adapters[name])


def _workload(adapters):
    """(request id, prompt dict, params, lora, arrival step, abort step): two shared system prompts,
    each request on the base model or one of 4 adapters; two n=2 seeded-sampling requests;
    two long requests that are aborted mid-run."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(3, 500, size=n).tolist() for n in (40, 33)]
    loras = [None] + [_lora(adapters, n) for n in ADAPTERS[:4]]
    reqs = []
    for i in range(20):  # runs of 3 requests per adapter, then one more each, later
        lora = i // 3 if i < 15 else i - 15
        prompt = systems[lora % 2] + rng.integers(3, 500, size=int(rng.integers(3, 13))).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        if i in (4, 10):
            params = SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=8, ignore_eos=True,
                                    logprobs=0)
        reqs.append((f"r{i}", {"prompt_token_ids": prompt}, params, loras[lora],
                     0 if i < 10 else 12, None))
    for i, abort_at in enumerate((5, 20)):
        reqs.append((f"abort{i}", {"prompt_token_ids": systems[i] + [7, 8, 9]},
                     SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                     loras[i + 1], 0, abort_at))
    return reqs


def _drive(engine, reqs) -> dict:
    """Arrivals and aborts at fixed steps. The adapters are read first, so admission (and
    with it which blocks are cached when) does not depend on the background loader."""
    for lora in {r[3] for r in reqs} - {None}:
        engine.add_lora(lora)
    done = {}
    for step in range(MAX_STEPS):
        for rid, prompt, params, lora, arrival, abort_at in reqs:
            if arrival == step:
                engine.add_request(rid, prompt, params, lora_request=lora)
            if abort_at == step:
                engine.abort_request(rid)
        if step > 20 and not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("workload did not finish")


def _tokens_and_logprobs(out):
    return [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            for c in out.outputs]


def test_caching_on_equals_caching_off(llama_dir, adapters, cached_llm):
    reqs = _workload(adapters)
    on, off = cached_llm.llm_engine, LLM(llama_dir, enable_prefix_caching=False, **ENGINE).llm_engine
    results = {}
    for engine in (on, off):
        before = engine.stats()
        results[engine] = _drive(engine, reqs)
        stats = engine.stats()
        assert stats["num_preemptions"] > before["num_preemptions"]
        assert stats["compilations_after_warmup"] == 0
        assert stats["num_free_kv_blocks"] == engine.block_manager.num_usable_blocks  # no leak
        assert not any(engine.block_manager._refs)
    assert off.stats()["prefix_cache_hits"] == 0
    stats = on.stats()
    assert stats["enable_prefix_caching"] and stats["prefix_cache_hits"] > 0
    assert stats["prefix_cache_queries"] > stats["prefix_cache_hits"]
    assert on.scheduler.prefix_cache_stats[0][1] > 0  # the base model's requests hit too
    for name in ADAPTERS[:4]:  # and every adapter's found their own system prompt
        assert stats["loras"][name]["prefix_cache_hits"] > 0, name
    compared = [rid for rid, *_, abort_at in reqs if abort_at is None]
    assert set(compared) <= set(results[on]) and set(compared) <= set(results[off])
    for rid in compared:
        got, want = _tokens_and_logprobs(results[on][rid]), _tokens_and_logprobs(results[off][rid])
        assert [ids for ids, _ in got] == [ids for ids, _ in want], rid
        for (_, lp_on), (_, lp_off) in zip(got, want):
            np.testing.assert_allclose(lp_on, lp_off, atol=1e-5, rtol=0, err_msg=rid)


class _Probe:
    """Runs one greedy request and reports the prefix-cache hits it made."""

    def __init__(self, llm, oracle):
        self.llm, self.oracle = llm, oracle
        self.prompt = np.random.default_rng(99).integers(3, 500, size=41).tolist()

    def __call__(self, lora=None, salt=None, expect_as: str | None = None):
        engine = self.llm.llm_engine
        before = engine.stats()["prefix_cache_hits"]
        prompt = {"prompt_token_ids": self.prompt, **({"cache_salt": salt} if salt else {})}
        out = self.llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
        want = hf_greedy(self.oracle, [self.prompt], MAX_NEW, adapter_names=[expect_as])[0]
        assert out.outputs[0].token_ids == want.token_ids, (lora, salt, expect_as)
        return engine.stats()["prefix_cache_hits"] - before


FULL_HIT = 32  # 41 prompt tokens: 2 full blocks (the last token is always computed)


def test_blocks_are_shared_only_under_the_same_weights_and_salt(cached_llm, oracle, adapters):
    run = _Probe(cached_llm, oracle)
    a1, a2 = _lora(adapters, "a1"), _lora(adapters, "a2")
    assert run() == 0
    assert run() == FULL_HIT
    assert run(a1, expect_as="a1") == 0  # the base model's blocks are not a1's
    assert run(a2, expect_as="a2") == 0  # nor a1's a2's
    assert run(a1, expect_as="a1") == FULL_HIT
    assert run(a2, expect_as="a2") == FULL_HIT
    per_adapter = cached_llm.llm_engine.stats()["loras"]
    assert per_adapter["a1"]["prefix_cache_hits"] >= FULL_HIT
    # Salts: only the same salt shares, with the base model and adapters alike.
    assert run(salt="x") == 0
    assert run(salt="x") == FULL_HIT
    assert run(salt="y") == 0
    assert run(a1, salt="x", expect_as="a1") == 0
    assert run(a1, salt="x", expect_as="a1") == FULL_HIT
    # reset_prefix_cache forgets everything.
    assert cached_llm.reset_prefix_cache() is True
    assert cached_llm.llm_engine.stats()["num_cached_kv_blocks"] == 0
    assert run() == 0


def test_reloaded_adapters_never_hit_their_old_blocks(cached_llm, oracle, adapters, tmp_path):
    run, engine = _Probe(cached_llm, oracle), cached_llm.llm_engine
    path = shutil.copytree(adapters["a0"], str(tmp_path / "v1"))
    tenant = LoRARequest("tenant", 500, path)
    assert run(tenant, expect_as="a0") == 0
    assert run(tenant, expect_as="a0") == FULL_HIT
    # load_inplace: same name and id, new weights.
    v2 = LoRARequest("tenant", 500, shutil.copytree(adapters["a4"], str(tmp_path / "v2")))
    assert engine.add_lora(v2, load_inplace=True) is True
    assert run(v2, expect_as="a4") == 0
    assert run(v2, expect_as="a4") == FULL_HIT
    # The files under the same path replaced on disk.
    shutil.rmtree(v2.lora_path)
    shutil.copytree(adapters["a5"], v2.lora_path)
    assert run(v2, expect_as="a5") == 0
    assert run(v2, expect_as="a5") == FULL_HIT
    # Removed and added again under the same id: a new version, even with the first files.
    assert engine.remove_lora(500) is True
    assert run(tenant, expect_as="a0") == 0
    # The same name under another id shares nothing with it (vLLM #30931).
    assert run(LoRARequest("tenant", 501, path), expect_as="a0") == 0
    assert engine.stats()["compilations_after_warmup"] == 0
