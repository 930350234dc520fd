"""What the adapter load path's host operations cost on this machine, one at a time: the
numbers that decide how issue 41's churn is cut on a host (the TPU VM runs under gVisor,
where a file syscall measured 15-100 us against ~1 us on the CPU host).

Rows (JSON, one per line):
  - `syscall`: per call, a `stat`, an `open` + `close`, of adapters' weights files;
  - `header_reads`: registration's read of N adapters' config and safetensors header
    (`read_adapter_bytes`, no tensor data), one thread, and split over 2/4/8 threads in
    contiguous chunks (an `open` gives the GIL back: does the filesystem serve opens in
    parallel?);
  - `device_put`: k slot images of one adapter's size moved as a list of k arrays in one
    `jax.device_put` against one stacked [k, n] array (its host stacking included),
    waited for. (On a CPU device a transfer of an aligned array may alias it: those rows
    time dispatch and the stacking copy, not a transfer.)
The adapter copies go to a fresh temporary directory (`--dir` to put them elsewhere), as
the churn benchmark's do; their files are in the page cache, as a just-written adapter's.

    python benchmarks/host_costs.py --out $OUT/host_costs.jsonl
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_jax_runtime import emit  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--adapters", type=int, default=512, help="copies read by header_reads")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--image-kb", type=int, default=256,
                   help="one slot image (issue 41's churn model: 256 KB in bf16)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dir", default=None, help="where the adapter copies go (default: a "
                   "temporary directory, as the churn benchmark's)")
    p.add_argument("--out", default=None)
    return p.parse_args()


def make_copies(root: str, n: int) -> list[str]:
    """One real PEFT adapter of the churn model's shape, then n - 1 copies of its files."""
    from many_adapters import make_many_adapters

    from vllm_tpu_lora.testing.factory import make_tiny_llama

    model = make_tiny_llama(os.path.join(root, "model"), hidden_size=256, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=512,
                            vocab_size=1024, seed=0)
    first = make_many_adapters(model, os.path.join(root, "adapters"), 1, 16)[0]
    paths = [first]
    for i in range(1, n):
        dst = os.path.join(root, "adapters", f"copy{i}")
        shutil.copytree(first, dst)
        paths.append(dst)
    return paths


def per_call_us(fn, paths: list[str]) -> float:
    start = time.perf_counter()
    for p in paths:
        fn(p)
    return 1e6 * (time.perf_counter() - start) / len(paths)


def syscall_rows(paths: list[str]) -> list[dict]:
    weights = [os.path.join(p, "adapter_model.safetensors") for p in paths]

    def open_close(path):
        os.close(os.open(path, os.O_RDONLY))

    return [{"row": "syscall", "op": "stat", "us": per_call_us(os.stat, weights)},
            {"row": "syscall", "op": "open+close", "us": per_call_us(open_close, weights)}]


def read_in_threads(paths: list[str], threads: int) -> float:
    """ms to read every adapter's header, the paths cut into `threads` contiguous chunks."""
    from vllm_tpu_lora.lora.peft_loader import read_adapter_bytes

    chunk = -(-len(paths) // threads)

    def work(part):
        for p in part:
            read_adapter_bytes(p)

    workers = [threading.Thread(target=work, args=(paths[i:i + chunk],))
               for i in range(0, len(paths), chunk)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return 1e3 * (time.perf_counter() - start)


def header_rows(paths: list[str], thread_counts: list[int]) -> list[dict]:
    rows = []
    for threads in [1, *thread_counts]:
        ms = min(read_in_threads(paths, threads) for _ in range(3))
        rows.append({"row": "header_reads", "adapters": len(paths), "threads": threads,
                     "ms": ms, "us_per_adapter": 1e3 * ms / len(paths)})
    return rows


def device_put_rows(image_kb: int, batches: list[int], reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    n = image_kb * 1024 // 2
    images = [np.random.default_rng(i).standard_normal(n).astype(jnp.bfloat16)
              for i in range(max(batches))]

    def as_list(k):
        return jax.device_put(images[:k], device)

    def stacked(k):
        return jax.device_put(np.stack(images[:k]), device)

    rows = []
    for k in batches:
        row = {"row": "device_put", "images": k, "image_kb": image_kb,
               "platform": device.platform}
        for name, fn in (("list_ms", as_list), ("stacked_ms", stacked)):
            jax.block_until_ready(fn(k))
            ts = []
            for _ in range(reps):
                start = time.perf_counter()
                jax.block_until_ready(fn(k))
                ts.append(1e3 * (time.perf_counter() - start))
            row[name] = float(np.median(ts))
        rows.append(row)
    return rows


def main() -> int:
    args = parse_args()
    emit({"row": "setup", "args": vars(args), "cpus": os.cpu_count()}, args.out)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        paths = make_copies(root, args.adapters)
        for row in syscall_rows(paths) + header_rows(paths, args.threads):
            emit(row, args.out)
    for row in device_put_rows(args.image_kb, args.batches, args.reps):
        emit(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
