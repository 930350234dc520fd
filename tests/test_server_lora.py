"""Multi-LoRA serving through the OpenAI server (a real server process): every adapter's
greedy output equals offline LLM.generate with the same adapter; runtime load -> use ->
unload -> 404; 64 concurrent streams over 6 adapters with max_loras=2."""

import asyncio
import json
import os
import shutil

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.server import RemoteServer

from .conftest import SMALL_ENGINE

# One token bucket (16) keeps both compiles (the server's and the offline reference's) short.
ENGINE = dict(SMALL_ENGINE, max_num_batched_tokens=16)

BASE = "base"
STATIC = [f"a{i}" for i in range(6)]
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
PROMPTS = ["The cat", "Q: What is 14 + 3? A:", "Our team builds"]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Six static adapters, two for runtime loading, and one the engine must refuse.
    The first is made with peft; the others are copies of it with
    re-drawn weights (same files and format, ~50x cheaper than running peft again)."""
    root = tmp_path_factory.mktemp("adapters")
    first = make_peft_adapter(llama_dir, str(root / STATIC[0]), r=8, seed=0)
    paths = {STATIC[0]: first}
    for seed, name in enumerate(STATIC[1:] + ["extra", "extra2"], start=1):
        paths[name] = _redraw(first, str(root / name), seed)
    shutil.copytree(first, root / "bad")
    cfg = json.loads((root / "bad" / "adapter_config.json").read_text())
    (root / "bad" / "adapter_config.json").write_text(json.dumps(cfg | {"r": 16}))
    paths["bad"] = str(root / "bad")
    paths["root"] = str(root)
    return paths


def _redraw(src: str, dst: str, seed: int) -> str:
    shutil.copytree(src, dst)
    weights = os.path.join(dst, "adapter_model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=gen) * v.std()
               for k, v in sorted(load_file(weights).items())}
    save_file(tensors, weights)
    return dst


def lora(adapters, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, adapters[name])


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=8,
               **ENGINE)


@pytest.fixture(scope="module")
def bad_server(llama_dir, adapters):
    """Launched early so its start-up (imports, model load: adapters are loaded before the
    engine compiles) overlaps the main server's; checked last."""
    srv = RemoteServer(["--model", llama_dir, "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "16", "--max-model-len", "64", *LORA_FLAGS,
                        "--lora-modules", f"bad={adapters['bad']}"], wait=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(llama_dir, adapters, bad_server, request):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    modules = [f"{n}={adapters[n]}" for n in STATIC[:-1]]
    modules.append(json.dumps({"name": STATIC[-1], "path": adapters[STATIC[-1]],
                               "base_model_name": BASE}))
    # max_cpu_loras=4 < 6 adapters: the host cache evicts and reloads under load.
    args = ["--model", llama_dir, "--served-model-name", BASE, *flags, *LORA_FLAGS,
            "--max-cpu-loras", "4", "--lora-modules", *modules,
            "--allowed-lora-dirs", adapters["root"], "--disable-uvicorn-access-log"]
    with RemoteServer(args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
                      wait=False) as srv:
        request.getfixturevalue("offline")  # compiles while the server does
        srv.wait_healthy()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_models_list_has_every_adapter(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE] + STATIC
    for name in STATIC:
        assert cards[name].root == adapters[name]
        assert cards[name].model_extra["parent"] == BASE


def test_each_adapter_matches_offline(client, offline, adapters):
    names = [BASE] + STATIC
    loras = [None] + [lora(adapters, n, i + 1) for i, n in enumerate(STATIC)]
    for prompt in PROMPTS[:2]:
        expected = offline.generate([prompt] * len(names), greedy(10), lora_request=loras,
                                    use_tqdm=False)
        texts = {e.outputs[0].text for e in expected}
        assert len(texts) == len(names)  # the adapters really change the output
        for name, exp in zip(names, expected):
            got = client.completions.create(model=name, prompt=prompt, max_tokens=10,
                                            temperature=0)
            assert got.choices[0].text == exp.outputs[0].text, name
            assert got.model == name


def test_adapter_streaming_and_chat_match_offline(client, offline, adapters):
    lr = lora(adapters, "a2", 3)
    [exp] = offline.generate(PROMPTS[2], greedy(12), lora_request=lr, use_tqdm=False)
    stream = client.completions.create(model="a2", prompt=PROMPTS[2], max_tokens=12,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == exp.outputs[0].text
    messages = [{"role": "user", "content": "Tell me about the compiler."}]
    [exp] = offline.chat(messages, greedy(12), lora_request=lr, use_tqdm=False)
    got = client.chat.completions.create(model="a2", messages=messages, max_tokens=12,
                                         temperature=0)
    assert got.choices[0].message.content == exp.outputs[0].text
    stream = client.chat.completions.create(model="a2", messages=messages, max_tokens=12,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == exp.outputs[0].text


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_prefix_cache_salt_reset_and_metrics(server, client, offline, adapters):
    """Repeated prompts hit the prefix cache per adapter; cache_salt (both endpoints) keeps
    tenants apart; /reset_prefix_cache forgets; vLLM's counters are on /metrics."""
    prompt = list(range(20, 61))  # 41 tokens: 2 full 16-token blocks are reusable
    [exp] = offline.generate({"prompt_token_ids": prompt}, greedy(4),
                             lora_request=lora(adapters, "a1", 2), use_tqdm=False)

    def complete(**extra):
        before = server.stats()
        got = client.completions.create(model="a1", prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body=extra or None)
        assert got.choices[0].text == exp.outputs[0].text
        after = server.stats()
        return (after["prefix_cache_hits"] - before["prefix_cache_hits"],
                after["loras"]["a1"]["prefix_cache_hits"]
                - before["loras"]["a1"]["prefix_cache_hits"])

    complete()
    assert complete() == (32, 32)
    assert complete(cache_salt="tenant-1") == (0, 0)
    assert complete(cache_salt="tenant-1") == (32, 32)
    assert complete(cache_salt="tenant-2") == (0, 0)
    messages = [{"role": "user", "content": "Summarise the design of the compiler in detail, "
                 "with every pass, its inputs, its outputs and the invariants it keeps."}]
    hits = []
    for _ in range(2):
        before = server.stats()["prefix_cache_hits"]
        client.chat.completions.create(model="a1", messages=messages, max_tokens=2,
                                       temperature=0, extra_body={"cache_salt": "chat"})
        hits.append(server.stats()["prefix_cache_hits"] - before)
    assert hits[0] == 0 and hits[1] >= 16
    bad = post(server, "/v1/completions", {"model": "a1", "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    assert "'cache_salt' must be a non-empty string" in bad.json()["error"]["message"]
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=60).status_code == 200
    assert server.stats()["num_cached_kv_blocks"] == 0
    assert complete() == (0, 0)
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 'vllm_tpu_lora:lora_prefix_cache_hits_total{lora_name="a1"}'):
        assert name in metrics, name


def test_runtime_load_use_unload(server, client, offline, adapters):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["extra"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' added successfully."
    assert "extra" in [m.id for m in client.models.list().data]
    [exp] = offline.generate(PROMPTS[0], greedy(8), lora_request=lora(adapters, "extra", 50),
                             use_tqdm=False)
    got = client.completions.create(model="extra", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert got.choices[0].text == exp.outputs[0].text
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["extra"]})
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt=PROMPTS[0], max_tokens=8)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 404
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": adapters["bad"]})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Loading lora bad failed: ")
    assert "bad" not in [m.id for m in client.models.list().data]


def test_unload_while_in_use_waits_for_running_requests(server, client, adapters):
    assert post(server, "/v1/load_lora_adapter",
                {"lora_name": "extra2", "lora_path": adapters["extra2"]}).status_code == 200
    stream = client.completions.create(model="extra2", prompt=PROMPTS[1], max_tokens=60,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "extra2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra2", prompt=PROMPTS[1], max_tokens=2)
    rest = list(chunks)  # the running request finishes with its adapter
    assert rest[-1].choices[0].finish_reason == "length"
    assert len(first.choices[0].text + "".join(c.choices[0].text for c in rest)) > 0
    assert server.stats()["num_pending_lora_removals"] == 0


async def _stream_many(server, jobs):
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                timeout=300)

    async def one(model, prompt, n):
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    health, done = [], asyncio.Event()

    async def poll():
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(10_000):
                if done.is_set():
                    return
                health.append((await http.get(server.url + "/health")).status_code)
                await asyncio.sleep(0.05)

    poller = asyncio.create_task(poll())
    try:
        return await asyncio.gather(*(one(*job) for job in jobs)), health
    finally:
        done.set()
        await poller


def test_64_streams_over_6_adapters_with_2_slots(server, offline, adapters):
    names = [STATIC[i % 6] for i in range(64)]
    prompts = [f"Item {i} costs" for i in range(64)]
    lengths = [4 + (i * 5) % 20 for i in range(64)]
    ids = {n: i + 1 for i, n in enumerate(STATIC)}
    expected = offline.generate(prompts, [greedy(n) for n in lengths],
                                lora_request=[lora(adapters, n, ids[n]) for n in names],
                                use_tqdm=False)
    texts, health = asyncio.run(_stream_many(server, list(zip(names, prompts, lengths))))
    assert texts == [e.outputs[0].text for e in expected]
    assert health and set(health) == {200}
    stats = server.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["num_unfinished_requests"] == 0
    assert stats["lora_slots_in_use"] <= 2


def test_bad_static_adapter_fails_startup(bad_server):
    assert bad_server.wait_exit(timeout=180) == 2
    log = bad_server.log_tail()
    assert "Failed to load LoRA adapter 'bad'" in log
    assert "Loading lora bad failed: " in log and "rank 16" in log
