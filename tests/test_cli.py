"""`vllm-tpu-lora generate` runs the same engine as LLM.generate."""

import json
import subprocess
import sys

from vllm_tpu_lora import SamplingParams


def test_cli_generate_matches_offline_api(llama_dir, llama_llm):
    cmd = [sys.executable, "-m", "vllm_tpu_lora.entrypoints.cli", "generate", "--model", llama_dir,
           "--prompt", "The cat", "--prompt", "A small dog", "--max-tokens", "6", "--ignore-eos",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "256",
           "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    expected = llama_llm.generate(["The cat", "A small dog"],
                                  SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in expected]
    assert [r["text"] for r in rows] == [o.outputs[0].text for o in expected]


def test_cli_reports_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vllm_tpu_lora.entrypoints.cli", "generate",
                           "--model", str(tmp_path / "missing"), "--prompt", "x"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Model directory does not exist" in proc.stderr
