#!/usr/bin/env bash
# Train cem_jax on a Cloud TPU VM slice (one host or a pod slice of many), or on several slices
# joined by the data-center network (--slices N: Cloud TPU multislice), surviving preemption.
#
#   launch/tpu_pod.sh --zone us-central2-b --accelerator v4-32 --bucket my-bucket -- \
#       model.d_model=512 run.steps=20000        # run.dir=gs://my-bucket/runs/cem-jax
#
# Creates the slice unless it exists, installs the package on every worker, starts the same
# `cem-train ... mesh.distributed=true` on every worker (JAX finds the coordinator, the process
# count and the process index in the TPU environment), streams worker 0's log and waits for all
# workers. It acts on cem-train's exit statuses (launch/README.md): all 0, done; 2 or 3 (cannot
# run as configured, diverged) on a healthy slice, stop; 75 (stopped by a signal, checkpoint
# saved), run again; anything else (a crash, a kill, a lost slice), run again, a bounded number
# of times. When the slice goes away (spot/preemptible VM preempted, maintenance, lost ssh) it
# deletes/recreates it or waits for it to be READY, reinstalls if it is new, and runs the same
# command again: cem-train resumes from the newest checkpoint in run.dir, so run.dir must be
# storage that outlives the slice and that every worker sees: a bucket, `gs://BUCKET/runs/NAME`
# (--bucket or --run-dir; cem-train and orbax write it themselves, nothing is mounted), or a
# Filestore/NFS mount (gcsfuse only on request, --gcsfuse). With --slices N > 1 the same happens
# to a queued resource of N nodes, a slice each (see "Several slices" below). See
# launch/README.md and docs/pod_training.md. Run with --help for the options.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh [options] [--] [section.key=value ...]

Slice (flag / environment variable, default):
  --name NAME            TPU_NAME         TPU VM name; with --slices N > 1 the queued
                                          resource's, its nodes NAME-0 ... NAME-(N-1) (cem-jax)
  --zone ZONE            TPU_ZONE         zone, e.g. us-central2-b (required)
  --project PROJECT      TPU_PROJECT      project (gcloud's default project)
  --accelerator TYPE     TPU_ACCELERATOR  --accelerator-type, e.g. v4-32, v5litepod-16 (v4-8)
  --version RUNTIME      TPU_VERSION      TPU software version (tpu-ubuntu2204-base)
  --slices N             TPU_SLICES       slices joined by the data-center network (1); N > 1:
                                          Cloud TPU multislice, a queued resource of N nodes
                                          of --accelerator each, cem-train gets
                                          mesh.num_slices=N (the data axis spans the slices)
  --spot                 TPU_SPOT=1       create a spot VM (cheaper, may be preempted)
  --preemptible          TPU_PREEMPTIBLE=1  create a preemptible VM (older TPU generations;
                                          one slice only)
  --create-flag FLAG     (repeatable)     extra flag for `tpu-vm create` (`queued-resources
                                          create` with --slices N > 1), e.g. --network=N

Code and environment on the workers:
  --repo-url URL         REPO_URL         git clone URL (default: copy this checkout with scp)
  --repo-ref REF         REPO_REF         branch, tag or commit to check out (HEAD)
  --python VERSION       PYTHON_VERSION   Python of the workers' venv, made by uv (3.12)
  --extras EXTRAS        TPU_EXTRAS       pip extras of the install (tpu)
  --env KEY=VALUE        (repeatable)     environment variable of the training processes

Training:
  --config FILE          CONFIG           config, relative to the repository root
                                          (configs/shakespeare_cem.yaml)
  --run-dir DIR          RUN_DIR          run.dir on the workers: shared and persistent,
                                          e.g. gs://BUCKET/runs/NAME (default with --bucket:
                                          gs://BUCKET/runs/NAME; with --gcsfuse too:
                                          MOUNT/runs/NAME)
  --bucket BUCKET        TPU_BUCKET       a GCS bucket in the slice's region, for the default
                                          run.dir; nothing is mounted
  --gcsfuse              TPU_GCSFUSE=1    mount the bucket with gcsfuse on every worker (not
                                          needed: cem-train writes gs:// itself)
  --mount DIR            TPU_MOUNT        where --gcsfuse mounts it (/mnt/BUCKET)
  section.key=value ...                   config overrides, passed to cem-train as they are

Retries (a trainer stopped by a signal, status 75, is run again without counting):
  --max-restarts N       MAX_RESTARTS     runs after a crash or lost slice before giving up (20)
  --max-waits N          MAX_WAITS        polls for a READY slice (an ACTIVE queued resource)
                                          per attempt (120)
  --poll-interval S      POLL_INTERVAL    seconds between polls of the slice state (30)
  --retry-delay S        RETRY_DELAY      seconds before running again after a failure (60)
                         LOCK_LEASE       with a gs:// run.dir, at least this many seconds
                                          (120): the lock object of a killed trainer lapses
                                          that long after its last refresh

  --dry-run              DRY_RUN=1        print the gcloud commands instead of running them
  -h, --help                              this help

Exit status: 0 when training finished; cem-train's 2 (cannot run as configured) or 3
(diverged) when a trainer reported it on a healthy slice; 1 when the retries ran out.
EOF
}

die() { echo "tpu_pod.sh: $*" >&2; exit 2; }
say() { echo "tpu_pod.sh: $*" >&2; }

NAME=${TPU_NAME:-cem-jax}
ZONE=${TPU_ZONE:-}
PROJECT=${TPU_PROJECT:-}
ACCELERATOR=${TPU_ACCELERATOR:-v4-8}
SLICES=${TPU_SLICES:-1}
VERSION=${TPU_VERSION:-tpu-ubuntu2204-base}
SPOT=${TPU_SPOT:-0}
PREEMPTIBLE=${TPU_PREEMPTIBLE:-0}
REPO_URL=${REPO_URL:-}
REPO_REF=${REPO_REF:-HEAD}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
EXTRAS=${TPU_EXTRAS:-tpu}
CONFIG=${CONFIG:-configs/shakespeare_cem.yaml}
RUN_DIR=${RUN_DIR:-}
BUCKET=${TPU_BUCKET:-}
GCSFUSE=${TPU_GCSFUSE:-0}
MOUNT=${TPU_MOUNT:-}
MAX_RESTARTS=${MAX_RESTARTS:-20}
MAX_WAITS=${MAX_WAITS:-120}
POLL_INTERVAL=${POLL_INTERVAL:-30}
RETRY_DELAY=${RETRY_DELAY:-60}
LOCK_LEASE=${LOCK_LEASE:-120}  # cem_jax.train.lock.LEASE_S
DRY_RUN=${DRY_RUN:-0}
GCLOUD=${GCLOUD:-gcloud}
SOURCE_DIR=${SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=statuses.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/statuses.sh"
CREATE_FLAGS=()
TRAIN_ENV=()
OVERRIDES=()

need() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --name) need "$@"; NAME=$2; shift 2 ;;
    --zone) need "$@"; ZONE=$2; shift 2 ;;
    --project) need "$@"; PROJECT=$2; shift 2 ;;
    --accelerator) need "$@"; ACCELERATOR=$2; shift 2 ;;
    --version) need "$@"; VERSION=$2; shift 2 ;;
    --slices) need "$@"; SLICES=$2; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --preemptible) PREEMPTIBLE=1; shift ;;
    --create-flag) need "$@"; CREATE_FLAGS+=("$2"); shift 2 ;;
    --repo-url) need "$@"; REPO_URL=$2; shift 2 ;;
    --repo-ref) need "$@"; REPO_REF=$2; shift 2 ;;
    --python) need "$@"; PYTHON_VERSION=$2; shift 2 ;;
    --extras) need "$@"; EXTRAS=$2; shift 2 ;;
    --env) need "$@"; [[ $2 == [A-Za-z_]*=* ]] || die "--env takes KEY=VALUE, not '$2'"
           TRAIN_ENV+=("$2"); shift 2 ;;
    --config) need "$@"; CONFIG=$2; shift 2 ;;
    --run-dir) need "$@"; RUN_DIR=$2; shift 2 ;;
    --bucket) need "$@"; BUCKET=$2; shift 2 ;;
    --gcsfuse) GCSFUSE=1; shift ;;
    --mount) need "$@"; MOUNT=$2; shift 2 ;;
    --max-restarts) need "$@"; MAX_RESTARTS=$2; shift 2 ;;
    --max-waits) need "$@"; MAX_WAITS=$2; shift 2 ;;
    --poll-interval) need "$@"; POLL_INTERVAL=$2; shift 2 ;;
    --retry-delay) need "$@"; RETRY_DELAY=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *=*) OVERRIDES+=("$1"); shift ;;
    *) die "'$1' is neither an option nor a section.key=value override (see --help)" ;;
  esac
done

[[ -n $ZONE ]] || die "the zone is required: --zone ZONE or TPU_ZONE (see --help)"
[[ $SLICES =~ ^[1-9][0-9]*$ ]] || die "--slices (TPU_SLICES) must be a positive integer, not" \
  "'$SLICES'"
if ((SLICES > 1)) && [[ $PREEMPTIBLE == 1 ]]; then
  die "--preemptible is for one slice: a queued resource of several takes --spot"
fi
for override in "${OVERRIDES[@]}"; do
  [[ $override != mesh.num_slices=* ]] || die "'$override': the slice count comes from" \
    "--slices (TPU_SLICES), which passes mesh.num_slices to cem-train"
done
for n in MAX_RESTARTS MAX_WAITS POLL_INTERVAL RETRY_DELAY LOCK_LEASE; do
  [[ ${!n} =~ ^[0-9]+$ ]] || die "$n must be a non-negative integer, not '${!n}'"
done
BUCKET=${BUCKET#gs://}
BUCKET=${BUCKET%/}
[[ $BUCKET != */* ]] || die "--bucket takes a bucket name, not a path ('$BUCKET'); give" \
  "--run-dir gs://$BUCKET"
if [[ $GCSFUSE == 1 ]]; then
  [[ -n $BUCKET ]] || die "--gcsfuse mounts the bucket that --bucket names: give --bucket too"
  MOUNT=${MOUNT:-/mnt/$BUCKET}
  RUN_DIR=${RUN_DIR:-$MOUNT/runs/$NAME}
elif [[ -n $MOUNT ]]; then
  die "--mount (TPU_MOUNT) is where --gcsfuse mounts the bucket: add --gcsfuse, or leave it" \
    "out (the run directory is then gs://BUCKET/..., nothing mounted)"
elif [[ -n $BUCKET ]]; then
  RUN_DIR=${RUN_DIR:-gs://$BUCKET/runs/$NAME}
fi
[[ -n $RUN_DIR ]] || die "give --run-dir (gs://BUCKET/runs/NAME, or a path every worker" \
  "shares) or --bucket BUCKET"
if [[ -z $REPO_URL && $CONFIG != /* && ! -f $SOURCE_DIR/$CONFIG ]]; then
  die "config '$CONFIG' is not in this checkout ($SOURCE_DIR), which is what the workers" \
    "get; give a path relative to the repository root, e.g. configs/cem_full_100m.yaml"
fi
if [[ $RUN_DIR != /* && $RUN_DIR != *://* ]]; then
  say "warning: run.dir '$RUN_DIR' is on the workers' boot disks: not shared between" \
      "workers, and lost when a preempted slice is recreated"
fi

LOCATION=(--zone="$ZONE")
[[ -z $PROJECT ]] || LOCATION+=(--project="$PROJECT")

# Several slices. One slice is a TPU VM (`gcloud compute tpus tpu-vm ...`), READY when it can
# run. Several (Cloud TPU multislice) are one queued resource of N nodes, a slice each, ACTIVE
# once all of them are provisioned, the way Cloud TPU's multislice docs make and reach them:
# `queued-resources create NAME --node-count=N --node-prefix=NAME ...` (nodes NAME-0 ...
# NAME-(N-1)), `queued-resources ssh|scp NAME --node=all --worker=all`, and when its spot slices
# are preempted or it cannot be provisioned (SUSPENDED, FAILED), `delete --force` and create.
#   https://cloud.google.com/tpu/docs/multislice-introduction
#   https://cloud.google.com/sdk/gcloud/reference/compute/tpus/queued-resources/create (ssh, scp,
#   delete alike)
#   https://cloud.google.com/python/docs/reference/tpu/latest/google.cloud.tpu_v2.types.QueuedResourceState.State
# No environment is set by hand: the queued resource writes MEGASCALE_NUM_SLICES,
# MEGASCALE_SLICE_ID and MEGASCALE_COORDINATOR_ADDRESS into each VM's tpu-env metadata, where
# libtpu and jax.distributed.initialize() find them (jax/_src/clusters/cloud_tpu_cluster.py:
# process index = slice index * workers per slice + worker; "QueuedResources ... set up these
# MXLA flags during initialization", https://github.com/AI-Hypercomputer/maxtext/issues/30).
# Slices created one by one would need them set (as Ray's get_tpu_coordinator_env_vars does).
if ((SLICES > 1)); then
  GROUP=queued-resources HEALTHY=ACTIVE STATE_FIELD=state.state
  ALL_HOSTS=(--node=all --worker=all) FIRST_HOST=(--node=0 --worker=0)
  DELETE_FLAGS=(--force --quiet)  # --force: deletes the nodes first, whatever their state
else
  GROUP=tpu-vm HEALTHY=READY STATE_FIELD=state
  ALL_HOSTS=(--worker=all) FIRST_HOST=(--worker=0)
  DELETE_FLAGS=(--quiet)
fi

# Paths on the workers, relative to the ssh user's home.
REMOTE_REPO=cem_jax
REMOTE_VENV=cem_venv
# ~/cem_launch holds the trainer's script, pid, log and exit status (see launch_command).

gcloud_run() {  # gcloud_run ARGS...: run gcloud, or print it with --dry-run
  if [[ $DRY_RUN == 1 ]]; then
    { printf '%q' "$GCLOUD"; printf ' %q' "$@"; printf '\n'; } >&3  # fd 3: the real stdout
    return 0
  fi
  printf '+ %s' "$GCLOUD" >&2; printf ' %q' "$@" | cut -c1-300 >&2
  "$GCLOUD" "$@"
}

tpu() { gcloud_run compute tpus "$GROUP" "$1" "$NAME" "${LOCATION[@]}" "${@:2}"; }
on_workers() {  # on_workers all|0 COMMAND: every worker (of every slice), or worker 0 (of slice 0)
  if [[ $1 == all ]]; then tpu ssh "${ALL_HOSTS[@]}" --command="$2"
  else tpu ssh "${FIRST_HOST[@]}" --command="$2"; fi
}

exec 3>&1
DRY_STATE=MISSING
slice_state() {  # prints READY, CREATING, PREEMPTED, ... (a queued resource: ACTIVE,
  # WAITING_FOR_RESOURCES, PROVISIONING, SUSPENDED, FAILED, ...), MISSING (none) or ERROR
  if [[ $DRY_RUN == 1 ]]; then
    gcloud_run compute tpus "$GROUP" describe "$NAME" "${LOCATION[@]}" \
      --format="value($STATE_FIELD)"
    echo "$DRY_STATE"
    return 0
  fi
  local err out
  err=$(mktemp)
  if out=$("$GCLOUD" compute tpus "$GROUP" describe "$NAME" "${LOCATION[@]}" \
           --format="value($STATE_FIELD)" 2>"$err"); then
    echo "${out:-UNKNOWN}"
  elif grep -qiE 'NOT_FOUND|not found' "$err"; then
    echo MISSING
  else
    cat "$err" >&2
    echo ERROR
  fi
  rm -f "$err"
}

create_slice() {
  local flags=(--accelerator-type="$ACCELERATOR" --version="$VERSION")
  if ((SLICES > 1)); then
    flags=(--node-count="$SLICES" --node-prefix="$NAME" --accelerator-type="$ACCELERATOR"
           --runtime-version="$VERSION")
    say "creating queued resource $NAME: $SLICES slices $NAME-0 ... $NAME-$((SLICES - 1))" \
        "($ACCELERATOR, $VERSION) in $ZONE"
  else
    say "creating $NAME ($ACCELERATOR, $VERSION) in $ZONE"
  fi
  [[ $SPOT != 1 ]] || flags+=(--spot)
  [[ $PREEMPTIBLE != 1 ]] || flags+=(--preemptible)
  if tpu create "${flags[@]}" "${CREATE_FLAGS[@]}"; then
    DRY_STATE=$HEALTHY
  else
    say "create failed (no capacity?); trying again"
    return 1
  fi
}

NEED_INSTALL=1
# ensure_ready [KNOWN_STATE]: wait until the slice is READY (a queued resource ACTIVE), making it
# if needed. A preempted slice, or a queued resource that failed or was suspended (its spot
# slices preempted), is deleted and created again.
ensure_ready() {
  local state=${1:-} waits=0 pause
  while true; do
    [[ -n $state ]] || state=$(slice_state)
    pause=1  # no pause after an action that succeeded: look at the state again at once
    case $state in
      "$HEALTHY") return 0 ;;
      MISSING) NEED_INSTALL=1; create_slice && pause=0 ;;
      PREEMPTED|TERMINATED|FAILED|SUSPENDED)
        say "$NAME is $state: deleting and recreating it"
        NEED_INSTALL=1
        if tpu delete "${DELETE_FLAGS[@]}"; then create_slice && pause=0
        else say "delete failed"; fi ;;
      STOPPED) say "$NAME is STOPPED: starting it"; tpu start && pause=0 ;;
      *) say "$NAME is $state: waiting for $HEALTHY" ;;
    esac
    waits=$((waits + 1))
    if ((waits > MAX_WAITS)); then
      say "$NAME is not $HEALTHY after $MAX_WAITS polls; giving up"
      exit 1
    fi
    state=""
    ((pause == 0)) || sleep "$POLL_INTERVAL"
  done
}

upload_source() {  # copy this checkout to every worker (without --repo-url)
  local tarball
  tarball=$(mktemp "${TMPDIR:-/tmp}/cem_jax.XXXXXX")
  tar -czf "$tarball" -C "$SOURCE_DIR" --exclude=./.git --exclude=./.venv --exclude=./runs \
      --exclude=__pycache__ --exclude='*.egg-info' --exclude=.pytest_cache \
      --exclude=.hypothesis --exclude=.ruff_cache --exclude=./build --exclude=./dist .
  local rc=0
  gcloud_run compute tpus "$GROUP" scp "$tarball" "$NAME:$REMOTE_REPO.tar.gz" "${ALL_HOSTS[@]}" \
    "${LOCATION[@]}" || rc=$?
  rm -f "$tarball"
  return "$rc"
}

install_command() {
  local cmd
  # shellcheck disable=SC2016  # expanded on the workers
  cmd='set -euo pipefail; cd "$HOME"
export PATH="$HOME/.local/bin:$PATH"
command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
'
  if [[ -n $REPO_URL ]]; then
    cmd+="[ -d $REMOTE_REPO/.git ] || git clone $(printf %q "$REPO_URL") $REMOTE_REPO
git -C $REMOTE_REPO fetch --depth 1 origin $(printf %q "$REPO_REF")
git -C $REMOTE_REPO checkout --force FETCH_HEAD
"
  else
    cmd+="mkdir -p $REMOTE_REPO && tar -xzf $REMOTE_REPO.tar.gz -C $REMOTE_REPO
"
  fi
  cmd+="[ -x $REMOTE_VENV/bin/python ] || uv venv --python $(printf %q "$PYTHON_VERSION") $REMOTE_VENV
uv pip install --python $REMOTE_VENV/bin/python -e $(printf %q "./${REMOTE_REPO}[$EXTRAS]")
"
  if [[ $GCSFUSE == 1 ]]; then
    # shellcheck disable=SC2016  # expanded on the workers
    cmd+='if ! command -v gcsfuse >/dev/null; then
  echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -c -s) main" | sudo tee /etc/apt/sources.list.d/gcsfuse.list
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  sudo apt-get update -q && sudo apt-get install -yq gcsfuse
fi
'
  fi
  printf '%s' "$cmd"
}

# The script each worker runs under nohup: cem-train, then its exit status. A SIGTERM or SIGINT
# that reaches this script too (a signal to the process group, systemd stopping the session at a
# shutdown) does not end it: it waits for cem-train, which saves its checkpoint (to the bucket)
# before it exits 75, and records that status. Nothing here or in the launcher kills cem-train.
train_script() {
  local args=(--config "$CONFIG" "run.dir=$RUN_DIR" mesh.distributed=true)
  ((SLICES == 1)) || args+=("mesh.num_slices=$SLICES")
  args+=("${OVERRIDES[@]}")
  local envs=""
  [[ ${#TRAIN_ENV[@]} -eq 0 ]] || envs="env $(printf '%q ' "${TRAIN_ENV[@]}")"
  # shellcheck disable=SC2016  # expanded on the workers
  printf 'trap : TERM INT\ncd "$HOME/%s" && %s"$HOME/%s/bin/cem-train" %s\necho $? > "$HOME/cem_launch/rc"\n' \
    "$REMOTE_REPO" "$envs" "$REMOTE_VENV" "$(printf '%q ' "${args[@]}")"
}

# On every worker: mount the bucket (--gcsfuse), then start the trainer in the background (its output in
# cem_launch/train.log, its exit status in cem_launch/rc), unless it is still running from an
# earlier attempt (a lost ssh connection), in which case this attaches to it again.
launch_command() {
  local cmd="set -eu; cd \"\$HOME\"
"
  if [[ $GCSFUSE == 1 ]]; then
    cmd+="if ! mountpoint -q $(printf %q "$MOUNT"); then
  sudo mkdir -p $(printf %q "$MOUNT") && sudo chown \"\$(id -u):\$(id -g)\" $(printf %q "$MOUNT")
  gcsfuse --implicit-dirs --rename-dir-limit=1000000 $(printf %q "$BUCKET") $(printf %q "$MOUNT")
fi
"
  fi
  # shellcheck disable=SC2016  # expanded on the workers
  cmd+='mkdir -p cem_launch
if [ -f cem_launch/pid ] && ps -p "$(cat cem_launch/pid)" -o args= | grep -q cem_launch/train.sh; then
  echo "cem-train is still running on $(hostname): attaching"
else
  rm -f cem_launch/rc
  printf "%s" '"$(printf %q "$(train_script)")"' > cem_launch/train.sh
  nohup bash cem_launch/train.sh > cem_launch/train.log 2>&1 < /dev/null &
  echo $! > cem_launch/pid
fi'
  printf '%s' "$cmd"
}

# On worker 0: its log from the start, until its trainer exits (at once if it is over).
# shellcheck disable=SC2016  # expanded on the workers
STREAM_COMMAND='cd "$HOME"
if [ -f cem_launch/rc ] || [ ! -f cem_launch/pid ]; then cat cem_launch/train.log
else tail -n +1 -f --pid="$(cat cem_launch/pid)" cem_launch/train.log; fi'

# On every worker: wait for the trainer to exit, report and return its exit status.
# shellcheck disable=SC2016  # expanded on the workers
STATUS_COMMAND='cd "$HOME"; pid=$(cat cem_launch/pid 2>/dev/null || true)
while [ -n "$pid" ] && ps -p "$pid" -o args= | grep -q cem_launch/train.sh; do sleep 5; done
rc=$(cat cem_launch/rc 2>/dev/null || echo 255)
echo "cem-launch-exit=$rc on $(hostname)"; exit "$rc"'

# One run: install if the slice is new, start, stream, wait; returns the status. Several slices
# install before every run (quick when nothing changed): Cloud TPU's auto-repair replaces a slice
# of an ACTIVE multislice queued resource after a maintenance event or a hardware failure with
# new VMs, whose disks are empty (multislice-introduction, "Autorepair").
attempt() {
  if [[ $NEED_INSTALL == 1 ]] || ((SLICES > 1)); then
    if [[ -z $REPO_URL ]]; then upload_source || return 255; fi
    on_workers all "$(install_command)" || return 255
    NEED_INSTALL=0
  fi
  on_workers all "$(launch_command)" || return 255
  on_workers 0 "$STREAM_COMMAND" || say "log stream of worker 0 ended with status $?"
  local out rc=0
  out=$(on_workers all "$STATUS_COMMAND") || rc=$?
  [[ -z $out ]] || printf '%s\n' "$out" >&2
  [[ $rc != 0 ]] || return 0
  combined_status "$(grep -oE 'cem-launch-exit=[0-9]+' <<<"$out" | cut -d= -f2 || true)"
}

restarts=0
state=""
while true; do
  ensure_ready "$state"
  rc=0
  attempt || rc=$?
  if [[ $rc == 0 && $DRY_RUN == 1 ]]; then
    say "dry run: the commands above were printed, nothing was run"
    exit 0
  elif [[ $rc == 0 ]]; then
    say "training finished; run directory $RUN_DIR"
    exit 0
  fi
  state=$(slice_state)
  if [[ $state == "$HEALTHY" && ($rc == 2 || $rc == 3) ]]; then
    say "cem-train $([[ $rc == 2 ]] && echo "cannot run as configured" || echo "diverged")" \
        "(status $rc) on a healthy slice; not retrying (its last line says why)"
    exit "$rc"
  fi
  if [[ $rc == 75 ]]; then
    say "cem-train was stopped by a signal and saved (status 75), slice $state: running it" \
        "again in ${RETRY_DELAY}s (not counted as a restart; to stop for good, stop this" \
        "script first)"
    sleep "$RETRY_DELAY"
    continue
  fi
  restarts=$((restarts + 1))
  if ((restarts > MAX_RESTARTS)); then
    say "giving up after $MAX_RESTARTS restarts (last status $rc, slice $state)"
    exit 1
  fi
  delay=$RETRY_DELAY
  if [[ $RUN_DIR == *://* ]] && ((delay < LOCK_LEASE)); then
    # a trainer killed (SIGKILL, a lost host) left its lock object in run.dir: a new start
    # before it lapses would be refused as a second writer (status 2)
    delay=$LOCK_LEASE
  fi
  say "run ended with status $rc, slice $state: restart $restarts of $MAX_RESTARTS" \
      "in ${delay}s (cem-train resumes from its last checkpoint)"
  sleep "$delay"
done
