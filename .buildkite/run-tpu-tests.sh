#!/usr/bin/env bash
# The `tpu`-marked tests (tests/test_tpu.py) on a TPU VM. A skipped test fails the job:
# on a TPU nothing in that file has a reason to skip.
set -euo pipefail
source "$(dirname "$0")/setup-tpu-env.sh"

python -m pytest -m tpu tests/test_tpu.py -v -rs --junitxml=tpu-results/tpu-tests.xml \
    | tee tpu-results/tpu-tests.log
if grep -qE "^SKIPPED|[0-9]+ skipped" tpu-results/tpu-tests.log; then
    echo "error: tpu tests were skipped on a TPU machine" >&2
    exit 1
fi
