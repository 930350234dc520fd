"""Figures from the benchmark JSON rows (as printed by the benchmark scripts).

    python benchmarks/benchmark_lora.py    > docs/results/lora.jsonl
    python benchmarks/benchmark_vs_peft.py > docs/results/vs_peft.jsonl
    python benchmarks/plot.py --lora docs/results/lora.jsonl --vs-peft docs/results/vs_peft.jsonl --out docs
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def plot_vs_peft(rows: list[dict], out: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in [("vllm_tpu_lora", "vllm_tpu_lora"), ("peft_mixed_batch", "PEFT mixed batch"),
                        ("peft_grouped", "PEFT grouped by adapter")]:
        pts = sorted((r["num_adapters"], r["output_tokens_per_s"]) for r in rows if r["name"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distinct adapters in the workload")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Multi-LoRA throughput vs PEFT (CPU, same run)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out, "throughput_vs_peft.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_lora_vs_adapters(rows: list[dict], out: str) -> str:
    """Output tokens/s against the number of distinct adapters in the batch (0 = LoRA
    enabled but unused), the base engine (enable_lora=False) as a reference line; one
    series per capture mode present in the rows."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for eager, style in [(False, "-"), (True, "--")]:
        mode = [r for r in rows if r.get("enforce_eager", False) == eager]
        base = [r["output_tokens_per_s"] for r in mode if r["name"] == "enable_lora=False"]
        pts = sorted((0 if r["name"] == "lora_enabled_unused" else int(r["name"].split("_")[0]),
                      r["output_tokens_per_s"]) for r in mode
                     if r["name"] == "lora_enabled_unused" or r["name"].endswith("_adapters"))
        if not pts:
            continue
        label = "re-traced every step (enforce_eager)" if eager else "captured graphs, replayed"
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        if base:
            ax.axhline(base[0], color=line.get_color(), ls=":", lw=1,
                       label=f"base model, no LoRA ({label.split(' (')[0].split(',')[0]})")
    ax.set_xlabel("distinct adapters in the batch (0 = LoRA enabled, unused)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Multi-LoRA throughput vs adapters (CPU; each mode vs its own base)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = os.path.join(out, "lora_throughput_vs_adapters.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lora", help="JSON rows of benchmark_lora.py")
    p.add_argument("--vs-peft", help="JSON rows of benchmark_vs_peft.py")
    p.add_argument("--out", default="docs")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.vs_peft:
        print(plot_vs_peft(read_rows(args.vs_peft), args.out))
    if args.lora:
        print(plot_lora_vs_adapters(read_rows(args.lora), args.out))


if __name__ == "__main__":
    main()
