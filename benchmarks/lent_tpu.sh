#!/usr/bin/env bash
# One call on the lent TPU v5e (docs/tpu.md): install from the machine's own wheel folders
# (if this machine has not yet), then each step named: tests | bench | profile | churn | hostcost | layer | sec.
#   bash benchmarks/lent_tpu.sh tests            # tests/test_tpu.py -> $OUT/tpu_tests.log
#   BENCH_ARGS="--num-adapters 8 32" bash benchmarks/lent_tpu.sh bench
#   LAYER_ARGS="--tokens 32 --slots 8 32" bash benchmarks/lent_tpu.sh layer
#   PROFILE_ARGS="--max-loras 8 32" bash benchmarks/lent_tpu.sh profile  # $OUT/profile/
# The wheels the machine lacks (torchax, peft, accelerate, psutil) travel in .whl-tpu/
# (the device tool's `carry`); TESTS_ARGS / BENCH_S / LAYER_S narrow or bound a step.
set -u
# PYTHONFAULTHANDLER: a process that dies of a signal prints every thread's Python stack.
export PIP_CONFIG_FILE=/dev/null PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
if [ ! -d /tmp/site/torch ]; then
  t0=$(date +%s)
  python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
      --find-links /opt/wheels --target /tmp/site torch transformers tokenizers safetensors tqdm \
      flax pyyaml huggingface_hub 2>&1 | grep -v WARNING | tail -3
  python3 -m pip install --isolated -q --no-index --no-deps --target /tmp/site2 .whl-tpu/*.whl 2>&1 | tail -2
  echo "install_s $(( $(date +%s) - t0 ))"
fi
export PYTHONPATH=$PYTHONPATH:$PWD:/tmp/site2:/tmp/site
# Compiles kept across calls while the machine stays warm.
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
python3 -c "import platform, torch, jax, transformers; print(platform.libc_ver(), torch.__version__, jax.__version__, transformers.__version__, jax.devices())"
for what in "$@"; do
  case $what in
    # eval: TESTS_ARGS may quote a -k expression ("a or b").
    # VLLM_TPU_LORA_TESTS_ON_TPU: tests/conftest.py leaves XLA's optimisation level alone.
    tests) VLLM_TPU_LORA_TESTS_ON_TPU=1 eval timeout 300 python3 -m pytest -q -rs -p no:cacheprovider ${TESTS_ARGS:-} tests/test_tpu.py 2>&1 | tee $OUT/tpu_tests.log | tail -40 ;;
    sec) echo "t=$SECONDS" ;;
    # The whole log goes to $OUT as it is written: a call cut off at its limit still says how far it got.
    bench) timeout ${BENCH_S:-540} python3 -u benchmarks/benchmark_jax_runtime.py --out $OUT/jax_runtime.jsonl ${BENCH_ARGS:-} > $OUT/bench.log 2>&1; echo "bench rc $?"; tail -c 3000 $OUT/bench.log ;;
    # The profiled graphs' HLO and profile.jsonl. The trace folders are dropped once read:
    # they nest too deep to come back, and their files crowded out the HLO (tenth session).
    profile) timeout ${PROFILE_S:-420} python3 -u benchmarks/profile_step.py --out-dir $OUT/profile ${PROFILE_ARGS:-} > $OUT/profile.log 2>&1; echo "profile rc $?"
             find $OUT/profile -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +; tail -c 1500 $OUT/profile.log ;;
    # Issue 41's churn workload (1,000 requests, each its own adapter read from disk during
    # the run, 8 new tokens) with the chip's host cores beside the loader thread.
    churn) timeout ${CHURN_S:-300} python3 -u benchmarks/benchmark_lora.py --many-adapters --runtime jax \
             --rounds ${CHURN_ROUNDS:-3} --hidden 256 --layers 2 --heads 4 --kv-heads 2 --intermediate 512 \
             --prompt-len 8 24 --output-len 8 8 --max-num-seqs 16 --max-loras 16 ${CHURN_ARGS:-} \
             > $OUT/churn.log 2>&1; echo "churn rc $?"; grep '"name"' $OUT/churn.log | cut -c1-400 ;;
    # What the adapter load path's host operations cost here (syscalls, threaded header
    # reads, transfer forms): seconds; run it before deciding how to cut the churn.
    hostcost) timeout ${HOSTCOST_S:-120} python3 -u benchmarks/host_costs.py --out $OUT/host_costs.jsonl ${HOSTCOST_ARGS:-} \
             > $OUT/host_costs.log 2>&1; echo "hostcost rc $?"; grep '"row"' $OUT/host_costs.log | cut -c1-300 ;;
    layer) timeout ${LAYER_S:-300} python3 -u benchmarks/tpu_lora_layer.py --out $OUT/lora_layer.jsonl ${LAYER_ARGS:-} > $OUT/layer.log 2>&1; echo "layer rc $?"; tail -c 3000 $OUT/layer.log ;;
  esac
done
