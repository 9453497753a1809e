#!/usr/bin/env bash
# Train cem_jax on this machine (CPU or one GPU), making the virtual environment if needed.
#
#   launch/local.sh                                   # configs/shakespeare_cem.yaml
#   launch/local.sh --config configs/shakespeare_llama.yaml run.steps=200 run.dir=runs/try
#   launch/local.sh --extras gpu model.d_model=256    # a CUDA GPU: installs .[gpu]
#   launch/local.sh --dry-run                         # passed to cem-train as it is
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local.sh [options] [cem-train arguments, e.g. section.key=value ...]

  --config FILE       CONFIG        training config (configs/shakespeare_cem.yaml of the repo)
  --run-dir DIR       RUN_DIR       adds run.dir=DIR (default: the config's run.dir)
  --venv DIR          VENV          virtual environment, made and installed into when it has no
                                    cem-train (an active $VIRTUAL_ENV, else .venv of the repo)
  --extras EXTRAS     EXTRAS        pip extras when installing, e.g. gpu (none)
  --host-devices N    HOST_DEVICES  N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)
  -h, --help                        this help
Other arguments (overrides, --dry-run, ...) go to cem-train unchanged.
EOF
}

die() { echo "local.sh: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-$ROOT/configs/shakespeare_cem.yaml}
RUN_DIR=${RUN_DIR:-}
VENV=${VENV:-${VIRTUAL_ENV:-$ROOT/.venv}}
EXTRAS=${EXTRAS:-}
HOST_DEVICES=${HOST_DEVICES:-}
PYTHON=${PYTHON:-python3}
ARGS=()
# Huge pages for malloc: fewer page faults on XLA's per-step CPU buffers (see the Makefile).
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}

need() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --config) need "$@"; CONFIG=$2; shift 2 ;;
    --run-dir) need "$@"; RUN_DIR=$2; shift 2 ;;
    --venv) need "$@"; VENV=$2; shift 2 ;;
    --extras) need "$@"; EXTRAS=$2; shift 2 ;;
    --host-devices) need "$@"; HOST_DEVICES=$2; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

if [[ ! -x $VENV/bin/cem-train ]]; then
  echo "local.sh: installing cem_jax${EXTRAS:+[$EXTRAS]} into $VENV" >&2
  [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}"
fi
if [[ -n $HOST_DEVICES ]]; then
  [[ $HOST_DEVICES =~ ^[1-9][0-9]*$ ]] || die "--host-devices takes a positive integer"
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$HOST_DEVICES"
fi
[[ -z $RUN_DIR ]] || ARGS=("run.dir=$RUN_DIR" "${ARGS[@]}")
exec "$VENV/bin/cem-train" --config "$CONFIG" "${ARGS[@]}"
