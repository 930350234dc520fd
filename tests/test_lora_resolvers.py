"""Adapters by name through resolvers, against real stores: a real S3-compatible server
process over HTTP (moto's server mode), a directory, and an offline Hugging Face cache.
The server is started with all three; requests name adapters it was never told about.
Outputs equal PEFT's greedy; concurrent first requests fetch once (counted in the S3
server's own request log); unknown names 404; names that could escape a prefix are refused
without a fetch; a broken adapter fails only its own requests."""

import asyncio
import json
import os
import re
import shutil

import httpx
import openai
import pytest

from vllm_tpu_lora.lora.resolvers import (
    DirectoryResolver,
    DownloadCache,
    check_adapter_name,
)
from vllm_tpu_lora.testing.factory import make_peft_adapter, sample_prompt_token_ids
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model
from vllm_tpu_lora.testing.s3 import CuttingProxy, LocalS3Server
from vllm_tpu_lora.testing.server import RemoteServer

from .conftest import SMALL_ENGINE

BUCKET, PREFIX = "tenants", "loras"
MAX_TOKENS = 8
HF_REPO = "acme/hf-adapter"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server as a process of its own; its request log counts the fetches."""
    with LocalS3Server(str(tmp_path_factory.mktemp("s3") / "moto.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def proxy(s3_server):
    """The server reaches S3 through this proxy, which breaks every download of the
    `cut` adapter's weights mid-way (the connection dropped after 2 KB)."""
    with CuttingProxy(s3_server.port, f"/{BUCKET}/{PREFIX}/cut/adapter_model.safetensors") as p:
        yield p


@pytest.fixture(scope="module")
def stores(llama_dir, s3_server, tmp_path_factory):
    """Adapters placed where tenants keep them: S3 (two, and a broken one), a directory,
    an offline HF cache (the layout huggingface_hub writes: refs/main -> snapshot)."""
    root = tmp_path_factory.mktemp("resolver_stores")
    made = {name: make_peft_adapter(llama_dir, str(root / "made" / name), r=8, seed=seed)
            for name, seed in [("s3-a", 11), ("s3-b", 12), ("dir-a", 13), ("hf-a", 14)]}
    s3 = s3_server.client()
    s3.create_bucket(Bucket=BUCKET)
    for name in ("s3-a", "s3-b"):
        for f in os.listdir(made[name]):
            s3.upload_file(os.path.join(made[name], f), BUCKET, f"{PREFIX}/{name}/{f}")
    # Broken: a config and a truncated weights file.
    s3.upload_file(os.path.join(made["s3-a"], "adapter_config.json"), BUCKET,
                   f"{PREFIX}/broken/adapter_config.json")
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/broken/adapter_model.safetensors",
                  Body=b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ")
    # Whole in the store; its downloads are cut mid-way by the proxy.
    for f in os.listdir(made["s3-a"]):
        s3.upload_file(os.path.join(made["s3-a"], f), BUCKET, f"{PREFIX}/cut/{f}")
    directory = root / "dir"
    shutil.copytree(made["dir-a"], directory / "dir-a")
    # An adapter trained for another model (its config says so).
    shutil.copytree(made["dir-a"], directory / "foreign")
    cfg_path = directory / "foreign" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "other-org/OtherModel-7B"
    cfg_path.write_text(json.dumps(cfg))
    hf_cache = root / "hf"
    repo = hf_cache / f"models--{HF_REPO.replace('/', '--')}"
    shutil.copytree(made["hf-a"], repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return {"env": s3_server.env, "made": made, "dir": str(directory), "hf_cache": str(hf_cache),
            "cache": str(root / "download_cache")}


@pytest.fixture(scope="module")
def server(llama_dir, stores, proxy):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_ENGINE.items()]
    args = ["--model", llama_dir, "--served-model-name", "base", *flags, "--enable-lora",
            "--max-loras", "2", "--lora-resolver-uri", f"s3://{BUCKET}/{PREFIX}",
            "--lora-resolver-uri", stores["dir"], "--lora-resolver-uri",
            f"hf-cache://{stores['hf_cache']}", "--lora-resolver-cache-dir", stores["cache"]]
    env = {**stores["env"], "AWS_ENDPOINT_URL": proxy.url,
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with RemoteServer(args, env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def oracle(llama_dir, stores):
    return load_oracle_model(llama_dir, stores["made"])


PROMPTS = sample_prompt_token_ids(2, seed=9, max_len=12)


def _complete(server, model: str, prompt) -> httpx.Response:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("name,made", [("s3-a", "s3-a"), ("dir-a", "dir-a"), (HF_REPO, "hf-a")])
def test_resolved_adapter_outputs_equal_peft(server, oracle, name, made):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server_model_dir(server))
    expected = hf_greedy(oracle, PROMPTS, MAX_TOKENS, adapter_names=[made] * len(PROMPTS))
    for prompt, exp in zip(PROMPTS, expected):
        got = _complete(server, name, prompt).json()["choices"][0]["text"]
        assert got == _text(tok, exp.token_ids), name
    card = [m for m in httpx.get(server.url + "/v1/models").json()["data"] if m["id"] == name]
    assert card and card[0]["root"] == name  # never the local path or the store's URI


def _text(tok, ids) -> str:
    # The server's incremental detokenizer holds back a trailing incomplete UTF-8
    # sequence (as vLLM's does); decode() shows it as U+FFFD.
    return tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def server_model_dir(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["root"]


def _fetches(s3_server, key: str) -> int:
    return sum(1 for line in s3_server.log().splitlines()
               if re.search(rf"GET /{BUCKET}/{PREFIX}/{key}\b", line))


def test_concurrent_first_requests_fetch_once(server, s3_server):
    assert _fetches(s3_server, "s3-b/adapter_model.safetensors") == 0

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json={
                "model": "s3-b", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}) for _ in range(8)))
    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1
    assert _fetches(s3_server, "s3-b/adapter_model.safetensors") == 1
    stats = httpx.get(server.url + "/stats").json()["lora_resolvers"]
    s3_stats = stats[0]
    assert s3_stats["resolver"] == "0:S3Resolver" and s3_stats["download_bytes"] > 0
    assert all("tenants" not in str(s) for s in stats)  # no URI in the answer
    text = httpx.get(server.url + "/metrics").text  # the same counters for Prometheus
    assert 'vllm_tpu_lora:lora_resolver_hits_total{resolver="0:S3Resolver"}' in text
    assert "tenants" not in text and "loras" not in text.replace("lora_", "")


def test_unknown_and_invalid_names(server, s3_server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nobody-has-this", prompt="x", max_tokens=1)
    assert e.value.body["message"] == "The model `nobody-has-this` does not exist."
    before = s3_server.log().count("GET ")
    for bad in ("../s3-a", "a/../../etc", "/etc/passwd", "a\\b", "x\x00y", ".hidden"):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": bad, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 400 and "Invalid LoRA adapter name" in r.json()["error"][
            "message"], (bad, r.text)
    assert s3_server.log().count("GET ") == before  # nothing was fetched for them


def test_adapter_for_another_base_model_is_refused_naming_both(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "foreign", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "other-org/OtherModel-7B" in msg and "'base'" in msg, msg


def test_broken_adapter_fails_alone(server, oracle, stores):
    """A broken adapter's requests fail while another tenant's run is unchanged."""
    async def both():
        async with httpx.AsyncClient(timeout=120) as client:
            ok = client.post(server.url + "/v1/completions", json={
                "model": "base", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            bad = client.post(server.url + "/v1/completions", json={
                "model": "broken", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS})
            return await asyncio.gather(ok, bad)
    ok, bad = asyncio.run(both())
    assert bad.status_code in (400, 404) and "broken" in bad.text
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server_model_dir(server))
    [exp] = hf_greedy(oracle, [PROMPTS[1]], MAX_TOKENS, adapter_names=[None])
    assert ok.json()["choices"][0]["text"] == _text(tok, exp.token_ids)


def test_download_cut_mid_way_fails_alone(server, oracle, stores, proxy):
    """A download that breaks mid-transfer fails only the requests for that adapter (503,
    naming it) and leaves nothing in the download cache; the other tenants' requests,
    running at the same time, are unchanged."""
    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            def post(model, prompt):
                return client.post(server.url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True})
            return await asyncio.gather(post("cut", PROMPTS[0]), post("base", PROMPTS[0]),
                                        post("s3-a", PROMPTS[1]), post("cut", PROMPTS[1]))
    cut, base, other, cut_again = asyncio.run(together())
    assert proxy.cuts >= 1
    for r in (cut, cut_again):
        assert r.status_code == 503 and "Loading lora cut failed" in r.text, r.text
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server_model_dir(server))
    exp_base, exp_other = hf_greedy(oracle, [PROMPTS[0], PROMPTS[1]], MAX_TOKENS,
                                    adapter_names=[None, "s3-a"])
    assert base.json()["choices"][0]["text"] == _text(tok, exp_base.token_ids)
    assert other.json()["choices"][0]["text"] == _text(tok, exp_other.token_ids)
    left = os.listdir(stores["cache"])
    assert not any("cut" in d or ".partial" in d for d in left), left
    models = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert "cut" not in models


def test_name_checks_and_cache_bound(tmp_path):
    for good in ("tenant-1", "acme/model.v2", "a_b"):
        check_adapter_name(good)
    for bad in ("..", "a/..", "/abs", "a//b", "a/b/c", "", "x\ny"):
        with pytest.raises(ValueError, match="Invalid LoRA adapter name"):
            check_adapter_name(bad)
    # A directory resolver never returns a path outside its root (a symlink out is refused).
    (tmp_path / "root").mkdir()
    (tmp_path / "outside" / "evil").mkdir(parents=True)
    (tmp_path / "outside" / "evil" / "adapter_config.json").write_text("{}")
    os.symlink(tmp_path / "outside" / "evil", tmp_path / "root" / "evil")
    assert DirectoryResolver(str(tmp_path / "root")).fetch("evil") is None
    # The download cache keeps at most max_bytes: the least recently used goes first.
    cache = DownloadCache(str(tmp_path / "cache"), max_bytes=250)

    def download(n):
        def run(tmp):
            with open(os.path.join(tmp, "w"), "wb") as f:
                f.write(b"x" * n)
            return n
        return run
    a, _ = cache.put("a", download(100))
    b, _ = cache.put("b", download(100))
    cache.put("a", download(100))  # a used again: b is now the oldest
    c, _ = cache.put("c", download(100))
    assert os.path.isdir(a) and os.path.isdir(c) and not os.path.isdir(b)
    with pytest.raises(OSError):  # a failed download leaves nothing behind
        cache.put("d", lambda tmp: (_ for _ in ()).throw(OSError("connection reset")))
    assert not [p for p in os.listdir(tmp_path / "cache") if "d" in p.split("__")[-1][:1]]
