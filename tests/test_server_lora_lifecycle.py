"""Adapter lifecycle through the real server and the `openai` client: unload frees the slot
and the host copy, loading again reads the new files, `load_inplace` swaps weights under a
name, per-adapter metrics, and a chaos run with adapters broken on disk mid-run.

Oracle: HF transformers + PEFT in float32 (greedy ids, decoded), computed before any damage.
"""

import asyncio
import os
import shutil
import time

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from vllm_tpu_lora.engine.detokenizer import IncrementalDetokenizer
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model
from vllm_tpu_lora.testing.server import RemoteServer

NAMES = [f"a{i}" for i in range(8)]
MAX_NEW = 6


@pytest.fixture(scope="module")
def src(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv_lifecycle_src")
    return {n: make_peft_adapter(llama_dir, str(root / n), r=8, seed=60 + i, init_std=0.05)
            for i, n in enumerate(NAMES)}


@pytest.fixture(scope="module")
def served(src, tmp_path_factory):
    """The copies the server serves (the chaos test damages two of them)."""
    root = tmp_path_factory.mktemp("srv_lifecycle")
    paths = {n: shutil.copytree(p, str(root / n)) for n, p in src.items()}
    paths["root"] = str(root)
    return paths


@pytest.fixture(scope="module")
def server(llama_dir, served):
    args = ["--model", llama_dir, "--served-model-name", "base", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "16", "--max-model-len", "64", "--enable-lora",
            "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", *[f"{n}={served[n]}" for n in NAMES],
            "--allowed-lora-dirs", served["root"], "--disable-uvicorn-access-log"]
    with RemoteServer(args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def oracle(llama_dir, src):
    return load_oracle_model(llama_dir, src), AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def expected_text(oracle, prompt_ids, adapter, n=MAX_NEW) -> str:
    """The oracle's greedy ids, as text the way the server streams text (incremental
    detokenization holds back a trailing partial UTF-8 character)."""
    model, tok = oracle
    [out] = hf_greedy(model, [prompt_ids], n, adapter_names=[adapter])
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=True)
    for t in out.token_ids:
        detok.add_token(t)
    return detok.output_text


def complete(client, model, prompt_ids, n=MAX_NEW) -> str:
    got = client.completions.create(model=model, prompt=prompt_ids, max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True})
    return got.choices[0].text


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def wait_for_stats(server, pred, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.stats()
        if pred(stats):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"stats never matched: {server.stats()}")


PROMPT = [31, 32, 33, 34]


def test_unload_frees_and_reload_reads_new_files(server, client, oracle, src, served, tmp_path):
    assert complete(client, "a0", PROMPT) == expected_text(oracle, PROMPT, "a0")
    stats = wait_for_stats(server, lambda s: "a0" in s["loras"])
    assert stats["loras"]["a0"]["slot_loads"] >= 1
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a0"})
    assert r.status_code == 200
    stats = wait_for_stats(server, lambda s: "a0" not in s["loras"])
    assert stats["lora_host_cache_size"] <= 2 and stats["lora_slots_in_use"] <= 1
    with pytest.raises(openai.NotFoundError):
        complete(client, "a0", PROMPT)
    # Same name again, new files (a1's weights): the new weights, not the old ones.
    new_path = shutil.copytree(src["a1"], os.path.join(served["root"], "a0-v2"))
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": new_path})
    assert r.status_code == 200
    assert complete(client, "a0", PROMPT) == expected_text(oracle, PROMPT, "a1")


def test_load_inplace_swaps_weights_under_the_name(server, client, oracle, src, served):
    assert complete(client, "a7", PROMPT) == expected_text(oracle, PROMPT, "a7")
    new_path = shutil.copytree(src["a2"], os.path.join(served["root"], "a7-v2"))
    r = post(server, "/v1/load_lora_adapter",
             {"lora_name": "a7", "lora_path": new_path, "load_inplace": True})
    assert r.status_code == 200, r.text
    assert complete(client, "a7", PROMPT) == expected_text(oracle, PROMPT, "a2")
    assert [m.id for m in client.models.list().data].count("a7") == 1
    # Without load_inplace an existing name is still refused, as in vLLM.
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a7", "lora_path": new_path})
    assert r.status_code == 400 and "has already been loaded" in r.text


async def _run_requests(server, jobs, pending=None):
    """jobs: (index, model, prompt ids). Returns {index: text or the exception}.
    `pending` (index -> model) holds the requests not answered yet."""
    pending = {} if pending is None else pending
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                timeout=600)  # the scenario's watchdog fires first
    _LIVE_CLIENTS.append(client)

    async def one(i, model, prompt):
        pending[i] = model
        try:
            got = await client.completions.create(model=model, prompt=prompt,
                                                  max_tokens=MAX_NEW, temperature=0,
                                                  extra_body={"ignore_eos": True})
            return i, got.choices[0].text
        except openai.APIStatusError as e:
            return i, e
        finally:
            pending.pop(i, None)

    try:
        async with client:
            return dict(await asyncio.gather(*(one(*job) for job in jobs)))
    finally:
        _LIVE_CLIENTS.remove(client)


_LIVE_CLIENTS: list = []


def _connection_pools() -> str:
    """The clients' HTTP connection pools (httpcore internals, best effort): tells a request
    the server never received (waiting for a connection) from one it did."""
    lines = []
    for client in _LIVE_CLIENTS:
        try:
            pool = client._client._transport._pool
            lines.append(f"connections {pool.connections!r}; waiting requests "
                         f"{len(getattr(pool, '_requests', []))}")
        except AttributeError as e:
            lines.append(f"(pool not readable: {e})")
    return "\n".join(lines)


def hang_report(server, pending) -> str:
    """What the server was doing while requests were still unanswered: taken before the
    client gives up, since a closed connection aborts the request and hides the state."""
    import faulthandler
    import tempfile

    try:
        stats = server.stats()
    except Exception as e:  # noqa: BLE001 - the dump matters more
        stats = repr(e)
    with tempfile.TemporaryFile("w+") as f:  # and what this (client) process was doing
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        client_threads = f.read()
    return (f"unanswered requests {pending}; server stats: {stats}\n{server.thread_dump()}\n"
            f"client pools:\n{_connection_pools()}\nclient threads:\n{client_threads}")


def test_chaos_broken_adapters_fail_alone(server, oracle, served):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, size=int(rng.integers(2, 30))).tolist() for _ in range(64)]
    # a0 and a7 carry other weights after the tests above: the chaos mix leaves them out.
    choices = ["base"] + NAMES[1:7]
    models = [choices[i % len(choices)] for i in range(64)]
    broken = {"a5", "a6"}
    expected = [expected_text(oracle, p, None if m == "base" else m) for p, m in zip(prompts, models)]
    pending: dict[int, str] = {}

    async def scenario():
        first = asyncio.create_task(_run_requests(
            server, [(i, models[i], prompts[i]) for i in range(32)], pending))
        # Damage once a5's first requests were admitted (or already served).
        await asyncio.to_thread(wait_for_stats, server, lambda s: "a5" in s["loras"] and (
            s["loras"]["a5"]["running"] or s["loras"]["a5"]["slot_loads"]))
        shutil.rmtree(served["a5"])
        with open(os.path.join(served["a6"], "adapter_model.safetensors"), "wb") as f:
            f.write(b"\x00garbage, not safetensors" * 100)
        second = await _run_requests(
            server, [(i, models[i], prompts[i]) for i in range(32, 64)], pending)
        return {**await first, **second}

    async def watched():
        task = asyncio.create_task(scenario())
        done, _ = await asyncio.wait({task}, timeout=180)  # ~20 s when healthy: a hang fails
        if not done:
            report = await asyncio.to_thread(hang_report, server, dict(pending))
            task.cancel()
            raise AssertionError(f"chaos run hung: {report}")
        return task.result()

    results = asyncio.run(watched())
    for i, (model, exp) in enumerate(zip(models, expected)):
        got = results[i]
        if model not in broken:
            assert got == exp, (i, model, got)
        elif i >= 32:  # named after the damage: refused, naming the adapter
            assert isinstance(got, openai.APIStatusError), (i, model, got)
            assert got.status_code == (404 if model == "a5" else 400)
            assert f"Loading lora {model} failed" in got.message
        else:  # queued before: served from its host copy, or failed naming the adapter
            assert got == exp or (isinstance(got, openai.APIStatusError)
                                  and model in got.message), (i, model, got)
    stats = wait_for_stats(server, lambda s: s["num_unfinished_requests"] == 0)
    assert stats["compilations_after_warmup"] == 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'vllm_tpu_lora:lora_host_loads_total{lora_name="a3"}' in metrics
    assert 'vllm_tpu_lora:lora_on_device{lora_name=' in metrics
    assert "vllm:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
    # Everything else keeps working after the damage.
    assert expected[1] == asyncio.run(_run_requests(server, [(1, models[1], prompts[1])]))[1]
