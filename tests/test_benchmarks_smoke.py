"""The peer benchmark runs end to end at a reduced size and its agreement check passes."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_benchmark_vs_peft_small_runs_and_outputs_agree():
    import benchmark_vs_peft

    rows = benchmark_vs_peft.main(["--small"])
    ratios = [r for r in rows if r["name"] == "ratio"]
    assert [r["num_adapters"] for r in ratios] == [1, 3]
    assert all(r["outputs_agree"] for r in ratios), ratios
    engines = [r for r in rows if r["name"] == "vllm_tpu_lora"]
    assert all(r["compilations_after_warmup"] == 0 for r in engines)
    assert all(r["output_tokens_per_s"] > 0 for r in rows if "output_tokens_per_s" in r)
