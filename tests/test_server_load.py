"""The server under concurrent load and misbehaving clients (a real server process), plus its
start-up argument handling. No API key here; runtime adapter updating left disabled."""

import asyncio
import time

import httpx
import openai
import pytest

from vllm_tpu_lora import SamplingParams
from vllm_tpu_lora.entrypoints.openai import api_server
from vllm_tpu_lora.entrypoints.openai.cli_args import make_arg_parser
from vllm_tpu_lora.entrypoints.openai.protocol import LoRAModulePath
from vllm_tpu_lora.testing.factory import sample_prompt_token_ids
from vllm_tpu_lora.testing.server import RemoteServer

from .conftest import SMALL_ENGINE

NUM_CLIENTS = 64


@pytest.fixture(scope="module")
def server(llama_dir, request):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_ENGINE.items()]
    with RemoteServer(["--model", llama_dir, *flags, "--disable-uvicorn-access-log"],
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False"}, wait=False) as srv:
        request.getfixturevalue("llama_llm")  # the offline engine compiles meanwhile
        srv.wait_healthy()
        srv.idle_stats = srv.stats()
        yield srv


def _workload():
    """Half text prompts, half token ids; output lengths 4..27 so requests finish at
    different steps and new ones join running batches."""
    ids = sample_prompt_token_ids(NUM_CLIENTS // 2, min_len=3, max_len=20, seed=7)
    prompts = [f"Item {i} costs" for i in range(NUM_CLIENTS // 2)] + ids
    return prompts, [4 + (i * 7) % 24 for i in range(NUM_CLIENTS)]


async def _health_poller(url: str, stop: asyncio.Event, log: list) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(10_000):  # bounded; stops when the load is done
            if stop.is_set():
                return
            t0 = time.monotonic()
            status = (await http.get(url + "/health")).status_code
            log.append((status, time.monotonic() - t0))
            await asyncio.sleep(0.05)


async def _stream_all(server, prompts, max_tokens):
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                timeout=300)

    async def one(prompt, n):
        stream = await client.completions.create(
            model=server.model, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    stop, health = asyncio.Event(), []
    poller = asyncio.create_task(_health_poller(server.url, stop, health))
    try:
        texts = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
    finally:
        stop.set()
        await poller
    return texts, health


def test_runtime_lora_updating_disabled_is_404(server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(server.url + path, json={"lora_name": "a", "lora_path": "/tmp"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == 404


def test_64_concurrent_streams_match_offline(server, llama_llm, llama_dir):
    server.model = llama_dir
    prompts, max_tokens = _workload()
    offline_prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    expected = llama_llm.generate(offline_prompts,
                                  [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                                  use_tqdm=False)
    t0 = time.monotonic()
    texts, health = asyncio.run(_stream_all(server, prompts, max_tokens))
    elapsed = time.monotonic() - t0
    assert texts == [e.outputs[0].text for e in expected]
    # /health kept answering while 64 streams were served.
    assert len(health) >= 3 and all(status == 200 for status, _ in health)
    assert max(lat for _, lat in health) < min(5.0, elapsed)
    stats = server.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_free_kv_blocks"] == server.idle_stats["num_free_kv_blocks"]


async def _disconnecting_clients(url: str, n_stream: int, n_plain: int, model: str) -> None:
    body = {"model": model, "prompt": "The cat", "max_tokens": 240, "ignore_eos": True,
            "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        async def streaming():
            async with http.stream("POST", url + "/v1/completions",
                                   json=body | {"stream": True}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 2:
                        return  # leaving the block closes the connection mid-stream

        async def plain():
            with pytest.raises(httpx.ReadTimeout):
                await http.post(url + "/v1/completions", json=body, timeout=0.3)

        await asyncio.gather(*[streaming() for _ in range(n_stream)],
                             *[plain() for _ in range(n_plain)])


def test_disconnected_clients_release_everything(server, llama_dir):
    asyncio.run(_disconnecting_clients(server.url, 16, 4, llama_dir))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats["num_unfinished_requests"] == 0 and stats["num_open_streams"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_unfinished_requests"] == 0 and stats["num_open_streams"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_kv_blocks"] == server.idle_stats["num_free_kv_blocks"]
    metrics = httpx.get(server.url + "/metrics").text
    aborted = [line for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total") and 'reason="abort"' in line]
    assert aborted and float(aborted[0].split()[-1]) == 20  # aborted, not run to the end


# ---- start-up arguments (in-process: nothing here gets as far as building an engine) ----


def test_lora_modules_parsing():
    parse = make_arg_parser().parse_args
    args = parse(["--model", "m", "--lora-modules", "a=/p/a",
                  '{"name": "b", "path": "/p/b", "base_model_name": "m"}'])
    assert args.lora_modules == [LoRAModulePath("a", "/p/a"), LoRAModulePath("b", "/p/b", "m")]


@pytest.mark.parametrize("value,message", [
    ('{"name": "x"', "Invalid JSON format for --lora-modules"),
    ('{"name": "x", "pth": "/p"}', "Invalid fields for --lora-modules"),
    ("=/p", "expected name=path"),
])
def test_malformed_lora_modules_are_rejected(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        make_arg_parser().parse_args(["--model", "m", "--lora-modules", value])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_adapter_fails_startup_naming_it(llama_dir, tmp_path, capsys):
    code = api_server.main(["--model", llama_dir, "--enable-lora",
                            "--lora-modules", f"sql={tmp_path}/nope"])
    err = capsys.readouterr().err
    assert code == 2
    assert "'sql'" in err and "No adapter found" in err
    code = api_server.main(["--model", llama_dir, "--lora-modules", f"sql={tmp_path}"])
    assert code == 2 and "--lora-modules needs --enable-lora" in capsys.readouterr().err


def test_serve_subcommand_and_api_key_env(monkeypatch):
    from vllm_tpu_lora.config import api_key_from_env
    from vllm_tpu_lora.entrypoints.cli import build_parser
    from vllm_tpu_lora.entrypoints.openai.cli_args import model_of

    args = build_parser().parse_args(["serve", "/m", "--port", "9001", "--enable-lora",
                                      "--max-loras", "3", "--lora-backend", "xla"])
    assert (model_of(args), args.port, args.enable_lora, args.max_loras) == ("/m", 9001, True, 3)
    assert args.lora_backend == "xla" and args.func.__name__ == "_serve"
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_key_from_env() == "from-env"


def test_prefix_caching_flag_defaults_on_and_can_be_turned_off():
    from vllm_tpu_lora.entrypoints.args import engine_kwargs
    from vllm_tpu_lora.entrypoints.cli import build_parser

    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve", "/m"]))["enable_prefix_caching"] is True
    assert engine_kwargs(parse(["serve", "/m", "--no-enable-prefix-caching"]))[
        "enable_prefix_caching"] is False
    assert engine_kwargs(parse(["serve", "/m", "--enable-prefix-caching"]))[
        "enable_prefix_caching"] is True
