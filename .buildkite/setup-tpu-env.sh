#!/usr/bin/env bash
# Sourced by the TPU job scripts: a venv with the `tpu` extra (current jax[tpu]: the jax
# runtime) and dev tools, and a hard check that a TPU is really in use, so that a
# misconfigured agent fails the job instead of skipping every `tpu` test and passing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${VLLM_TPU_LORA_VENV:-$HOME/.cache/vllm_tpu_lora/venv-tpu}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[tpu,dev]"
export PATH="$VENV/bin:$PATH"
export PJRT_DEVICE=TPU
export VLLM_TPU_LORA_CHECK_RECOMPILATION=1
mkdir -p tpu-results

python - <<'PY'
from vllm_tpu_lora import platform
assert platform.is_tpu(), f"no TPU detected (PJRT_DEVICE={platform.device_type()})"
import jax
assert jax.devices()[0].platform == "tpu", jax.devices()
print(f"TPU devices: {jax.device_count()}")
PY
