"""Where a decode step's device time goes, op by op: a device profile (jax.profiler) of
the engine's full-batch decode steps at the Llama-3.2-1B shape of benchmark_jax_runtime,
with and without LoRA, and of the plain-jax anchor's step (jax_anchor) the same ways.

Per traced graph, a `module` row: its executions, device ms per execution, and that time
split into the ops traced under the "lora" scope (punica's `platform.trace_scope`, the
anchor's `jax.named_scope`) and the rest, by op kind (fusion, convolution, copy, ...), with
its costliest ops. The Perfetto traces and the profiled graphs' optimized HLO stay under
--out-dir. The engine compiles lazily here (precompile=False): only the graphs it runs.

    python benchmarks/profile_step.py --out-dir $OUT/profile          # TPU
    python benchmarks/profile_step.py --small --out-dir /tmp/profile  # CPU smoke run
(a CPU trace holds no per-op device events: its rows say so.)
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_jax_runtime import (  # noqa: E402
    FORCEABLE,
    LLAMA_1B,
    LORA_FORMS,
    SLOT_COPIES,
    anchor_contexts,
    emit,
    force_strategy,
    make_model,
)
from benchmark_throughput import add_model_args, apply_small, make_workload  # noqa: E402
from many_adapters import make_many_adapters  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.set_defaults(**{**LLAMA_1B, "output_len": [48, 48]})
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--max-loras", type=int, nargs="+", default=[8],
                   help="one engine per value, each profiled without and with LoRA")
    p.add_argument("--steps", type=int, default=5, help="decode steps per traced window")
    p.add_argument("--lora-backend", default="auto")
    p.add_argument("--force-strategy", nargs="+", default=["table"],
                   choices=["table", *FORCEABLE],
                   help="every LoRA graph runs this xla strategy (\"table\": the table's "
                        "pick); several: one window each on the same engine. A graph is "
                        "keyed by its step arrays, so strategies that share them (stacked, "
                        "gathered, grouped_kernel; or one the table picks) are refused "
                        "together: profile those on engines of their own")
    p.add_argument("--slot-copies", nargs="+", default=[None], choices=[None, *SLOT_COPIES],
                   help="one engine per value (ops.take_slots' copy; default the engine's)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--model-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--anchor-lora-forms", nargs="*", default=["stacked", "gathered"],
                   choices=LORA_FORMS)
    p.add_argument("--out-dir", required=True)
    args = apply_small(p.parse_args())
    if args.small:
        args.adapters, args.rank, args.max_loras, args.steps = 2, 8, [2], 2
    return args


# ---- the trace ----

def perfetto_events(log_dir: str) -> list[dict]:
    path = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"),
                            recursive=True))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _base_name(name: str) -> str:
    return re.sub(r"\(.*\)$", "", name).strip().lstrip("%")


def device_ops(events: list[dict]) -> tuple[dict, dict]:
    """({module: [(start, end)]}, {module: [(op name, dur us, args)]}) from the device's
    "XLA Modules" and "XLA Ops" lines; each op assigned to the module execution that
    contains its start."""
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in procs.items() if "TPU" in name or "/device:" in name}
    spans, ops = [], []
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in device:
            continue
        line = threads.get((e["pid"], e["tid"]), "")
        if line == "XLA Modules":
            spans.append((e["ts"], e["ts"] + e["dur"], _base_name(e["name"])))
        elif line == "XLA Ops":
            ops.append(e)
    spans.sort()
    starts = [s[0] for s in spans]
    runs, by_module = collections.defaultdict(list), collections.defaultdict(list)
    for start, end, name in spans:
        runs[name].append((start, end))
    for e in ops:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= spans[i][1]:
            by_module[spans[i][2]].append((_base_name(e["name"]), e["dur"], e.get("args", {})))
    return runs, by_module


# ---- the optimized HLO: which ops the "lora" scope traced ----

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_scopes(text: str) -> tuple[str, dict[str, bool]]:
    """(module name, {instruction: traced under "lora"}); a fusion counts as lora when any
    op it fuses does."""
    module = re.search(r"HloModule\s+([\w.\-]+)", text).group(1)
    comp_lora, instr_lora, instr_calls, comp = {}, {}, {}, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            comp = m.group(1)
            comp_lora.setdefault(comp, False)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        names = _OP_NAME.findall(line)
        lora = any("/lora/" in n or n.endswith("/lora") for n in names)
        instr_lora[m.group(1)] = lora
        if comp is not None and lora:
            comp_lora[comp] = True
        calls = _CALLS.search(line)
        if calls:
            instr_calls[m.group(1)] = calls.group(1)
    for name, called in instr_calls.items():
        instr_lora[name] = instr_lora[name] or comp_lora.get(called, False)
    return module, instr_lora


# An async copy of a whole entry parameter into VMEM (memory space S(1)): XLA's
# memory-space assignment prefetching an operand. For a LoRA slot buffer that is all
# max_loras slots, whatever the step reads (docs/benchmarks.md, tenth session).
_VMEM_COPY = re.compile(r"= \((\w+)\[([\d,]*)\]\{[^}]*S\(1\)\}.*\) copy-start\(%([\w.\-]+)\)")
_ENTRY_PARAMS = re.compile(r"([\w.\-]+): \w+\[")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def parameter_prefetches(text: str) -> dict[str, dict]:
    """{parameter family (e.g. "arg_arrays", "weight_arrays"): {"count", "mb"}}: the entry
    computation's parameters the optimized HLO copies whole into VMEM, per step (copies
    of intermediates are not counted)."""
    entry = next((line for line in text.splitlines() if line.startswith("ENTRY")), "")
    params = set(_ENTRY_PARAMS.findall(entry.split(")")[0]))
    out: dict[str, dict] = {}
    for dtype, dims, source in _VMEM_COPY.findall(text):
        if source not in params:
            continue
        size = _BYTES[dtype]
        for d in filter(None, dims.split(",")):
            size *= int(d)
        family = re.sub(r"(_\d+)?_?(\.\d+)?$", "", source)
        row = out.setdefault(family, {"count": 0, "mb": 0.0})
        row["count"] += 1
        row["mb"] = round(row["mb"] + size / 1e6, 3)
    return out


def _kind(op: str) -> str:
    return re.sub(r"[.\d]+$", "", op.split(".")[0]) or op


def module_rows(label: str, runs: dict, by_module: dict,
                hlo: dict[str, dict[str, bool]]) -> list[dict]:
    """Per module of a trace (device_ops' two maps) its row; hlo: hlo_scopes per module."""
    if not runs:
        return [{"row": "module", "label": label, "device_events": 0,
                 "why": "no device op events in this platform's trace"}]
    rows = []
    for module, spans in sorted(runs.items(), key=lambda kv: -sum(e - s for s, e in kv[1])):
        n = len(spans)
        scopes = hlo.get(module, {})
        split = collections.Counter()
        kinds = collections.Counter()
        per_op = collections.Counter()
        for op, dur, _ in by_module.get(module, []):
            scope = "lora" if scopes.get(op) else "other"
            split[scope] += dur
            kinds[f"{scope}:{_kind(op)}"] += dur
            per_op[f"{scope}:{op}"] += dur
        rows.append({
            "row": "module", "label": label, "module": module, "executions": n,
            "ms_per_execution": sum(e - s for s, e in spans) / n / 1e3,
            "ops_per_execution": len(by_module.get(module, [])) / n,
            "lora_ops_per_execution": sum(1 for op, _, _ in by_module.get(module, [])
                                          if scopes.get(op)) / n,
            "op_ms": {k: v / n / 1e3 for k, v in split.items()},
            "kind_ms": {k: round(v / n / 1e3, 4) for k, v in kinds.most_common(16)},
            "top_ops_ms": {k: round(v / n / 1e3, 4) for k, v in per_op.most_common(20)},
            "hlo_known": bool(scopes)})
    return rows


def save_hlo(texts: list[str], out_dir: str, wanted: set[str], label: str = "",
             out: str | None = None) -> dict[str, dict[str, bool]]:
    """The wanted modules' HLO under out_dir, and their hlo_scopes (all when none wanted:
    a trace without device events); per module an "hlo_prefetch" row (the entry
    parameters copied whole into VMEM) to `out`."""
    scopes = {}
    for text in texts:
        module = re.search(r"HloModule\s+([\w.\-]+)", text).group(1)
        if module in wanted or not wanted:
            scopes[module] = hlo_scopes(text)[1]
            with gzip.open(os.path.join(out_dir, f"{module}.hlo.txt.gz"), "wt") as f:
                f.write(text)
            emit({"row": "hlo_prefetch", "label": label, "module": module,
                  "parameters_into_vmem": parameter_prefetches(text)}, out)
    return scopes


# ---- the runs ----

def decode_window(llm, work, loras, steps: int, trace_dir: str | None) -> int:
    """Admit a full batch, step until every sequence decodes, then `steps` steps (traced
    into trace_dir); abort the rest. Returns the decode steps traced."""
    import jax

    from vllm_tpu_lora import SamplingParams

    engine = llm.llm_engine
    batch = len(work)
    for i, (prompt, olen) in enumerate(work):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True),
                           lora_request=loras[i] if loras else None)
    seen = collections.Counter()
    while engine.has_unfinished_requests() and min((seen[f"p{i}"] for i in range(batch)),
                                                   default=0) < 2:
        for out in engine.step():
            seen[out.request_id] += 1
    traced = 0
    if trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        for _ in range(steps):
            engine.step()
            traced += 1
        jax.effects_barrier()
    finally:
        if trace_dir:
            jax.profiler.stop_trace()
    engine.abort_request([f"p{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    return traced


def profile_engine(model_dir: str, paths: list[str], work, args, max_loras: int,
                   slot_copy: str | None, base: bool, anchor: bool) -> None:
    """One engine's decode windows (base: the base model's too, once per max_loras) and,
    with `anchor`, the anchor's."""
    from vllm_tpu_lora import LLM, LoRARequest

    t0 = time.perf_counter()
    llm = LLM(model_dir, runtime="jax", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prompt_len[1] + args.output_len[1], enable_lora=True,
              max_loras=max_loras, max_lora_rank=args.rank, lora_backend=args.lora_backend,
              enable_prefix_caching=False, precompile=False, async_scheduling=False,
              kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30))
    engine = llm.llm_engine
    strategies = [None if s == "table" else s for s in args.force_strategy]
    force_strategy(engine, strategies[0], slot_copy)  # graphs traced lazily, below
    emit({"row": "engine", "max_loras": max_loras, "startup_s": time.perf_counter() - t0,
          "lora_backend": engine.runner.punica.backend, "force_strategy": args.force_strategy,
          "slot_copy": engine.runner.punica.slot_copy}, args.out)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    for r in reqs:
        engine.add_lora(r)
    batch = work[: args.max_num_seqs]
    windows = ([(0, None)] if base else []) + [(args.adapters, s) for s in strategies]
    for n, strategy in windows:
        loras = [reqs[i % n] for i in range(len(batch))] if n else None
        if n:
            force_strategy(engine, strategy, slot_copy)
            graphs = len(engine.runner.capture.executables)
        label = (f"engine_slots{max_loras}_adapters{n}" + (f"_{slot_copy}" if n and slot_copy
                                                           else "")
                 + (f"_{strategy}" if n and strategy else ""))
        t0 = time.perf_counter()
        decode_window(llm, batch, loras, 2, None)  # compiles what the window runs
        compiled_s = time.perf_counter() - t0
        if n and strategy != strategies[0] and len(engine.runner.capture.executables) == graphs:
            raise SystemExit(f"--force-strategy {strategy} compiled no graph of its own: its "
                             "step arrays are an earlier window's, so its graphs would be "
                             "that window's again; profile it on an engine of its own")
        trace_dir = os.path.join(args.out_dir, label)
        traced = decode_window(llm, batch, loras, args.steps, trace_dir)
        runs, by_module = device_ops(perfetto_events(trace_dir))
        scopes = save_hlo([c.as_text() for c in engine.runner.capture.executables],
                          args.out_dir, set(runs), label, args.out)  # the HLO of the graphs it ran
        emit({"row": "window", "label": label, "decode_steps": traced,
              "first_pass_s": compiled_s,
              "forward_graph_steps": dict(engine.runner.forward_graph_steps)}, args.out)
        for row in module_rows(label, runs, by_module, scopes):
            emit(row, args.out)
    if anchor:
        profile_anchor(llm, batch, args)


def profile_anchor(llm, work, args) -> None:
    import jax
    from jax_anchor import build_anchor

    engine = llm.llm_engine
    ctx = anchor_contexts(work, args.max_num_seqs)
    block = engine.config.cache_config.block_size
    for n, form in [(0, "stacked")] + [(args.adapters, f) for f in args.anchor_lora_forms]:
        step, state, inputs = build_anchor(engine.runner.model, ctx, block, n, form)
        for _ in range(3):
            state = step(state, *inputs)[1]
        jax.block_until_ready(state)
        label = f"anchor_adapters{n}_{form}" if n else "anchor"
        trace_dir = os.path.join(args.out_dir, label)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.steps):
                state = step(state, *inputs)[1]
            jax.block_until_ready(state)
        runs, by_module = device_ops(perfetto_events(trace_dir))
        scopes = save_hlo([step.hlo_text()], args.out_dir, set(runs), label, args.out)
        for row in module_rows(label, runs, by_module, scopes):
            emit(row, args.out)
        del step, state


def main() -> int:
    args = parse_args()
    import jax

    os.makedirs(args.out_dir, exist_ok=True)
    args.out = os.path.join(args.out_dir, "profile.jsonl")
    emit({"row": "setup", "jax": jax.__version__, "devices": str(jax.devices()),
          "args": vars(args)}, args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args, os.path.join(tmp, "model"))
        paths = make_many_adapters(model_dir, os.path.join(tmp, "adapters"), args.adapters,
                                   args.rank)
        work = make_workload(args)
        for i, max_loras in enumerate(args.max_loras):
            for j, copy in enumerate(args.slot_copies):
                profile_engine(model_dir, paths, work, args, max_loras, copy, base=j == 0,
                               anchor=i == j == 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
