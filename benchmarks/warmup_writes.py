"""What a LoRA engine's start-up costs on this host, and what one slot write costs after it.

Warm-up compiles every forward graph and the slot-write graphs (one per write batch size:
1, 2, 4, ... max_loras); on a CPU host the write graphs were most of a small engine's
warm-up (2026-12-07: LLVM -O2 on rows reshaped into the slot). Run it at XLA's default
flags: the test suite's -O0 is not what users get.

Rows (JSON, one per line):
  - `warmup`: seconds from `LLM(...)` to ready, graphs compiled, the runtime;
  - `slot_write`: `write_slots` of k adapters' host images into k slots, waited for
    (median over --reps rounds of 20 writes), per k.

    python benchmarks/warmup_writes.py --runtime torch_xla --out docs/results/warmup_writes_cpu.jsonl
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_jax_runtime import emit  # noqa: E402
from many_adapters import make_many_adapters  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runtime", default="torch_xla", choices=["torch_xla", "jax"])
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--writes", type=int, nargs="+", default=[1, 4, 8],
                   help="adapters per write_slots call (each <= --max-loras)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=None)
    return p.parse_args()


def _code() -> str:
    """The commit of the vllm_tpu_lora imported (another checkout's, on PYTHONPATH)."""
    import vllm_tpu_lora

    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm_tpu_lora.__file__)))
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    args = parse_args()
    from vllm_tpu_lora import LLM, LoRARequest
    from vllm_tpu_lora.testing.factory import make_tiny_llama

    common = {"runtime": args.runtime, "max_loras": args.max_loras, "code": _code(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "note": args.note}
    with tempfile.TemporaryDirectory() as root:
        model = make_tiny_llama(os.path.join(root, "model"), hidden_size=args.hidden,
                                num_layers=args.layers, num_heads=4, num_kv_heads=2,
                                intermediate_size=args.intermediate)
        paths = make_many_adapters(model, os.path.join(root, "adapters"),
                                   max(args.writes), args.rank)
        start = time.perf_counter()
        llm = LLM(model, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank,
                  max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                  runtime=args.runtime)
        seconds = time.perf_counter() - start
        engine, manager = llm.llm_engine, llm.llm_engine.lora_manager
        emit({"row": "warmup", **common, "seconds": seconds,
              "graphs": engine.stats()["num_graphs"]}, args.out)
        hosts = []
        for i, path in enumerate(paths):
            engine.add_lora(LoRARequest(f"a{i}", i + 1, path))
            hosts.append(manager.registry.host_copy(i + 1))
        wait = engine.runner.rt.to_host
        for k in args.writes:
            loads = [(slot, hosts[slot]) for slot in range(k)]
            manager.write_slots(loads)  # not timed: the first call of this size
            rounds = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for _ in range(20):
                    manager.write_slots(loads)
                wait(manager.buffers[0])
                rounds.append(1e3 * (time.perf_counter() - t0) / 20)
            emit({"row": "slot_write", **common, "adapters": k,
                  "ms": statistics.median(rounds)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
