"""The OpenAI server on the base model: a real server process on 127.0.0.1, driven with the
official `openai` client and httpx. Every greedy output must equal offline LLM.generate /
LLM.chat for the same prompt (same engine arguments, so the same graphs and numerics)."""

import os

import httpx
import openai
import pytest

from vllm_tpu_lora import SamplingParams
from vllm_tpu_lora.testing.server import RemoteServer

from .conftest import SMALL_ENGINE

API_KEY = "test-key-123"
NAME = "tiny-llama"
PROMPTS = ["The cat", "A small dog looks at", "Q: What is 7 + 3? A:", "東京 and"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the compiler."}]


def engine_flags() -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_ENGINE.items()]


@pytest.fixture(scope="module")
def lora_roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_roots")
    allowed, outside = root / "allowed", root / "outside"
    for d in (allowed / "real", outside / "secret"):
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
    os.symlink(outside / "secret", allowed / "link_to_outside")
    # A real directory inside the root whose weights file points outside it.
    (allowed / "file_link").mkdir()
    os.symlink(outside / "secret" / "adapter_config.json", allowed / "file_link" / "adapter_config.json")
    return allowed, outside


@pytest.fixture(scope="module")
def server(llama_dir, lora_roots, request):
    allowed, _ = lora_roots
    args = ["--model", llama_dir, "--served-model-name", NAME, "--allowed-lora-dirs", str(allowed),
            *engine_flags()]
    with RemoteServer(args, api_key=API_KEY, wait=False,
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as srv:
        request.getfixturevalue("llama_llm")  # the offline engine compiles meanwhile
        srv.wait_healthy()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def post(server, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


# ---- outputs equal the offline API ----


def test_models_list(client, server, llama_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].root == llama_dir
    assert models[0].model_extra["max_model_len"] == SMALL_ENGINE["max_model_len"]


def test_completions_match_offline(client, llama_llm):
    expected = llama_llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected):
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        choice = got.choices[0]
        assert choice.text == exp.outputs[0].text
        assert choice.finish_reason == exp.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert got.usage.completion_tokens == len(exp.outputs[0].token_ids)


def test_completions_batch_and_token_ids(client, llama_llm):
    """A list of prompts in one request, and token-id prompts: choices in prompt order."""
    exp = llama_llm.generate(PROMPTS[:2], greedy(8), use_tqdm=False)
    got = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == \
        [e.outputs[0].text for e in exp]
    ids = [e.prompt_token_ids for e in exp]
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == \
        [e.outputs[0].text for e in exp]


def test_completions_stream_matches_offline(client, llama_llm):
    [exp] = llama_llm.generate(PROMPTS[2], greedy(16), use_tqdm=False)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == exp.outputs[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [exp.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_stream_with_stop_string_never_sends_text_it_takes_back(client, llama_llm):
    """A stop string truncates the engine's text; streaming holds back enough that the
    concatenated deltas still equal the final (truncated) text."""
    [full] = llama_llm.generate(PROMPTS[0], greedy(24, ignore_eos=True), use_tqdm=False)
    text = full.outputs[0].text
    stop = text[6:9] if len(text) > 9 else text[-2:]
    [exp] = llama_llm.generate(PROMPTS[0], greedy(24, ignore_eos=True, stop=[stop]),
                               use_tqdm=False)
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24,
                                       temperature=0, stop=[stop], stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == exp.outputs[0].text
    assert exp.outputs[0].finish_reason == "stop"


def test_chat_matches_offline(client, llama_llm):
    [exp] = llama_llm.chat(MESSAGES, greedy(12), use_tqdm=False)
    got = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                         temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == exp.outputs[0].text
    assert got.usage.prompt_tokens == len(exp.prompt_token_ids)
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        exp.outputs[0].text
    assert chunks[-1].usage.total_tokens == got.usage.total_tokens


def test_seeded_sampling_n2_matches_offline(client, llama_llm):
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10)
    [exp] = llama_llm.generate(PROMPTS[1], params, use_tqdm=False)
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], n=2, temperature=0.9,
                                    top_p=0.95, seed=1234, max_tokens=10,
                                    extra_body={"top_k": 50})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == \
        [o.text for o in exp.outputs]


def test_logprobs_and_echo(client, llama_llm):
    [exp] = llama_llm.generate(PROMPTS[0], greedy(5, logprobs=2), use_tqdm=False)
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                    logprobs=2).choices[0]
    out = exp.outputs[0]
    assert got.logprobs.token_logprobs == pytest.approx(
        [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)], abs=1e-5)
    # Top entries are keyed by decoded text, as in OpenAI's format (byte tokens may collide).
    assert [set(top) for top in got.logprobs.top_logprobs] == \
        [{e.decoded_token for e in lp.values()} for lp in out.logprobs]
    echoed = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5,
                                       temperature=0, echo=True).choices[0]
    assert echoed.text == PROMPTS[0] + out.text
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert [len(c.top_logprobs) for c in chat.choices[0].logprobs.content] == [3, 3, 3]


# ---- errors in OpenAI's shape ----


def test_api_key_required(server):
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=NAME, prompt="x", max_tokens=1)
    assert e.value.body["code"] == 401
    # The openai client refuses to run without a key, so "missing" goes through httpx.
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    # Tenants see only what is theirs: every adapter's activity (/stats), flushing every
    # tenant's cached prefixes and the version need the key too.
    for method, path in (("GET", "/stats"), ("POST", "/reset_prefix_cache"),
                         ("GET", "/version")):
        r = httpx.request(method, server.url + path, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, path
        ok = httpx.request(method, server.url + path, timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, path
    # Liveness and the Prometheus counters stay open, as in vLLM.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["message"] == "The model `no-such-model` does not exist."
    assert e.value.body["type"] == "NotFoundError" and e.value.body["code"] == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=2), "top_p"),
    (dict(max_tokens=255), "max_tokens"),  # prompt + max_tokens > max_model_len
    (dict(prompt="word " * 300), "prompt"),  # prompt alone > max_model_len
    (dict(frequency_penalty=0.5), "frequency_penalty"),  # known but unsupported
    (dict(seed=2**63), "seed"),  # past int64, as vLLM bounds it (it crashed the step)
])
def test_invalid_parameters_are_400(client, kwargs, param):
    body = dict(model=NAME, prompt=PROMPTS[0], max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    assert e.value.body["param"] == param
    assert param in e.value.body["message"] or param == "prompt"
    assert e.value.body["code"] == 400


def test_invalid_chat_parameters_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=-1)
    assert "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x " * 300}])
    assert "maximum model length" in e.value.body["message"]


def test_malformed_body_is_400(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["type"] == "BadRequestError"


# ---- runtime adapter endpoints: paths confined to --allowed-lora-dirs ----


@pytest.mark.parametrize("rel", ["../outside/secret", "link_to_outside", "file_link"])
def test_lora_path_escapes_are_refused(server, client, lora_roots, rel):
    allowed, _ = lora_roots
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": f"{allowed}/{rel}"})
    assert r.status_code == 403, r.text
    assert "outside the allowed LoRA directories" in r.json()["error"]["message"]
    assert [m.id for m in client.models.list().data] == [NAME]  # nothing loaded


def test_lora_path_outside_is_refused(server, lora_roots):
    _, outside = lora_roots
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(outside)})
    assert r.status_code == 403


def test_lora_endpoint_errors(server, lora_roots):
    allowed, _ = lora_roots
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": f"{allowed}/missing"})
    assert r.status_code == 404 and "No adapter found" in r.json()["error"]["message"]
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "", "lora_path": str(allowed)})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'never-loaded' cannot be found."
    # This server has no --enable-lora: a path that passes every check reaches the engine,
    # which refuses it; nothing is listed.
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": f"{allowed}/real"})
    assert r.status_code == 400 and "LoRA is not enabled" in r.json()["error"]["message"]


# ---- operational endpoints ----


def test_health_version_metrics(server, client):
    client.completions.create(model=NAME, prompt="The cat", max_tokens=3, temperature=0)
    assert httpx.get(server.url + "/health").status_code == 200
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(server.url + "/version", headers=auth).json()["version"]
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm_tpu_lora:lora_slots_in_use", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:generation_tokens_total",
                 'vllm:request_success_total{finished_reason="length",model_name="tiny-llama"}',
                 "vllm_tpu_lora:compilations_after_warmup 0.0"):
        assert name in text, name
    stats = server.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["num_unfinished_requests"] == 0
