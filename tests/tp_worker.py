"""Tensor-parallel checks run in a subprocess with several virtual CPU devices.

The pytest process already initialised XLA with one device and without SPMD, so
tests/test_tensor_parallel.py runs this file as `python tests/tp_worker.py ARGS.json` with
CPU_NUM_DEVICES=4, PJRT_DEVICE=CPU and XLA_FLAGS=--xla_dump_to=DIR in its environment. For
every (tensor_parallel_size, fully_sharded_loras) it builds one engine and records, as
JSON: the workload's greedy token ids, the sharding spec of every weight / KV cache /
LoRA buffer, the device-local blocks of the packed qkv weight, the collectives of each
graph XLA compiled for this engine (from the optimized-HLO dump) and the engine stats.
The assertions are in the test; this file only measures. With `--reference` it runs the
same workload at tensor_parallel_size=1 on one plain device instead (a process of its own:
in the pytest process, after hundreds of other engines, XLA's compile of it crashed).
With `--features` it serves LoRA-bias, DoRA, embedding and lm_head adapters under tensor
parallelism (tests/test_lora_vocab.py compares them with PEFT).
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

MAX_TOKENS = 6
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, enable_lora=True,
              max_loras=4, max_lora_rank=16)


def run_workload(llm, adapter_paths: list[str]) -> dict[str, list[list[int]]]:
    """Base-only, a mixed batch of 3 adapters + base, then adapters 4 and 5 forcing slot
    evictions, a removed adapter coming back, and an adapter reloaded from disk."""
    from vllm_tpu_lora import LoRARequest, SamplingParams
    from vllm_tpu_lora.testing.factory import sample_prompt_token_ids

    reqs = [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(adapter_paths)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in sample_prompt_token_ids(8, seed=3, max_len=24)]
    phases = {
        "base": [None] * 6,
        "mixed": [reqs[0], reqs[1], reqs[2], None, reqs[0], reqs[1], reqs[2], None],
        "swap": [reqs[3], reqs[4], reqs[3], reqs[0], None],
        "after_remove": [reqs[1], reqs[4], reqs[2], reqs[3], None],
    }
    out = {}
    for phase, loras in phases.items():
        if phase == "after_remove":
            llm.llm_engine.remove_lora(2)  # drops its slot and host copy: reloaded from disk
        res = llm.generate(prompts[: len(loras)], params, lora_request=loras, use_tqdm=False)
        out[phase] = [o.outputs[0].token_ids for o in res]
    return out


# ---- optimized HLO of the graphs XLA compiled (XLA_FLAGS=--xla_dump_to) ----

_SHAPE = r"[a-z0-9]+\[[0-9,]*\]"
_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def _dims(shape: str) -> list[int]:
    inner = shape[shape.index("[") + 1: -1]
    return [int(d) for d in inner.split(",")] if inner else []


def analyze_hlo(path: str) -> dict:
    text = open(path).read()
    entry = next(line for line in text.splitlines() if line.startswith("ENTRY"))
    params = [_dims(s) for s in re.findall(r"param[.0-9]*: (" + _SHAPE + ")", entry)]
    found = {}
    for op in _COLLECTIVES:
        # "%x = f32[16,64]{1,0} all-reduce(" or a tuple "(f32[..], f32[..]) all-reduce("
        pat = r"= (\(.*?\)|" + _SHAPE + r")\S* " + re.escape(op) + r"\("
        found[op] = [[_dims(s) for s in re.findall(_SHAPE, m)] for m in re.findall(pat, text)]
    return {"file": os.path.basename(path), "params": params, "dots": len(re.findall(r" dot\(", text)),
            "collectives": found}


def _new_hlo(dump_dir: str, seen: set[str]) -> list[dict]:
    """The graphs compiled since the last call. XLA's CPU backend also dumps LLVM IR and
    objects for every kernel (~50 MB per engine): only the optimized HLO text is kept."""
    for f in os.listdir(dump_dir):
        if not f.endswith("cpu_after_optimizations.txt"):
            os.remove(os.path.join(dump_dir, f))
    files = sorted(f for f in os.listdir(dump_dir) if f.endswith("cpu_after_optimizations.txt"))
    new = [f for f in files if f not in seen]
    seen.update(new)
    return [analyze_hlo(os.path.join(dump_dir, f)) for f in new]


# ---- shardings ----

def _spec(t) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t) or "(none)"


def _local(t) -> list[dict]:
    """Per device: its shard's shape and the slice of the global tensor it holds."""
    import torch_xla

    shards = torch_xla._XLAC._get_local_shards([t])[0]
    where = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    return [{"device": dev, "shape": list(s.shape),
             "index": [[sl.start, sl.stop] for sl in idx] if isinstance(idx, list) else []}
            for (s, dev), (_, idx) in zip(shards, where)]


def shardings(engine) -> dict:
    model, runner = engine.runner.model, engine.runner
    out = {"params": {n: {"spec": _spec(p), "shape": list(p.shape)}
                      for n, p in model.named_parameters()},
           "kv": [{"spec": _spec(c), "local": _local(c)} for c in runner.kv_caches[0]],
           "lora": {}}
    for name, layer in (engine.lora_manager.layers if engine.lora_manager else {}).items():
        out["lora"][name] = {"a": [_spec(a) for a in layer.lora_a],
                             "b": [_spec(b) for b in layer.lora_b],
                             "a_local": [_local(a)[0]["shape"] for a in layer.lora_a],
                             "b_local": [_local(b)[0]["shape"] for b in layer.lora_b]}
    return out


def packed_qkv_blocks(engine, model_dir: str) -> list[dict]:
    """Layer 0 qkv weight_t: each device's shard against [q_i | k_g | v_g] cut from the
    checkpoint's q_proj / k_proj / v_proj (g: the kv head group of device position i)."""
    import torch
    import torch_xla
    from safetensors.torch import load_file

    tp = engine.tp
    layer = engine.runner.model.model.layers[0].self_attn.qkv_proj
    base = getattr(layer, "base_layer", layer)
    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    full = [ckpt[f"model.layers.0.self_attn.{p}_proj.weight"].t() for p in "qkv"]
    shards = torch_xla._XLAC._get_local_shards([base.weight_t])[0]
    out = []
    for d, (shard, dev) in enumerate(shards):
        i = d % tp.size  # position in its tensor-parallel group
        want = torch.cat([w.narrow(1, *s.columns_of(i)) for w, s in zip(full, base.slices)], 1)
        out.append({"device": dev, "position": i, "shape": list(shard.shape),
                    "max_abs_diff": float((shard.cpu() - want).abs().max())})
    return out


def check_engine(cfg: dict, args: dict, seen: set[str]) -> dict:
    from vllm_tpu_lora import LLM

    llm = LLM(args["model"], tensor_parallel_size=cfg["tp"],
              fully_sharded_loras=cfg["fully_sharded"], **ENGINE)
    engine = llm.llm_engine
    res = {"hlo": _new_hlo(args["dump_dir"], seen), "shardings": shardings(engine),
           "qkv_blocks": packed_qkv_blocks(engine, args["model"]),
           "kv_slots": engine.runner.kv_caches[0][0].shape[0],
           "token_buckets": engine.runner.token_ladder,
           "request_buckets": engine.runner.request_ladder}
    res["outputs"] = run_workload(llm, args["adapters"])
    res["hlo_after_warmup"] = _new_hlo(args["dump_dir"], seen)
    res["stats"] = engine.stats()
    return res


def main(args: dict) -> dict:
    os.environ["VLLM_TPU_LORA_CHECK_RECOMPILATION"] = "1"
    from vllm_tpu_lora import LLM, platform  # noqa: F401  (XLA starts here, SPMD later)

    seen: set[str] = set()
    results = {"configs": [], "errors": {}}
    for cfg in args["configs"]:
        try:
            results["configs"].append({**cfg, **check_engine(cfg, args, seen)})
        except Exception:  # reported to the test, which fails with the traceback
            results["configs"].append({**cfg, "error": traceback.format_exc()})
    from vllm_tpu_lora.parallel import TensorParallel

    eight_heads = {"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 64,
                   "intermediate_size": 128}
    try:  # a layout that divides, on more devices than the process has
        TensorParallel.create(8, eight_heads)
    except ValueError as e:
        results["errors"]["too_many_devices"] = str(e)
    return results


def reference(args: dict) -> dict:
    """The tensor_parallel_size=1 reference (a plain single-device process)."""
    os.environ["VLLM_TPU_LORA_CHECK_RECOMPILATION"] = "1"
    from vllm_tpu_lora import LLM

    return run_workload(LLM(args["model"], **ENGINE), args["adapters"])


def features(args: dict) -> dict:
    """`--features`: a mixed batch over adapters with LoRA bias, DoRA, embedding and lm_head
    LoRA at args["tp"]; greedy ids and their logprobs per prompt (the test holds the oracle)."""
    os.environ["VLLM_TPU_LORA_CHECK_RECOMPILATION"] = "1"
    from vllm_tpu_lora import LLM, LoRARequest, SamplingParams

    llm = LLM(args["model"], tensor_parallel_size=args["tp"], **args["engine"])
    reqs = {name: LoRARequest(name, i + 1, path) for i, (name, path) in
            enumerate(args["adapters"].items())}
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params,
                        lora_request=[reqs[n] if n else None for n in args["names"]],
                        use_tqdm=False)
    return {"token_ids": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                          o.outputs[0].token_ids)] for o in outs],
            "compilations_after_warmup": llm.llm_engine.stats()["compilations_after_warmup"]}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        arguments = json.load(f)
    mode = sys.argv[2] if len(sys.argv) > 2 else None
    if mode == "--reference":
        result, out = reference(arguments), arguments["reference_out"]
    elif mode == "--features":
        result, out = features(arguments), arguments["out"]
    else:
        result, out = main(arguments), arguments["out"]
    with open(out, "w") as f:
        json.dump(result, f)
