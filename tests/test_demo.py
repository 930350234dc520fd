"""The bundled demo assets do their jobs through this engine, alone and mixed, and
`vllm-tpu-lora demo` runs."""

import importlib.util
import os
import subprocess
import sys

import pytest

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.assets import (
    DEMO_TASKS,
    demo_adapters,
    demo_expected,
    demo_model_dir,
    demo_prompt,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _held_out_words() -> list[str]:
    """The training script's own held-out set (never trained on), every third word."""
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "make_demo_assets.py")
    spec = importlib.util.spec_from_file_location("make_demo_assets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.held_out_words()[::3]


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(demo_model_dir(), enable_lora=True, max_loras=4, max_lora_rank=16,
               max_num_seqs=32, max_num_batched_tokens=128, max_model_len=64)


@pytest.fixture(scope="module")
def words():
    ws = _held_out_words()
    assert len(ws) >= 50
    return ws


def _requests():
    return {None: None, **{t: LoRARequest(t, i + 1, p) for i, (t, p) in enumerate(demo_adapters().items())}}


def _run(llm, jobs):
    reqs = _requests()
    outs = llm.generate([demo_prompt(w) for _, w in jobs], GREEDY,
                        lora_request=[reqs[t] for t, _ in jobs], use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_each_adapter_does_its_job_alone_and_mixed(demo_llm, words):
    tasks = [None, *DEMO_TASKS]
    alone = {t: _run(demo_llm, [(t, w) for w in words]) for t in tasks}
    for t in tasks:
        exact = sum(out == demo_expected(t, w) for out, w in zip(alone[t], words))
        assert exact / len(words) >= 0.9, f"{t or 'base'}: {exact}/{len(words)}"
    # Interleave every task over every word in ONE batch: same outputs as alone.
    jobs = [(t, w) for w in words for t in tasks]
    mixed = _run(demo_llm, jobs)
    expected = [alone[t][words.index(w)] for t, w in jobs]
    assert mixed == expected
    assert demo_llm.llm_engine.stats()["compilations_after_warmup"] == 0


def test_demo_command_prints_a_row_per_adapter():
    proc = subprocess.run([sys.executable, "-m", "vllm_tpu_lora.entrypoints.cli", "demo",
                           "--words", "hello", "zebra"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in ["base", *DEMO_TASKS]:
        assert any(line.split()[:1] == [name] for line in lines), name
    assert "HELLO" in proc.stdout and "olleh" in proc.stdout
    assert "0 after" in proc.stdout


def test_serve_without_a_model_serves_the_bundled_demo():
    import openai

    from vllm_tpu_lora.testing.server import RemoteServer

    with RemoteServer(["--max-num-seqs", "8", "--max-num-batched-tokens", "16",
                       "--max-model-len", "64"]) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)
        ids = {m.id for m in client.models.list().data}
        assert ids == {"demo", *DEMO_TASKS}
        for model, want in [("demo", "hello"), ("upper", "HELLO"), ("reverse", "olleh")]:
            out = client.completions.create(model=model, prompt=demo_prompt("hello"),
                                            max_tokens=12, temperature=0)
            assert out.choices[0].text == want
