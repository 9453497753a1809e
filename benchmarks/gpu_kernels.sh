#!/usr/bin/env bash
# One device run on a GPU (issues #5, #16), sized to finish in 8 minutes: each step has its own
# `timeout` and the defaults add up to 7 min 10 s, leaving time for the start and the copy back.
#   1. environment                                                   (seconds)
#   2. the kernel tests with the compiled GPU kernels, slow sweeps included   TEST_TIMEOUT=190
#   3. the attention benchmark: tied kernel vs cuDNN (XLA as context), with the
#      launch-setting sweep; the memory curves only with MEMORY=1              BENCH_TIMEOUT=140
#   4. the compiled cuDNN-path tests (impl=cudnn vs xla on packed batches), then the
#      train-step comparison of cem_full_100m: tied CEM (xla, pallas, cudnn) vs its Llama twin
#      with cuDNN attention (the baseline), XLA's as context                  TRAIN_TIMEOUT=100
# Logs go to OUT_DIR, one file per step.
#
#   benchmarks/gpu_kernels.sh [OUT_DIR]      (default benchmarks/results; PYTHON=python3)
set -uo pipefail
out=${1:-benchmarks/results}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# 1. Environment.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | tee "$out/gpu_env.txt"
"$py" -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())' \
  | tee -a "$out/gpu_env.txt"

# 2. Compiled kernel tests. The tests compare fp32 results at 1e-5: keep XLA's fp32 matmuls off
# TF32. The interpreted runs and the CUDA-lowering test already run on CPU.
JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TEST_TIMEOUT:-190}" "$py" -m pytest -q \
  -p no:cacheprovider tests/kernels -k "not interpret and not tpu_interpreter and not launched" \
  --durations=8 2>&1 | tee "$out/kernel_tests_gpu.txt"

# 3. Attention benchmark.
only=(--speed-only)
if [ "${MEMORY:-0}" = 1 ]; then only=(); fi
timeout "${BENCH_TIMEOUT:-140}" "$py" benchmarks/attention.py --sweep "${only[@]}" 2>&1 \
  | tee "$out/attention_gpu.txt"

# 4. cuDNN path and train-step comparison (issue #16 items 1-2): remat off (memory allows it on
# an H200 at batch 16; recomputation is work MFU does not count).
timeout "${TRAIN_TIMEOUT:-100}" bash -c "
  \"$py\" -m pytest -q -p no:cacheprovider tests/test_attention_impl.py -k on_a_gpu &&
  \"$py\" benchmarks/train_step.py --config configs/cem_full_100m.yaml --repeats 5 \
    data.batch_size=16 model.remat=none" 2>&1 | tee "$out/train_step_gpu.txt"
