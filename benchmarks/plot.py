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


def plot_lora_relative(rows: list[dict], out: str) -> str:
    labels, values = [], []
    for r in rows:
        if "relative_to_base" in r:
            labels.append(r["name"].replace("_distinct_adapters", " adapters")
                          .replace("lora_enabled_unused", "LoRA on, unused")
                          .replace("enable_lora=False", "no LoRA"))
            values.append(r["relative_to_base"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(labels, values, color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("output tokens/s relative to the base model")
    ax.set_title("LoRA throughput relative to base")
    ax.tick_params(axis="x", rotation=30)
    for i, v in enumerate(values):
        ax.text(i, v + 0.01, f"{v:.2f}", ha="center", fontsize=8)
    path = os.path.join(out, "lora_relative_to_base.png")
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
        print(plot_lora_relative(read_rows(args.lora), args.out))


if __name__ == "__main__":
    main()
