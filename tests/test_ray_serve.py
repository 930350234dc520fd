"""`vllm-tpu-lora serve-ray` on a local Ray cluster: two engine replicas of the tiny Llama
behind one OpenAI endpoint, the real `openai` client.

- Outputs over the base model and 6 adapters equal PEFT's (HF transformers + PEFT, float32
  greedy, decoded as the server streams text).
- Adapter affinity (Serve's multiplexing by model id): after the start-up loads, the adapter
  host loads summed over the replicas stay within a small bound of the number of adapters
  however many requests come; without affinity (`--no-adapter-affinity`) the same traffic
  makes the replicas' 4-entry host caches churn (6 adapters each) and loads grow with the
  requests.
- A load / unload through the endpoint reaches every replica; killing a replica while it
  runs requests loses none (retried on the other); SIGTERM stops everything the command
  started, Ray's processes too.
"""

import asyncio
import os
import signal
import sys
import time

import httpx
import numpy as np
import openai
import psutil
import pytest

from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import load_oracle_model
from vllm_tpu_lora.testing.server import RemoteServer

from .test_server_lora_lifecycle import expected_text

NAMES = [f"r{i}" for i in range(6)]
MAX_NEW = 5
SERVE_RAY = [sys.executable, "-m", "vllm_tpu_lora.entrypoints.cli", "serve-ray"]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray_adapters")
    return {n: make_peft_adapter(llama_dir, str(root / n), r=8, seed=200 + i, init_std=0.05)
            for i, n in enumerate(NAMES)}


@pytest.fixture(scope="module")
def oracle(llama_dir, adapters):
    from transformers import AutoTokenizer

    return load_oracle_model(llama_dir, adapters), AutoTokenizer.from_pretrained(llama_dir)


# Serve gives its HTTP proxy 5 s to report ready, then kills and replaces it; on a 2-core
# host busy with the rest of the suite the proxy missed that three times in a row and
# serve.start failed ("The actor is dead because it was killed by `ray.kill`").
RAY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
KEY = "ray-tenant-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _server(llama_dir, adapters, *extra) -> RemoteServer:
    args = [llama_dir, "--served-model-name", "base", "--num-replicas", "2",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "64",
            "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8",
            "--lora-modules", *[f"{n}={p}" for n, p in adapters.items()],
            "--allowed-lora-dirs", os.path.dirname(next(iter(adapters.values()))), *extra]
    srv = RemoteServer(args, command=SERVE_RAY, startup_timeout=900, stop_timeout=150,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **RAY_PATIENCE},
                       api_key=KEY)
    try:  # /health answers once one replica is up: wait for both
        deadline = time.monotonic() + 300
        while len(replica_stats(srv)) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"second replica never came up:\n{srv.log_tail()}")
            time.sleep(1)
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def server(llama_dir, adapters):
    with _server(llama_dir, adapters) as srv:
        yield srv


def replica_stats(server) -> list[dict]:
    return httpx.get(server.url + "/stats", headers=AUTH, timeout=60).json()["replicas"]


def adapter_loads(server) -> int:
    return sum(a["host_loads"] for r in replica_stats(server) for a in r["loras"].values())


def loads_by_replica(server) -> list[dict]:
    return [{n: a["host_loads"] for n, a in r["loras"].items()} for r in replica_stats(server)]


def workload(rounds: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    models = ["base", *NAMES]
    return [(m, rng.integers(3, 500, size=int(rng.integers(3, 20))).tolist())
            for _ in range(rounds) for m in models]


async def _complete_all(server, jobs, stagger: float = 0.0, max_tokens: int = MAX_NEW) -> list:
    """All jobs at once, or started `stagger` seconds apart (adapters coming into use over
    time rather than in one burst before any replica has reported what it holds)."""
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY,
                                  max_retries=0, timeout=300) as client:
        async def one(i, model, prompt):
            await asyncio.sleep(i * stagger)
            got = await client.completions.create(model=model, prompt=prompt,
                                                  max_tokens=max_tokens, temperature=0,
                                                  extra_body={"ignore_eos": True})
            return got.choices[0].text

        return await asyncio.gather(*(one(i, m, p) for i, (m, p) in enumerate(jobs)))


def run(server, jobs, stagger: float = 0.0) -> list:
    return asyncio.run(_complete_all(server, jobs, stagger))


def expected(oracle, jobs, n: int = MAX_NEW) -> list[str]:
    return [expected_text(oracle, p, None if m == "base" else m, n=n) for m, p in jobs]


def test_outputs_equal_peft_and_affinity_bounds_adapter_loads(server, oracle):
    stats = replica_stats(server)
    assert len(stats) == 2 and len({r["pid"] for r in stats}) == 2
    before = adapter_loads(server)
    first = workload(rounds=1)  # each adapter comes into use once, a moment apart
    assert run(server, first, stagger=1.0) == expected(oracle, first)
    jobs = workload(rounds=4, seed=1)  # then bursts over all of them
    assert run(server, jobs) == expected(oracle, jobs)
    assert run(server, jobs) == expected(oracle, jobs)
    # 63 requests over 6 adapters: each adapter read about once, not once per request
    # (Serve may also place a busy adapter on the second replica: one more read).
    loads = adapter_loads(server) - before
    assert loads <= len(NAMES) + 2, (loads, loads_by_replica(server))


def test_without_affinity_loads_grow_and_sigterm_stops_the_cluster(llama_dir, adapters,
                                                                     oracle, server):
    # Waves of one request per model, one wave after the other: without affinity each
    # replica sees a random ~half of the 6 adapters per wave through its 4-entry cache.
    waves = [workload(rounds=1, seed=10 + w) for w in range(6)]
    with_affinity_before = adapter_loads(server)
    for wave in waves:
        assert run(server, wave) == expected(oracle, wave)
    with_affinity = adapter_loads(server) - with_affinity_before
    plain = _server(llama_dir, adapters, "--no-adapter-affinity")
    try:
        first = workload(rounds=1, seed=2)
        assert run(plain, first, stagger=1.0) == expected(oracle, first)
        before = adapter_loads(plain)
        for wave in waves:
            assert run(plain, wave) == expected(oracle, wave)
        without = adapter_loads(plain) - before
        procs = {p: " ".join(p.cmdline()) for p in
                 psutil.Process(plain.proc.pid).children(recursive=True)}
    finally:  # SIGTERM (what Ctrl-C / a process manager sends) stops all it started
        plain.proc.send_signal(signal.SIGTERM)
        code = plain.proc.wait(timeout=120)
        plain.stop()
    print(f"adapter loads for {6 * len(waves[0])} requests: affinity {with_affinity}, "
          f"none {without}")
    assert without > with_affinity + len(NAMES), (without, with_affinity)
    assert code == 0
    assert any("raylet" in cmd for cmd in procs.values())
    _, alive = psutil.wait_procs(list(procs), timeout=60)
    assert not alive, [procs[p][:120] for p in alive]


def test_api_key_guards_what_the_ingress_and_the_replicas_answer(server):
    """/stats (answered by the ingress itself: every replica's adapters) and the API
    (forwarded to a replica) need the key; /health does not."""
    for path in ("/stats", "/v1/models"):
        r = httpx.get(server.url + path, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", path
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200


def test_load_and_unload_reach_every_replica(server, oracle, adapters, tmp_path):
    body = {"lora_name": "late", "lora_path": adapters["r1"]}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert all("late" in s["loras"] for s in replica_stats(server))
    ids = [m["id"] for m in httpx.get(server.base_url + "/models", headers=AUTH,
                                      timeout=30).json()["data"]]
    assert "late" in ids and set(NAMES) <= set(ids)
    jobs = [("late", [5, 6, 7, 8])]
    assert run(server, jobs) == [expected_text(oracle, [5, 6, 7, 8], "r1", n=MAX_NEW)]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 400 and "has already been loaded" in r.text  # every replica agrees
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"},
                   headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert all("late" not in s["loras"] for s in replica_stats(server))
    with pytest.raises(openai.NotFoundError):
        run(server, jobs)


def test_killing_a_replica_mid_run_loses_no_request(server, oracle):
    # Long answers (40 tokens, not 5): the victim must still hold requests when the kill
    # lands, not only when /stats answered a moment before (with 5-token requests it had
    # sometimes finished its share by then, and nothing was left to retry).
    jobs, n = workload(rounds=6, seed=3), 40
    want = expected(oracle, jobs, n)
    victim = replica_stats(server)[0]["pid"]

    def victim_busy() -> bool:
        return any(r["pid"] == victim and r["num_unfinished_requests"] > 0
                   for r in replica_stats(server))

    async def scenario():
        task = asyncio.ensure_future(_complete_all(server, jobs, max_tokens=n))
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(victim_busy):  # requests in flight on it
            assert time.monotonic() < deadline and not task.done(), "victim never busy"
            await asyncio.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        return await task

    assert asyncio.run(scenario()) == want
    # The ingress's warning reaches the server's log through Ray's log forwarding: allow
    # it a moment to arrive.
    deadline = time.monotonic() + 30
    while "replica died before answering" not in server.log_tail(200_000):  # and retried
        assert time.monotonic() < deadline, server.log_tail(4000)
        time.sleep(0.5)
    # Serve replaces the replica; the endpoint keeps answering meanwhile.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pids = {r["pid"] for r in replica_stats(server)}
        if len(pids) == 2 and victim not in pids:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"the dead replica was not replaced: {replica_stats(server)}")
    assert asyncio.run(_complete_all(server, jobs[:7], max_tokens=n)) == want[:7]
