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


def test_benchmark_lora_many_adapters_small_runs():
    """--many-adapters --breakdown --profile-host at smoke size: every request's adapter is
    read during the run, the rows carry the ratio, cold start and the engine thread's
    extra time by function (the slot writes among it), and nothing compiles after
    warm-up."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "benchmark_lora.py")
    out = subprocess.run([sys.executable, script, "--many-adapters", "--small", "--rounds", "1",
                          "--breakdown", "--profile-host"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    rows = {r["name"]: r for r in map(json.loads, out.splitlines())}
    many = rows["many_adapters:24_distinct_adapters"]
    # --breakdown: the pre-read half writes slots but reads nothing during its run.
    cached = rows["many_adapters:breakdown:24_adapters_host_cached"]
    assert cached["adapter_reads"] == 0 and cached["slot_writes"] >= 24
    # As many adapters as slots (--small: max_loras = max_num_seqs = 8): no swaps.
    assert rows["many_adapters:breakdown:8_adapters_no_swaps"]["slot_writes"] <= 8
    assert many["adapter_reads"] == 24 and many["slot_writes"] >= 24
    assert rows["many_adapters:8_adapters"]["adapter_reads"] <= 8
    assert many["relative_to_8_adapters"] > 0
    assert rows["adapter_cold_start"]["ttft_ms_median"] > 0
    assert rows["compilations_after_warmup"]["count"] == 0
    extra = rows["many_adapters:host_profile"]["extra_ms_per_adapter"]
    assert any("write_slots" in fn for fn in extra) and all(ms > 0 for ms in extra.values())
    assert rows["many_adapters:host_profile"]["extra_own_ms_per_adapter"]


def _run_without_torch(script_name: str, *argv: str) -> list[dict]:
    """The JSON rows of benchmarks/<script_name> run in a subprocess where `import torch`
    raises: these scripts are what runs on a JAX-only TPU host (no torch there)."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", script_name)
    code = ("import runpy, sys; sys.modules['torch'] = None; "  # `import torch` now raises
            f"sys.path.insert(0, {os.path.dirname(script)!r}); "
            f"sys.argv = {[script, *argv]!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_tpu_kernel_script_runs_without_torch():
    """benchmarks/tpu_kernels.py with torch unimportable: its interpreter smoke run checks
    float32 ("highest"), bfloat16 and float16 kernels against numpy, its bench rows carry
    every strategy and its blocks row every token block."""
    rows = _run_without_torch("tpu_kernels.py", "--interpret", "--quick", "--parts",
                              "check,bench,blocks", "--k", "2", "--reps", "1")
    checks = [r for r in rows if r["part"] == "check"]
    assert [r["dtype"] for r in checks] == ["float32", "bfloat16", "float16"]
    assert all(r["ok"] for r in checks), checks
    assert checks[2]["compute_dtype"] == "float32"  # float16 runs the kernels in float32
    (bench,) = [r for r in rows if r["part"] == "bench"]
    for name in ("base_matmul", "pallas", "ragged_dot", "onehot", "gathered"):
        assert bench[f"{name}_ms"] > 0, bench
    (blocks,) = [r for r in rows if r["part"] == "blocks"]  # bf16: its block 16, then 2-8x
    assert [blocks[f"B{b}_ms"] > 0 for b in (16, 32, 64, 128)] == [True] * 4, blocks


def test_tpu_lora_layer_script_runs_without_torch():
    """benchmarks/tpu_lora_layer.py with torch unimportable: its interpreter smoke run
    checks every composition of a packed and a plain LoRA linear against float64 numpy in
    float32 and bfloat16, and its layer rows (two slots, then one of them in use) carry
    each composition's delta and ratio."""
    rows = _run_without_torch("tpu_lora_layer.py", "--interpret", "--quick", "--k", "2",
                              "--reps", "1")
    checks = [r for r in rows if r["part"] == "layer_check"]
    assert {(r["linear"], r["dtype"]) for r in checks} == {
        (lin, dt) for lin in ("qkv_proj", "down_proj") for dt in ("float32", "bfloat16")}
    assert all(r["ok"] for r in checks), checks
    layers = {r["active"]: r for r in rows if r["part"] == "layer"}
    assert sorted(layers) == [1, 2], layers  # a step using both slots, then one of them
    # The fused grouped and indexed kernels too, and the TPU's one-hot over every slot as
    # they lie.
    assert all(f"{k}_rel_err" in r for r in checks for k in ("grouped", "indexed", "stacked"))
    for active, layer in layers.items():
        paths = ["per_slice", "onehot", "stacked", "grouped", "indexed"] + (["single"] if active == 1
                                                                 else [])
        assert all(layer[f"layer_{what}_ms"] > 0 for what in ["base", "roofline", *paths]), layer
        assert all(0 < layer[f"ratio_{what}"] < 1 for what in paths), layer
        assert all(layer[f"{what}_vs_roofline"] > 0 for what in paths), layer


def test_replay_buckets_small_replays_slots_and_fallback_graphs():
    """The per-bucket replay runs on the engine's own captured graphs: the 64-token bucket
    over both slots has a slots graph and a fallback graph, and replaying them compiles
    nothing."""
    import replay_buckets

    rows = {r["T"]: r for r in replay_buckets.main(["--small"])}
    assert rows[16]["strategy"] != "slots" and "fallback_ms" not in rows[16]
    assert rows[64]["strategy"] == "slots" and rows[64]["fallback_strategy"] == "split"
    assert all(r["lora_ms"] > 0 and r["compilations_after_warmup"] == 0 for r in rows.values())


def test_benchmark_kv_window_small_runs_each_engine_on_its_windows():
    """Short requests on a 512-token engine: the window ladder runs them on its 256-token
    graphs, the one-window engine on its 512-token ones, with the same greedy outputs."""
    import benchmark_kv_window

    rows = benchmark_kv_window.main(["--small"])
    by_name = {r["name"]: r for r in rows}
    assert by_name["ratio"]["greedy_outputs_identical"] == "8/8"
    for name, window in (("one_window", "W512"), ("window_buckets", "W256")):
        row = by_name[name]
        assert {k.split("/")[2] for k in row["forward_graph_steps"]} == {window}, row
        assert row["compilations_after_warmup"] == 0


def test_step_host_cost_small_counts_the_transfers():
    """The step's arrays: one transfer each before, packed one per graph (the forward
    graph's int64, int32 and bool arrays in one int64 buffer, the greedy sampler's blocked
    ids in another)."""
    import step_host_cost

    rows = step_host_cost.main(["--layers", "2", "--calls", "5"])
    moves = rows[0]
    assert moves["per_array_transfers"] == 16 and moves["packed_transfers"] == 2, moves
    call = rows[1]
    assert call["layers"] == 2 and call["graph_inputs"] == 33
    assert min(moves["per_array_us"], moves["packed_us"], call["walked_us"],
               call["fixed_tensors_us"]) > 0


def test_step_phases_small_accounts_for_the_step():
    """The phases add up to (nearly) the whole step, and only steps with adapters spend
    time planning LoRA or activating slots."""
    import step_phases

    rows = {r["name"]: r for r in step_phases.main(["--small"])}
    assert set(rows) == {"enable_lora=False", "lora_enabled_unused", "2_distinct_adapters"}
    for row in rows.values():
        phases = row["phases_ms"]
        assert set(phases) == set(step_phases.PHASES)
        # generate()'s own work outside the engine's steps is all that is not covered
        assert 0.7 * row["ms_per_step"] < row["phases_sum_ms"] <= 1.01 * row["ms_per_step"]
        assert phases["upload"] > 0 and phases["forward_call"] > 0 and phases["prepare"] > 0
    assert rows["enable_lora=False"]["phases_ms"]["lora_plan"] == 0
    assert rows["2_distinct_adapters"]["phases_ms"]["lora_plan"] > 0
    assert (rows["2_distinct_adapters"]["phases_ms"]["activate"]
            > rows["lora_enabled_unused"]["phases_ms"]["activate"])


def test_host_costs_probe_small_runs():
    """The host-cost probe (run first on a TPU VM) reads real adapter copies serially and
    in threads and times both transfer forms of a write batch."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "host_costs.py")
    out = subprocess.run([sys.executable, script, "--adapters", "6", "--threads", "2",
                          "--batches", "1", "3", "--reps", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["op"] for r in rows if r["row"] == "syscall"} == {"stat", "open+close"}
    reads = [r for r in rows if r["row"] == "header_reads"]
    assert [r["threads"] for r in reads] == [1, 2] and all(r["adapters"] == 6 for r in reads)
    puts = [r for r in rows if r["row"] == "device_put"]
    assert [r["images"] for r in puts] == [1, 3]
    assert all(r["list_ms"] > 0 and r["stacked_ms"] > 0 for r in puts)


def test_benchmark_jax_runtime_forced_strategy_small_runs():
    """benchmark_jax_runtime.py --small with --force-strategy: every LoRA graph the engine
    ran is the forced one (the table would pick "single" for one adapter and "slots" for
    64-token steps here), and each anchor form reads as many adapters as the batch uses."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks",
                          "benchmark_jax_runtime.py")
    out = subprocess.run([sys.executable, script, "--small", "--runtimes", "jax",
                          "--force-strategy", "onehot", "--anchor-lora-forms", "stacked", "dma"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    engine = next(r for r in rows if r["row"] == "engine")
    assert engine["force_strategy"] == "onehot" and engine["lora_backend"] == "xla"
    lora_run = next(r for r in rows if r["row"] == "engine_run" and r["adapters"] == 2)
    labels = [g for mode in ("serving_sync", "serving_async") for g in lora_run[mode]["by_graph"]]
    assert labels and all(g.endswith("/onehot") for g in labels), labels
    assert any("/S1/" in g for g in labels)  # one adapter's steps too
    anchors = [r for r in rows if r["row"] == "anchor_lora"]
    assert [(r["form"], r["active"]) for r in anchors] == [("stacked", 2), ("dma", 2)]


def test_warmup_writes_probe_small_runs():
    """The warm-up probe times an engine's start-up and a write per batch size."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "warmup_writes.py")
    out = subprocess.run([sys.executable, script, "--max-loras", "2", "--writes", "1", "2",
                          "--hidden", "64", "--intermediate", "128", "--reps", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    warm = [r for r in rows if r["row"] == "warmup"]
    assert len(warm) == 1 and warm[0]["graphs"] > 0 and warm[0]["seconds"] > 0
    writes = [r for r in rows if r["row"] == "slot_write"]
    assert [r["adapters"] for r in writes] == [1, 2] and all(r["ms"] > 0 for r in writes)
