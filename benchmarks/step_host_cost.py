"""Host work per step that does not depend on the device: moving the step's arrays and
keying the forward graph's arguments. One JSON row each, measured in one process.

- `transfers`: a LoRA decode step's host arrays (16 tokens over 8 adapters at the LoRA
  benchmark's shape: token rows, attention metadata, the gathered strategy's plan, the
  sampler's blocked ids) moved one transfer per array (the runner before) against one flat
  buffer per graph (`runner/packed_inputs.py`, what the runner does), µs per step.
- `graph_call`: replaying a captured graph that reads one element of each of a model's
  KV caches and LoRA slot buffers (2 + 14 per layer), the state passed as a plain list
  (walked and keyed per call) against `FixedTensors` (keyed once), µs per call; the graph
  is trivial so the difference is the host's. Per layer count (--layers).

    python benchmarks/step_host_cost.py
    python benchmarks/step_host_cost.py --layers 4 32
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def best_us(fn, calls: int, rounds: int = 7) -> float:
    from vllm_tpu_lora import platform

    for _ in range(max(3, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        platform.wait_device_ops()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        platform.wait_device_ops()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def transfers_row(calls: int) -> dict:
    from vllm_tpu_lora import platform
    from vllm_tpu_lora.lora import step_layout
    from vllm_tpu_lora.runner.input_batch import prepare_step
    from vllm_tpu_lora.runner.model_runner import forward_host_arrays
    from vllm_tpu_lora.runner.packed_inputs import pack_arrays

    d = platform.xla_device()
    # 16 tokens, 16 request rows, 6 KV blocks per sequence of 16 slots, window 6 blocks
    a = prepare_step([], 16, 16, 6, 16, {}, None, 16, 6)
    plan = step_layout.token_slot_layout(np.arange(16, dtype=np.int32) % 8, list(range(8)))
    graphs = [forward_host_arrays(a, plan), {"mask": {"blocked_ids": a.blocked_ids}}]
    arrays = [x for g in graphs for named in g.values() for x in named.values()]

    def per_array():
        return [torch.from_numpy(x).to(d) for x in arrays]

    def packed():
        return [torch.from_numpy(f).to(d) for g in graphs for f in pack_arrays(g)[0]]

    return {"name": "transfers", "step": "16-token decode over 8 adapters, greedy",
            "per_array_us": best_us(per_array, calls), "per_array_transfers": len(per_array()),
            "packed_us": best_us(packed, calls), "packed_transfers": len(packed())}


def graph_call_row(layers: int, calls: int) -> dict:
    from vllm_tpu_lora import platform
    from vllm_tpu_lora.runner.lazy_capture import FixedTensors, LazyGraphCapture

    d = platform.xla_device()
    kv = [tuple(torch.zeros(64, 4, 16, device=d) for _ in range(2)) for _ in range(layers)]
    lora = [torch.zeros(8, 64, 16, device=d) for _ in range(14 * layers)]
    x = torch.zeros(4, device=d)
    platform.sync()

    def fn(x, kv, lora):
        kv = kv.value if isinstance(kv, FixedTensors) else kv
        lora = lora.value if isinstance(lora, FixedTensors) else lora
        y = x
        for t in [c for layer in kv for c in layer] + list(lora):
            y = y + t.reshape(-1)[0]
        return y

    plain, fixed = LazyGraphCapture().compile(fn), LazyGraphCapture().compile(fn)
    kv_f, lora_f = FixedTensors(kv), FixedTensors(lora)
    return {"name": "graph_call", "layers": layers, "graph_inputs": 1 + 16 * layers,
            "walked_us": best_us(lambda: plain(x, kv, lora), calls),
            "fixed_tensors_us": best_us(lambda: fixed(x, kv_f, lora_f), calls)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    rows = [transfers_row(args.calls)] + [graph_call_row(n, args.calls) for n in args.layers]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
