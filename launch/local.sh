#!/usr/bin/env bash
# Train cem_jax on this machine (CPU or one GPU), making the virtual environment if needed.
#
#   launch/local.sh                                   # configs/shakespeare_cem.yaml
#   launch/local.sh --config configs/shakespeare_llama.yaml run.steps=200 run.dir=runs/try
#   launch/local.sh --extras gpu model.d_model=256    # a CUDA GPU: installs .[gpu]
#   launch/local.sh --dry-run                         # passed to cem-train as it is
#   launch/local.sh --processes 2 --host-devices 2    # one job of 2 processes (jax.distributed)
#
# It acts on cem-train's exit statuses as launch/tpu_pod.sh does (launch/README.md): 0 done;
# 2 or 3 (cannot run as configured, diverged) stop; 75 (stopped by a signal, a lost peer,
# unreachable storage: a relaunch resumes) run again, uncounted, unless this script was
# signalled (Ctrl-C stops it); anything else (a crash, a kill) run again up to --max-restarts.
# With --processes N, the N cem-train processes share this machine's coordinator port; a
# fault in one ends the others (status 75, docs/training.md) and the job runs again whole.
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
                                    in each process
  --processes N       PROCESSES     N cem-train processes, one job over jax.distributed on
                                    127.0.0.1 (1)
  --max-restarts N    MAX_RESTARTS  runs again after a crash or a kill before giving up (0);
                                    status 75 runs again without counting
  --retry-delay S     RETRY_DELAY   seconds before running again (5)
  -h, --help                        this help
Other arguments (overrides, --dry-run, ...) go to cem-train unchanged.

Exit status: cem-train's (0 finished, 2 cannot run as configured, 3 diverged, 75 stopped by a
signal to this script), or the last failure's when the restarts ran out.
EOF
}

die() { echo "local.sh: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-$ROOT/configs/shakespeare_cem.yaml}
RUN_DIR=${RUN_DIR:-}
VENV=${VENV:-${VIRTUAL_ENV:-$ROOT/.venv}}
EXTRAS=${EXTRAS:-}
HOST_DEVICES=${HOST_DEVICES:-}
PROCESSES=${PROCESSES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RETRY_DELAY=${RETRY_DELAY:-5}
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
    --processes) need "$@"; PROCESSES=$2; shift 2 ;;
    --max-restarts) need "$@"; MAX_RESTARTS=$2; shift 2 ;;
    --retry-delay) need "$@"; RETRY_DELAY=$2; shift 2 ;;
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
[[ $PROCESSES =~ ^[1-9][0-9]*$ ]] || die "--processes takes a positive integer"
[[ $MAX_RESTARTS =~ ^[0-9]+$ ]] || die "--max-restarts takes a non-negative integer"
[[ $RETRY_DELAY =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--retry-delay takes seconds"
[[ -z $RUN_DIR ]] || ARGS=("run.dir=$RUN_DIR" "${ARGS[@]}")
# shellcheck source=statuses.sh source-path=SCRIPTDIR
source "$ROOT/launch/statuses.sh"

say() { echo "local.sh: $*" >&2; }

# Each cem-train in a process group of its own (job control): a Ctrl-C reaches this script
# alone, which passes it on once (a second SIGINT would make cem-train leave unsaved).
set -m
TRAINERS=()
SIGNALLED=0
pass_on() {
  SIGNALLED=1
  ((${#TRAINERS[@]} == 0)) || kill "-$1" "${TRAINERS[@]}" 2>/dev/null || true
}
trap 'pass_on INT' INT
trap 'pass_on TERM' TERM

# wait_for PID: its exit status, waiting through the signals this script passes on.
wait_for() {
  while kill -0 "$1" 2>/dev/null; do wait "$1" 2>/dev/null || true; done
  wait "$1"
}

# attempt: run the job once; returns its status (combined_status of its processes).
attempt() {
  local i port codes="" code pid
  TRAINERS=()
  if ((PROCESSES == 1)); then
    "$VENV/bin/cem-train" --config "$CONFIG" "${ARGS[@]}" &
    TRAINERS=($!)
  else
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    for ((i = 0; i < PROCESSES; i++)); do
      "$VENV/bin/cem-train" --config "$CONFIG" "${ARGS[@]}" mesh.distributed=true \
        "mesh.coordinator_address=127.0.0.1:$port" "mesh.num_processes=$PROCESSES" \
        "mesh.process_id=$i" &
      TRAINERS+=($!)
    done
  fi
  for pid in "${TRAINERS[@]}"; do
    code=0
    wait_for "$pid" || code=$?
    codes+="${codes:+$'\n'}$code"
  done
  TRAINERS=()
  grep -qvx 0 <<<"$codes" || return 0
  combined_status "$codes"
}

restarts=0
while true; do
  rc=0
  attempt || rc=$?
  if [[ $rc == 0 || $rc == 2 || $rc == 3 || $SIGNALLED == 1 ]]; then
    exit "$rc"
  fi
  if [[ $rc != 75 ]]; then
    restarts=$((restarts + 1))
    if ((restarts > MAX_RESTARTS)); then
      if ((MAX_RESTARTS == 0)); then
        say "cem-train ended with status $rc; not run again (--max-restarts 0)"
      else
        say "giving up after $MAX_RESTARTS restarts (last status $rc)"
      fi
      exit "$rc"
    fi
  fi
  say "cem-train ended with status $rc$([[ $rc == 75 ]] && echo " (relaunch to resume)" ||
      echo ": restart $restarts of $MAX_RESTARTS"); running it again in ${RETRY_DELAY}s"
  sleep "$RETRY_DELAY" &
  wait_for $! || true
  [[ $SIGNALLED == 0 ]] || exit 75
done
