"""Tensor parallelism on the jax runtime, measured in a process of its own with 4 virtual
CPU devices (the pytest process started JAX with one): `python tests/tp_jax_worker.py
ARGS.json`. For tensor_parallel_size 1 (the reference) and every (tp, fully_sharded_loras)
config it builds one engine with runtime="jax", runs tp_worker's adapter workload and
records, as JSON: greedy ids, every weight's / KV cache's / LoRA buffer's sharding, the
collectives in the optimized HLO of each graph the engine compiled, JAX's compile events
during the workload and the engine's stats. The assertions are in
tests/test_tensor_parallel_jax.py; this file only measures."""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

sys.path.insert(0, os.path.dirname(__file__))
from tp_worker import _COLLECTIVES, _SHAPE, ENGINE, _dims, run_workload  # noqa: E402

NUM_DEVICES = 4


def analyze(text: str) -> dict:
    """Per-device parameter shapes of the ENTRY computation and its collectives."""
    entry = text[text.index("\nENTRY"):]
    params = [_dims(s) for s in re.findall(r"= (" + _SHAPE + r")\S* parameter\(", entry)]
    found = {}
    for op in _COLLECTIVES:
        pat = r"= (\(.*?\)|" + _SHAPE + r")\S* " + re.escape(op) + r"\("
        found[op] = [[_dims(s) for s in re.findall(_SHAPE, m)] for m in re.findall(pat, text)]
    return {"params": params, "collectives": found}


def _spec(t) -> list:
    sharding = t._elem.sharding
    spec = getattr(sharding, "spec", None)
    return [list(a) if isinstance(a, tuple) else a for a in spec] if spec is not None else []


def shardings(engine) -> dict:
    out = {"params": {n: _spec(p) for n, p in engine.runner.model.named_parameters()},
           "kv": [_spec(c) for c in engine.runner.kv_caches[0]], "lora": {}}
    for name, layer in engine.lora_manager.layers.items():
        out["lora"][name] = {"a": [_spec(a) for a in layer.lora_a],
                             "b": [_spec(b) for b in layer.lora_b]}
    return out


def check_engine(model: str, adapters: list[str], tp: int, fully_sharded: bool) -> dict:
    from vllm_tpu_lora import LLM
    from vllm_tpu_lora.runner.jax_runtime import jax_compile_count

    llm = LLM(model, runtime="jax", tensor_parallel_size=tp, fully_sharded_loras=fully_sharded,
              **ENGINE)
    engine = llm.llm_engine
    capture = engine.runner.capture
    res = {"tp": tp, "fully_sharded": fully_sharded, "shardings": shardings(engine),
           "hlo": [analyze(e.as_text()) for e in capture.executables],
           "mesh": dict(engine.tp.tpm.mesh.shape) if engine.tp else {}}
    before, graphs_before = jax_compile_count(), len(capture.executables)
    res["outputs"] = run_workload(llm, adapters)
    res["jax_compiles_during_workload"] = jax_compile_count() - before
    res["graphs_captured_during_workload"] = len(capture.executables) - graphs_before
    res["stats"] = engine.stats()
    engine.async_scheduling = True  # the same workload, step N+1 launched before N is read
    res["outputs_async"] = run_workload(llm, adapters)
    res["async_compilations"] = engine.stats()["compilations_after_warmup"]
    return res


def tpu_attention_export(tp: int, kv_groups: int = 2) -> dict:
    """The head-parallel attention as the engine wraps it on a TPU (JAX's ragged paged
    attention kernel inside the mesh's shard_map), exported for the TPU platform over
    this process's 4 devices: what of the lowering a multi-chip run would compile. The
    kernel picks its block sizes from a table keyed by the TPU generation it runs on;
    with none here they are fixed (4 pages, 16 queries per block)."""
    import dataclasses

    import jax
    import jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel as rpa
    import jax.numpy as jnp
    from jax import export
    from torchax import interop

    from vllm_tpu_lora.layers.attention import AttentionMetadata, paged_attention_tpu
    from vllm_tpu_lora.parallel.attention import HeadParallelAttention
    from vllm_tpu_lora.parallel.mesh import JaxTPMesh
    from vllm_tpu_lora.torchax_compat import import_torchax

    torchax = import_torchax()
    rpa.get_tuned_block_sizes = lambda *a, **k: (4, 16)
    heads, head_dim, block, pages, t, seqs, per_seq = 4, 128, 16, 8, 16, 4, 4
    tpm = JaxTPMesh(tp, NUM_DEVICES, kv_groups)
    attn = HeadParallelAttention(paged_attention_tpu, tpm, kv_groups)
    names = [f.name for f in dataclasses.fields(AttentionMetadata)]
    meta = {"slot_mapping": (t,), "q_block_token_idx": (1, t), "q_block_tables": (1, per_seq),
            "q_block_kv_lens": (1, t), "token_out_index": (t,), "seq_kv_lens": (seqs,),
            "seq_block_tables": (seqs, per_seq), "cu_q_lens": (seqs + 1,), "num_seqs": (1,)}

    def step(q, kv, *fields):
        return attn(q, (kv,), AttentionMetadata(**dict(zip(names, fields))), block, 0.125)

    specs = [jax.ShapeDtypeStruct((t, heads, head_dim), jnp.bfloat16, sharding=tpm.sharding(3, 1)),
             jax.ShapeDtypeStruct((pages * block, 2 * kv_groups, head_dim), jnp.bfloat16,
                                  sharding=tpm.sharding(3, 1, kv_groups))]
    specs += [jax.ShapeDtypeStruct(meta[n], jnp.int32, sharding=tpm.sharding(len(meta[n]), None))
              for n in names]
    with torchax.default_env():
        text = export.export(jax.jit(interop.jax_view(step)), platforms=["tpu"])(*specs)
    module = text.mlir_module()
    region = re.search(r"sdy\.manual_computation\(.*?\) \{", module)
    return {"tp": tp, "nr_devices": text.nr_devices, "platforms": list(text.platforms),
            "kernels": module.count("tpu_custom_call("),
            "manual_args": re.findall(r"tensor<[^>]*>", region.group(0)) if region else None,
            "kernel_after_region": bool(region) and module.index("tpu_custom_call(")
            > region.start()}


def main(args: dict) -> dict:
    os.environ["VLLM_TPU_LORA_CHECK_RECOMPILATION"] = "1"
    import jax

    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
    results = {"configs": []}
    for cfg in [{"tp": 1, "fully_sharded": False}, *args["configs"]]:
        try:
            results["configs"].append(check_engine(args["model"], args["adapters"], **cfg))
        except Exception:  # reported to the test, which fails with the traceback
            results["configs"].append({**cfg, "error": traceback.format_exc()})
    results["tpu_export"] = []
    for tp in (2, 4):
        try:
            results["tpu_export"].append(tpu_attention_export(tp))
        except Exception:
            results["tpu_export"].append({"tp": tp, "error": traceback.format_exc()})
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        arguments = json.load(f)
    result = main(arguments)
    with open(arguments["out"], "w") as f:
        json.dump(result, f)
