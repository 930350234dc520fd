"""AsyncLLMEngine in-process: the session's LLMEngine adopted by the background loop (no
second compile). Step failures fail only their requests, a closed stream aborts its
request, a rejected request changes nothing, and a broken loop fails everything loudly."""

import asyncio

import pytest

from vllm_tpu_lora import SamplingParams
from vllm_tpu_lora.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
)


@pytest.fixture
def engine(llama_llm):
    """The shared offline engine, checked idle before and after each test."""
    eng = llama_llm.llm_engine
    assert not eng.has_unfinished_requests()
    free = eng.block_manager.num_free_blocks
    yield eng
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == free


def run(engine, body):
    async def main():
        aeng = AsyncLLMEngine.from_llm_engine(engine)
        await aeng.start()
        try:
            return await body(aeng)
        finally:
            aeng.shutdown()
    return asyncio.run(main())


async def collect(aeng, rid, prompt, params):
    last = None
    async for out in aeng.generate(prompt, params, rid):
        last = out
    return last


def test_concurrent_generate_matches_offline(engine, llama_llm):
    prompts = [f"Item {i} costs" for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    expected = llama_llm.generate(prompts, params, use_tqdm=False)

    async def body(aeng):
        return await asyncio.gather(*(collect(aeng, f"r{i}", p, params)
                                      for i, p in enumerate(prompts)))
    outs = run(engine, body)
    assert [o.outputs[0].token_ids for o in outs] == [e.outputs[0].token_ids for e in expected]
    assert all(o.finished for o in outs)


def test_step_error_fails_its_requests_and_the_loop_keeps_serving(engine, monkeypatch):
    real_launch, calls = engine.runner.launch, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def body(aeng):
        failed = await asyncio.gather(*(collect(aeng, f"f{i}", "The cat", params)
                                        for i in range(2)), return_exceptions=True)
        ok = await collect(aeng, "after", "The cat", params)
        return failed, ok, aeng.stats()
    failed, ok, stats = run(engine, body)
    assert all(isinstance(e, EngineStepError) and "injected" in str(e) for e in failed)
    assert ok.finished and len(ok.outputs[0].token_ids) == 6
    assert not stats["engine_dead"]


def test_closing_a_stream_aborts_its_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def body(aeng):
        gen = aeng.generate("The cat", params, "long")
        first = await gen.__anext__()
        await gen.aclose()  # what a client disconnect does to the response
        for _ in range(200):  # bounded wait for the loop to apply the abort
            if aeng.stats()["num_unfinished_requests"] == 0:
                break
            await asyncio.sleep(0.01)
        return first, aeng.stats()
    first, stats = run(engine, body)
    assert not first.finished
    assert stats["num_unfinished_requests"] == 0 and stats["num_open_streams"] == 0


def test_rejected_request_changes_nothing(engine):
    async def body(aeng):
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            await aeng.add_request("big", {"prompt_token_ids": [5] * 300}, SamplingParams())
        with pytest.raises(ValueError, match="already running"):
            stream = await aeng.add_request("dup", "The cat", SamplingParams(max_tokens=3))
            await aeng.add_request("dup", "The cat", SamplingParams(max_tokens=3))
        return [out async for out in stream][-1]
    assert run(engine, body).finished


def test_broken_loop_fails_everything_and_reports_dead(engine, monkeypatch):
    async def body(aeng):
        monkeypatch.setattr(engine, "stats", lambda: 1 / 0)  # breaks the loop itself
        with pytest.raises(EngineDeadError):
            await collect(aeng, "doomed", "The cat", SamplingParams(max_tokens=50))
        assert aeng.is_dead
        with pytest.raises(EngineDeadError):
            await aeng.add_request("late", "The cat", SamplingParams())
    run(engine, body)
    monkeypatch.undo()
    engine.abort_request("doomed")  # the dead loop could not; leave the shared engine idle
