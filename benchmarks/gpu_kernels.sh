#!/usr/bin/env bash
# The tied-attention kernels on a GPU (issue #5), in one run: the kernel tests with the
# compiled GPU kernel (slow sweeps included), then the attention benchmark (memory curves unless
# SPEED_ONLY=1; speed against cuDNN/XLA with a block-size sweep). Writes its logs to OUT_DIR.
#
#   benchmarks/gpu_kernels.sh [OUT_DIR]      (default benchmarks/results; PYTHON=python3)
set -uo pipefail
out=${1:-benchmarks/results}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  | tee "$out/gpu_env.txt"
"$py" -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())' \
  | tee -a "$out/gpu_env.txt"
# The tests compare fp32 results at 1e-5: keep XLA's fp32 matmuls off TF32.
JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest -q \
  -p no:cacheprovider tests/kernels -k "not interpret and not tpu_interpreter" --durations=8 \
  2>&1 | tee "$out/kernel_tests_gpu.txt"
only=()
if [ "${SPEED_ONLY:-0}" = 1 ]; then only=(--speed-only); fi
timeout "${BENCH_TIMEOUT:-300}" "$py" benchmarks/attention.py --sweep "${only[@]}" 2>&1 \
  | tee "$out/attention_gpu.txt"
