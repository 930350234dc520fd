"""Tensor parallelism on the jax runtime: NamedShardings over a JAX mesh, graphs captured
once and replayed. One subprocess (tests/tp_jax_worker.py, 4 virtual CPU devices) builds
an engine for tensor_parallel_size 1 (the reference) and for 2 and 4 x
fully_sharded_loras off / on, and runs the adapter workload of tests/tp_worker.py (mixed
adapters through 4 slots for 5 adapters, evictions, an adapter removed and read again).
The model is the session's tiny Llama: 4 heads, 2 kv heads (TP=4 replicates each kv head
on 2 devices), 2 layers; at TP=2 the 4 devices form 2 replicas of a 2-device group."""

import json
import os
import subprocess
import sys

import pytest

from vllm_tpu_lora.testing.factory import sample_prompt_token_ids
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

from .test_tensor_parallel import NUM_LAYERS, VOCAB, make_tp_adapters
from .tp_worker import ENGINE, MAX_TOKENS

CONFIGS = [(2, False), (2, True), (4, False), (4, True)]
IDS = [f"tp{tp}-{'fully_sharded' if fs else 'lora_a_replicated'}" for tp, fs in CONFIGS]
KV_GROUPS = 2  # the tiny Llama's kv heads
WORKER = os.path.join(os.path.dirname(__file__), "tp_jax_worker.py")


@pytest.fixture(scope="module")
def results(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_jax")
    adapters = make_tp_adapters(llama_dir, root)
    args = {"model": llama_dir, "adapters": adapters, "out": str(root / "out.json"),
            "configs": [{"tp": tp, "fully_sharded": fs} for tp, fs in CONFIGS]}
    with open(root / "args.json", "w") as f:
        json.dump(args, f)
    proc = subprocess.run([sys.executable, WORKER, str(root / "args.json")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    with open(args["out"]) as f:
        data = json.load(f)
    out = data["configs"]
    assert "error" not in out[0], out[0]["error"]
    return out[0], out[1:], adapters, data["tpu_export"]


@pytest.fixture(params=range(len(CONFIGS)), ids=IDS)
def run(request, results):
    res = results[1][request.param]
    assert "error" not in res, res["error"]
    return res


def test_greedy_outputs_identical_to_tp1(results, run):
    reference = results[0]["outputs"]
    assert set(reference) == {"base", "mixed", "swap", "after_remove"}
    for phase, ids in reference.items():
        assert run["outputs"][phase] == ids, f"tp={run['tp']} phase {phase}"
        assert run["outputs_async"][phase] == ids, f"tp={run['tp']} async, phase {phase}"
    assert run["async_compilations"] == 0


def test_reference_equals_peft(llama_dir, results):
    """The TP=1 reference every config equals is itself PEFT's greedy output, phase by
    phase (tp_worker.run_workload's prompts and adapters; a removed adapter read again
    serves the same weights)."""
    reference, _, adapters, _ = results
    prompts = sample_prompt_token_ids(8, seed=3, max_len=24)
    names = {i + 1: f"a{i + 1}" for i in range(len(adapters))}
    oracle = load_oracle_model(llama_dir, {names[i + 1]: p for i, p in enumerate(adapters)})
    picks = {"base": [None] * 6, "mixed": [1, 2, 3, None, 1, 2, 3, None],
             "swap": [4, 5, 4, 1, None], "after_remove": [2, 5, 3, 4, None]}
    for phase, ids in picks.items():
        expected = hf_greedy(oracle, prompts[: len(ids)], MAX_TOKENS,
                             adapter_names=[names.get(i) for i in ids])
        assert reference["outputs"][phase] == [e.token_ids for e in expected], phase


def test_replayed_and_nothing_compiles_while_adapters_swap(run):
    stats = run["stats"]
    assert stats["runtime"] == "jax" and stats["tensor_parallel_size"] == run["tp"]
    assert stats["graph_replay"]  # captured once, replayed (torch_xla's TP re-traces)
    assert stats["compilations_after_warmup"] == 0
    assert run["jax_compiles_during_workload"] == 0  # JAX's own compile events
    assert run["graphs_captured_during_workload"] == 0
    assert stats["lora_slot_loads"] > ENGINE["max_loras"]  # evicted and reloaded


def _axes(tp: int, groups: int | None = None):
    """How a dim split `groups` ways (default tp) reads in the mesh [replica, model, rep]."""
    groups = tp if groups is None else groups
    return "model" if groups == KV_GROUPS or tp == KV_GROUPS else ["model", "rep"]


def _full(spec: list, ndim: int) -> list:
    return spec + [None] * (ndim - len(spec))  # PartitionSpec drops trailing Nones


def test_shardings_follow_the_megatron_layout(run):
    tp, fs = run["tp"], run["fully_sharded"]
    sh, ax = run["shardings"], _axes(tp)
    want = {"qkv_proj": [None, ax], "gate_up_proj": [None, ax], "o_proj": [ax, None],
            "down_proj": [ax, None], "embed_tokens": [ax, None], "lm_head": [None, ax]}
    for name, spec in sh["params"].items():
        kind = next((k for k in want if f"{k}." in name), None)
        assert _full(spec, 2) == (want[kind] if kind else [None] * 2), (name, spec)
    assert all(_full(c, 3) == [None, _axes(tp, KV_GROUPS), None] for c in sh["kv"]), sh["kv"]
    column_b = {"qkv_proj": [tp, KV_GROUPS, KV_GROUPS], "gate_up_proj": [tp, tp]}
    for name, bufs in sh["lora"].items():
        kind = name.rsplit(".", 1)[-1]
        if kind in column_b:  # A replicated (rank-sharded when fully sharded), B by output
            for a, b, groups in zip(bufs["a"], bufs["b"], column_b[kind], strict=True):
                assert _full(a, 3) == [None, ax if fs else None, None], (name, a)
                assert _full(b, 3) == [None, _axes(tp, groups), None], (name, b)
        else:  # row parallel: A by input, B replicated (output-sharded when fully sharded)
            assert _full(bufs["a"][0], 3) == [None, None, ax], (name, bufs["a"])
            assert _full(bufs["b"][0], 3) == [None, ax if fs else None, None], (name, bufs["b"])


def test_compiled_step_collectives(run):
    """From the optimized HLO of every graph the engine compiled: a forward graph
    all-reduces once for the vocab-parallel embedding and once per row-parallel layer
    (+ once per row-parallel LoRA shrink); nothing is all-to-all'd or reduce-scattered;
    only fully sharded LoRA gathers (its rank-sharded shrink outputs); the sampler gathers
    the logits [R, vocab], not lm_head's weight."""
    fs, graphs = run["fully_sharded"], run["hlo"]
    forward = [g for g in graphs if g["collectives"]["all-reduce"]]
    base = [g for g in forward if len(g["collectives"]["all-reduce"]) == 1 + 2 * NUM_LAYERS]
    lora = [g for g in forward if len(g["collectives"]["all-reduce"]) == 1 + 4 * NUM_LAYERS]
    assert len(base) == 2 and len(lora) == 6 and len(forward) == 8  # 2 token x 4 slot buckets
    buckets = {8, 16, 32}  # ENGINE's token and request buckets: activations, never weights
    for g in forward:
        c = g["collectives"]
        assert not c["all-to-all"] and not c["reduce-scatter"]
        moved = c["all-gather"] + c["collective-permute"]
        # (at TP=2 with replicas XLA moves some of fully sharded LoRA's gathers as
        # collective-permutes, as it does on torch_xla)
        assert bool(moved) == (fs and g in lora)
        assert all(s[0] in buckets for op in c.values() for found in op for s in found)
    sampler = [g for g in graphs if not g["collectives"]["all-reduce"]
               and g["collectives"]["all-gather"]]
    assert len(sampler) == 2  # greedy and full
    for g in sampler:
        assert [s for found in g["collectives"]["all-gather"] for s in found] == [[8, VOCAB]]


@pytest.mark.parametrize("index,tp", [(0, 2), (1, 4)])
def test_ragged_kernel_inside_shard_map_lowers_for_tpu(results, index, tp):
    """What a slice of TPU chips would compile, short of running it (the lent machine is
    one chip): the engine's head-parallel attention, JAX's ragged paged attention kernel
    inside the mesh's shard_map, exported for the TPU platform over 4 devices. The
    kernel is one Mosaic call inside the manual region, on each device's own heads:
    q [16, 4 / tp heads, 128]; KV pages of one kv head (k and v) per device, the 2 kv
    heads replicated over the `rep` axis at TP=4."""
    res = results[3][index]
    assert "error" not in res, res["error"]
    assert res["tp"] == tp and res["nr_devices"] == 4 and res["platforms"] == ["tpu"]
    assert res["kernels"] == 1 and res["kernel_after_region"]
    q_local, kv_local = res["manual_args"][:2]
    assert q_local == f"tensor<16x{4 // tp}x128xbf16>", res["manual_args"]
    assert kv_local == "tensor<128x2x128xbf16>", res["manual_args"]
