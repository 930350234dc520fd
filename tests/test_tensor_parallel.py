"""Tensor parallelism (XLA SPMD) on 4 virtual CPU devices: outputs, shardings, HLO, compiles.

One subprocess (tests/tp_worker.py, CPU_NUM_DEVICES=4) builds an engine for each of
tensor_parallel_size 2 and 4 x fully_sharded_loras off / on and measures everything;
meanwhile a second subprocess computes the tensor_parallel_size=1 reference. The model is the
session's tiny Llama: 4 heads, 2 kv heads (TP=4 replicates each kv head on 2 devices),
intermediate 128, 2 layers. At TP=2 the 4 devices form 2 replicas of a 2-device group.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from vllm_tpu_lora import LLM
from vllm_tpu_lora.parallel.layout import attention_slices, check_lora_layout, mlp_slices
from vllm_tpu_lora.testing.factory import make_peft_adapter

from .tp_worker import ENGINE

CONFIGS = [(2, False), (2, True), (4, False), (4, True)]
IDS = [f"tp{tp}-{'fully_sharded' if fs else 'lora_a_replicated'}" for tp, fs in CONFIGS]
NUM_DEVICES = 4
# The session's tiny Llama (conftest.llama_dir).
NUM_LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 2, 64, 4, 2, 16, 128, 512
ADAPTERS = [dict(r=8, seed=1), dict(r=4, target_modules=["q_proj", "v_proj"], seed=2),
            dict(r=16, use_rslora=True, seed=3), dict(r=8, seed=4, init_std=0.05),
            dict(r=16, rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}, seed=5)]
WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")


def make_tp_adapters(llama_dir, root) -> list[str]:
    """The TP workloads' five adapters (tp_worker.run_workload names them a1..a5)."""
    return [make_peft_adapter(llama_dir, str(root / f"a{i}"), **kw)
            for i, kw in enumerate(ADAPTERS)]


@pytest.fixture(scope="module")
def tp_run(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    adapters = make_tp_adapters(llama_dir, root)
    args = {"model": llama_dir, "adapters": adapters, "dump_dir": str(root / "hlo"),
            "out": str(root / "out.json"), "reference_out": str(root / "reference.json"),
            "configs": [{"tp": tp, "fully_sharded": fs} for tp, fs in CONFIGS]}
    os.makedirs(args["dump_dir"])
    with open(root / "args.json", "w") as f:
        json.dump(args, f)
    env = dict(os.environ, CPU_NUM_DEVICES=str(NUM_DEVICES), PJRT_DEVICE="CPU",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args['dump_dir']}")
    proc = subprocess.Popen([sys.executable, WORKER, str(root / "args.json")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The reference (TP=1, one plain device) runs meanwhile in a process of its own.
    ref_env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}
    ref = subprocess.run([sys.executable, WORKER, str(root / "args.json"), "--reference"],
                         env=dict(ref_env, PJRT_DEVICE="CPU"), capture_output=True, text=True,
                         timeout=900)
    log, _ = proc.communicate(timeout=900)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-6000:]
    assert proc.returncode == 0, log[-6000:]
    with open(args["reference_out"]) as f:
        reference = json.load(f)
    with open(args["out"]) as f:
        results = json.load(f)
    return reference, results


@pytest.fixture(params=range(len(CONFIGS)), ids=IDS)
def run(request, tp_run):
    res = tp_run[1]["configs"][request.param]
    assert "error" not in res, res["error"]
    return res


def _tiles(spec: str) -> list[int] | None:
    """Tile counts per tensor dim of an XLA sharding spec; None when replicated."""
    if spec == "{replicated}":
        return None
    dims = [int(d) for d in re.search(r"devices=\[([\d,]+)\]", spec).group(1).split(",")]
    return dims[:-1] if "last_tile_dim_replicate" in spec else dims


def test_greedy_outputs_identical_to_tp1(tp_run, run):
    reference = tp_run[0]
    for phase, ids in reference.items():
        assert run["outputs"][phase] == ids, f"tp={run['tp']} phase {phase}"


def test_weight_shardings(run):
    tp = run["tp"]
    expected = {"qkv_proj": [1, tp], "gate_up_proj": [1, tp], "o_proj": [tp, 1],
                "down_proj": [tp, 1], "embed_tokens": [tp, 1], "lm_head": [1, tp]}
    params = run["shardings"]["params"]
    for name, p in params.items():
        kind = next((k for k in expected if f"{k}." in name), None)
        want = expected[kind] if kind else None  # norms: replicated
        assert _tiles(p["spec"]) == want, f"{name}: {p['spec']}"
    assert sum(any(f"{k}." in n for k in expected) for n in params) == 4 * NUM_LAYERS + 2


def test_kv_cache_sharded_on_kv_heads(run):
    """KV_HEADS=2: split 2 ways, and at TP=4 each head replicated on 2 consecutive devices."""
    tp, groups = run["tp"], min(KV_HEADS, run["tp"])
    for cache in run["shardings"]["kv"]:
        assert _tiles(cache["spec"]) == [1, groups, 1], cache["spec"]
        for d, shard in enumerate(cache["local"]):
            head = (d % tp) * groups // tp
            assert shard["index"][1] == [head, head + 1], (d, shard)


def test_lora_buffer_shardings(run):
    """vLLM's layout: column-parallel lora_a replicated (rank-sharded when fully sharded),
    lora_b sharded like its output slice; row-parallel lora_a sharded on the input, lora_b
    replicated (output-sharded when fully sharded)."""
    tp, fs = run["tp"], run["fully_sharded"]
    kv = min(KV_HEADS, tp)
    column_b = {"qkv_proj": [tp, kv, kv], "gate_up_proj": [tp, tp]}
    for name, bufs in run["shardings"]["lora"].items():
        kind = name.rsplit(".", 1)[-1]
        if kind in column_b:
            for a, b, groups in zip(bufs["a"], bufs["b"], column_b[kind], strict=True):
                assert _tiles(a) == ([1, tp, 1] if fs else None), (name, a)
                assert _tiles(b) == [1, groups, 1], (name, b)
        else:
            assert _tiles(bufs["a"][0]) == [1, 1, tp], (name, bufs["a"])
            assert _tiles(bufs["b"][0]) == ([1, tp, 1] if fs else None), (name, bufs["b"])


def test_packed_qkv_gives_each_device_its_heads(run):
    """After the column reorder, device i's shard of the packed weight is exactly
    [q heads of i | its kv head's k | v] cut from the checkpoint."""
    blocks = run["qkv_blocks"]
    tp = run["tp"]
    q_local, kv_local = HEADS // tp * HEAD_DIM, max(1, KV_HEADS // tp) * HEAD_DIM
    assert all(b["shape"] == [HIDDEN, q_local + 2 * kv_local] for b in blocks), blocks
    assert all(b["max_abs_diff"] == 0.0 for b in blocks), blocks


def _collective_shapes(graph):
    return [(op, shape) for op, found in graph["collectives"].items()
            for out in found for shape in out]


def _is_lora_graph(graph) -> bool:
    return any(len(p) == 3 and p[0] == ENGINE["max_loras"] for p in graph["params"])


def _forward_graphs(run) -> list[dict]:
    """The model-step programs: those taking the device-local KV cache shard."""
    kv_local = [run["kv_slots"], max(1, KV_HEADS // run["tp"]), HEAD_DIM]
    return [g for g in run["hlo"] if kv_local in g["params"]]


def test_compiled_step_collectives(run):
    """Forward graphs: one all-reduce per row-parallel layer and for the vocab-parallel
    embedding (+ one per row-parallel LoRA shrink); no weight is ever gathered: every
    collective moves activations, whose first dim is a token or request bucket. Graphs an
    earlier engine of the same size compiled are cache hits and not dumped again."""
    fs, tp = run["fully_sharded"], run["tp"]
    graphs, forward = run["hlo"], _forward_graphs(run)
    sampler = [g for g in graphs if [HIDDEN, VOCAB // tp] in g["params"]]
    assert len([g for g in forward if _is_lora_graph(g)]) == 6  # 2 token x 3 slot buckets
    buckets = set(run["token_buckets"]) | set(run["request_buckets"])
    for g in graphs:
        for op, shape in _collective_shapes(g):
            assert shape and shape[0] in buckets, (g["file"], op, shape)
    for g in forward:
        lora, c = _is_lora_graph(g), g["collectives"]
        assert len(c["all-reduce"]) == 1 + (4 if lora else 2) * NUM_LAYERS, g["file"]
        assert not c["all-to-all"] and not c["reduce-scatter"], g["file"]
        if lora and fs:  # gathers of the rank-sharded shrink output / output-sharded delta
            # (at TP=2 with replicas XLA moves some as collective-permutes: still activations)
            assert c["all-gather"], g["file"]
        else:
            assert not c["all-gather"] and not c["collective-permute"], g["file"]
    for g in sampler:  # the logits are gathered, not lm_head's weight
        assert [shape for _, shape in _collective_shapes(g)] == [[8, VOCAB]], g["file"]


def test_weights_enter_the_step_as_local_shards(run):
    """Each device's program takes its shard of every weight: embedding, packed qkv (in
    per-device blocks, kv replicated at TP=4), o, gate_up, down."""
    tp = run["tp"]
    step = next(g for g in _forward_graphs(run) if _is_lora_graph(g))
    qkv_local = (HEADS // tp + 2 * max(1, KV_HEADS // tp)) * HEAD_DIM
    for shape in ([VOCAB // tp, HIDDEN], [HIDDEN, qkv_local], [HEADS * HEAD_DIM // tp, HIDDEN],
                  [HIDDEN, 2 * INTER // tp], [INTER // tp, HIDDEN]):
        assert shape in step["params"], (shape, step["params"])


def test_no_compilation_after_warmup_while_adapters_swap(run):
    stats = run["stats"]
    assert stats["tensor_parallel_size"] == run["tp"]
    assert stats["compilations_after_warmup"] == 0
    assert stats["lora_slot_loads"] > ENGINE["max_loras"]  # adapters were evicted and reloaded
    assert run["hlo_after_warmup"] == []  # and XLA dumped no new program


def test_too_many_devices_names_the_numbers(tp_run):
    msg = tp_run[1]["errors"]["too_many_devices"]
    assert "tensor_parallel_size (8)" in msg and "devices (4)" in msg


# ---- layout errors: pure checks, raised before XLA is touched (safe in this process) ----


def test_heads_not_divisible(llama_dir):
    with pytest.raises(ValueError, match=r"attention heads \(4\) must be divisible by "
                                         r"tensor parallel size \(3\)"):
        LLM(llama_dir, tensor_parallel_size=3)


@pytest.mark.parametrize("cfg,tp,match", [
    (dict(num_attention_heads=8, num_key_value_heads=6), 4,
     r"key-value heads \(6\) must be divisible by tensor parallel size \(4\)"),
    (dict(num_attention_heads=12, num_key_value_heads=4), 6,
     r"Tensor parallel size \(6\) must be divisible by the total number of key-value heads \(4\)"),
])
def test_kv_heads_layout_errors(cfg, tp, match):
    with pytest.raises(ValueError, match=match):
        attention_slices({"hidden_size": 96, **cfg}, tp)


def test_intermediate_not_divisible():
    with pytest.raises(ValueError, match=r"intermediate_size \(130\) must be divisible by "
                                         r"tensor parallel size \(4\)"):
        mlp_slices({"intermediate_size": 130}, 4)


def test_lora_layout_errors(llama_dir):
    with pytest.raises(ValueError, match=r"max_lora_rank \(8\) must be divisible by tensor "
                                         r"parallel size \(16\)"):
        check_lora_layout(16, 8, True, "xla")
    with pytest.raises(ValueError, match="lora_backend='pallas' does not support"):
        LLM(llama_dir, tensor_parallel_size=2, enable_lora=True, lora_backend="pallas")


def test_cli_has_tensor_parallel_size_flag():
    from vllm_tpu_lora.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p",
                                      "--tensor-parallel-size", "2", "--fully-sharded-loras"])
    assert args.tensor_parallel_size == 2 and args.fully_sharded_loras


def test_onehot_shrink_keep_rank_axis_is_the_same_op():
    """The einsum form used for rank-sharded lora_a equals the default merged matmul."""
    import torch

    from vllm_tpu_lora.ops.bgmv_xla import onehot_shrink
    from vllm_tpu_lora.ops.testing import make_case

    case = make_case(33, 64, 48, 16, 4, torch.float32, "skewed", seed=5)
    args = (case.x, case.lora_a, case.idx, case.scale)
    torch.testing.assert_close(onehot_shrink(*args, keep_rank_axis=True), onehot_shrink(*args),
                               atol=1e-5, rtol=1e-5)
