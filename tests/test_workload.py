"""A randomized workload through LLMEngine directly: requests arrive while others run,
with random lengths and sampling params. After precompile nothing may compile (the
session runs with VLLM_TPU_LORA_CHECK_RECOMPILATION=1, so a compile raises)."""

import numpy as np

from vllm_tpu_lora import SamplingParams


def _random_params(rng) -> SamplingParams:
    kind = rng.integers(4)
    common = dict(max_tokens=int(rng.integers(1, 24)), ignore_eos=bool(rng.integers(2)),
                  seed=int(rng.integers(1000)) if rng.integers(2) else None)
    if kind == 0:
        return SamplingParams(temperature=0.0, **common)
    if kind == 1:
        return SamplingParams(temperature=float(rng.uniform(0.2, 1.5)),
                              top_k=int(rng.integers(0, 50)), **common)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_p=float(rng.uniform(0.1, 1.0)),
                              min_p=float(rng.uniform(0, 0.2)), logprobs=int(rng.integers(0, 5)),
                              **common)
    return SamplingParams(temperature=0.7, n=int(rng.integers(1, 3)), **common)


def test_random_arrivals_never_compile(llama_llm):
    engine = llama_llm.llm_engine
    rng = np.random.default_rng(1234)
    pending = [(rng.integers(3, 500, size=int(rng.integers(1, 120))).tolist(), _random_params(rng))
               for _ in range(60)]
    finished, submitted, steps = {}, {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 4))):  # 0-3 new arrivals per step
            if pending:
                ids, params = pending.pop()
                rid = f"w{len(submitted)}"
                engine.add_request(rid, {"prompt_token_ids": ids}, params)
                submitted[rid] = params
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < 2000
    assert len(finished) == 60
    for rid, out in finished.items():
        params = submitted[rid]
        assert len(out.outputs) == params.n
        for c in out.outputs:
            assert 1 <= len(c.token_ids) <= params.max_tokens
            assert c.finish_reason in ("stop", "length")
            if params.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
    stats = engine.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["num_free_kv_blocks"] == engine.block_manager.num_usable_blocks


def test_seeded_request_is_the_same_alone_and_in_a_batch(llama_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 250]}
    alone = llama_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(10 + i, 30 + 3 * i))} for i in range(6)]
    noisy = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    batch = llama_llm.generate(others[:3] + [prompt] + others[3:],
                               [noisy] * 3 + [seeded] + [noisy] * 3, use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    again = llama_llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=43,
                                                      max_tokens=16, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert again != alone  # the seed matters


def test_abort_releases_everything(llama_llm):
    engine = llama_llm.llm_engine
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("to-abort", {"prompt_token_ids": list(range(3, 60))},
                       SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("keep", {"prompt_token_ids": [4, 5, 6]},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < free_before
    engine.abort_request("to-abort")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["keep"]
    assert engine.block_manager.num_free_blocks == free_before
