#!/usr/bin/env bash
# The LoRA benchmark (base vs LoRA enabled-unused vs 1/2/4/8 distinct adapters, adapter load
# time, compilations after warm-up) with both LoRA backends; one JSON row per line.
set -euo pipefail
source "$(dirname "$0")/setup-tpu-env.sh"

python benchmarks/benchmark_lora.py --backends xla pallas | tee tpu-results/benchmark_lora.jsonl
# Any compilation after warm-up on a TPU is a bug (DESIGN.md section 4).
python - <<'PY'
import json
rows = [json.loads(line) for line in open("tpu-results/benchmark_lora.jsonl") if line.startswith("{")]
bad = [r for r in rows if r["name"] == "compilations_after_warmup" and r["count"] != 0]
assert not bad, f"compilations after warm-up: {bad}"
PY
