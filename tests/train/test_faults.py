"""A pod job never hangs: two (or three) real cem-train processes on localhost (jax.distributed,
gloo CPU collectives), one of them lost at a phase of the run; every other process ends within
the bound with one stderr line naming what happened and the retryable status 75; relaunched as
the launchers do, the run resumes from its newest complete checkpoint with the same training
losses as an uninterrupted run.

A process is lost in one of three ways: it SIGKILLs itself as it enters a phase
(`faults.kill_at_phase`, a host gone at that point), the test SIGKILLs its cem-train (the
supervisor, whose training child dies with it), or the test stops its training child with
SIGSTOP (a host that stalls) and lets it go on later with SIGCONT."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import portpicker
import pytest
from faults import fault_env
from train_helpers import REPO, train_losses

pytestmark = pytest.mark.slow  # starts processes (make test-all)

STEPS = 30
HEARTBEAT_S = 10  # mesh.heartbeat_timeout_s: short, so that no test waits long
BOUND_S = HEARTBEAT_S + 20  # every survivor ends within this long of the fault
SETTINGS = [f"run.steps={STEPS}", "run.checkpoint_every=5", "run.eval_every=10",
            "run.sample_tokens=0", "run.save_timeout_s=30", "imports=[faults]",
            f"mesh.heartbeat_timeout_s={HEARTBEAT_S}", "mesh.shutdown_timeout_s=10"]


STARTED: list[subprocess.Popen] = []  # killed after each test, whatever it found


@pytest.fixture(autouse=True)
def _no_process_left():
    yield
    for proc in STARTED:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(_training_child(proc), signal.SIGCONT)  # a stopped one dies too
            proc.kill()  # its training process dies with it
            proc.wait()
    STARTED.clear()


def _start(common: list[str], count: int, env: dict[int, dict[str, str]] | None = None
           ) -> list[subprocess.Popen]:
    """`cem-train COMMON` as processes 0 … count-1 of one job (process i's environment plus
    `env[i]`)."""
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.cli.train", *common, "mesh.distributed=true",
         f"mesh.coordinator_address=localhost:{port}", f"mesh.num_processes={count}",
         f"mesh.process_id={i}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, **fault_env(), **(env or {}).get(i, {})})
        for i in range(count)]
    STARTED.extend(procs)
    return procs


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if text in line:
            return
        assert time.monotonic() < deadline, f"no line with {text!r} in {timeout} s"
    raise AssertionError(f"stdout ended before a line with {text!r}")


def _ends(procs: list[subprocess.Popen], since: float) -> list[tuple[int, list[str], float]]:
    """(status, stderr lines, seconds from `since` to the exit) of each process; a process
    still running after BOUND_S is a hang (AssertionError, after killing it)."""
    ended = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(since + BOUND_S - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"a process still ran {BOUND_S} s after the fault") from None
        ended.append((proc.returncode, err.splitlines(), time.monotonic() - since))
    return ended


def _training_child(proc: subprocess.Popen) -> int:
    """The pid of the training process that cem-train's supervisor `proc` runs (OSError when
    `proc` has ended)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as children:
            if pids := children.read().split():
                return int(pids[0])
        time.sleep(0.05)
    raise OSError("cem-train started no training process")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def straight(tiny_overrides, tmp_path_factory):
    """The losses of the uninterrupted two-process run."""
    run_dir = tmp_path_factory.mktemp("straight")
    procs = _start([*tiny_overrides, *SETTINGS, f"run.dir={run_dir}"], 2)
    assert [p.wait(timeout=600) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    return train_losses(run_dir)


def _relaunch_is_exact(common: list[str], run_dir, straight, count: int = 2) -> None:
    """Start the job again, as the launchers do on status 75: it resumes from the newest
    complete checkpoint and every step's loss is the uninterrupted run's."""
    procs = _start(common, count)
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * count, [err[-3000:] for _, err in outputs]
    assert train_losses(run_dir) == straight
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


@pytest.mark.parametrize("victim,phase", [
    (1, "train step 1 ("),  # its first compile
    (0, "train step 14"),  # the coordinator, during a step
    (1, "train step 11"),  # the save of step 10 in flight
    (1, "the evaluation at step 20"),
])
def test_a_process_lost_at_a_phase_ends_the_others_in_one_line_and_the_relaunch_is_exact(
        straight, tiny_overrides, tmp_path, victim, phase):
    common = [*tiny_overrides, *SETTINGS, f"run.dir={tmp_path}"]
    procs = _start(common, 2, {victim: {"CEM_FAULT_KILL_PHASE": phase}})
    procs[victim].wait(timeout=300)  # its training process is gone: the fault is now
    [(status, err, seconds)] = _ends([procs[1 - victim]], time.monotonic())
    assert status == 75 and len(err) == 1, err
    assert err[0].startswith(f"cem-train: process {1 - victim} of 2 lost "), err
    assert f" during {phase}" in err[0] and err[0].endswith("(exit status 75)"), err
    newest = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                    if p.name.isdigit()) if (tmp_path / "checkpoints").exists() else []
    said = f"step {newest[-1]}: relaunch to resume" if newest else "no checkpoint was written"
    assert said in err[0], (newest, err)
    if phase == "train step 11":  # the save of step 10 never completed: not restorable
        assert 10 not in newest
    _relaunch_is_exact(common, tmp_path, straight)


def test_a_host_killed_whole_ends_the_others_and_its_training_process(
        straight, tiny_overrides, tmp_path):
    """SIGKILL of process 1's cem-train (a host gone): its training process dies with it
    (PR_SET_PDEATHSIG), and process 0 ends in one line, status 75."""
    common = [*tiny_overrides, *SETTINGS, f"run.dir={tmp_path}"]
    procs = _start(common, 2)
    child = _training_child(procs[1])
    _wait_for_line(procs[0], "step 12:")
    procs[1].send_signal(signal.SIGKILL)
    since = time.monotonic()
    [(status, err, _)] = _ends([procs[0]], since)
    assert status == 75 and len(err) == 1 and " lost " in err[0], err
    procs[1].wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "its training process lives on"
    _relaunch_is_exact(common, tmp_path, straight)


def test_a_stalled_host_ends_the_others_and_itself_when_it_goes_on(straight, tiny_overrides,
                                                                  tmp_path):
    """SIGSTOP of process 1's training process for longer than mesh.heartbeat_timeout_s:
    process 0 ends within the bound, naming process 1; continued (SIGCONT), process 1 ends at
    once, in one line, status 75."""
    common = [*tiny_overrides, *SETTINGS, f"run.dir={tmp_path}"]
    procs = _start(common, 2)
    child = _training_child(procs[1])
    _wait_for_line(procs[0], "step 12:")
    os.kill(child, signal.SIGSTOP)
    [(status, err, _)] = _ends([procs[0]], time.monotonic())
    assert status == 75 and len(err) == 1, err  # JAX's heartbeat names the silent process,
    assert err[0].startswith((  # or a save it never commits is abandoned first
        "cem-train: process 0 of 2 lost process 1 during train step ",
        "cem-train: process 0 of 2 abandoned the checkpoint save of step ")), err
    os.kill(child, signal.SIGCONT)
    [(status, err, seconds)] = _ends([procs[1]], time.monotonic())
    assert status == 75 and len(err) == 1 and err[0].startswith("cem-train: process 1 of 2 "), err
    assert seconds < 10
    _relaunch_is_exact(common, tmp_path, straight)


def test_a_middle_process_lost_ends_the_first_and_the_last(tiny_overrides, tmp_path):
    """Three processes: process 1 (neither the coordinator nor the last) lost during a step;
    processes 0 and 2 both end in one line, status 75."""
    common = [*tiny_overrides, *SETTINGS, "data.batch_size=6", f"run.dir={tmp_path}"]
    procs = _start(common, 3, {1: {"CEM_FAULT_KILL_PHASE": "train step 8"}})
    procs[1].wait(timeout=300)
    ends = _ends([procs[0], procs[2]], time.monotonic())
    for index, (status, err, _) in zip((0, 2), ends, strict=True):
        assert status == 75 and len(err) == 1, err
        assert err[0].startswith(f"cem-train: process {index} of 3 lost "), err


def test_a_job_refused_by_its_run_directory_lock_ends_with_status_2_not_75(
        tiny_overrides, tmp_path):
    """A run directory in use refuses process 0 alone (it holds the lock): process 0 says so
    and ends with status 2, also when JAX's coordination service aborts it afterwards in the
    shutdown barrier, where it waits for a peer that waits for it (its supervisor keeps the
    status the line gave: 75 would be relaunched forever); the others end within the bound;
    the job's status is 2 (launch/statuses.sh)."""
    tmp_path.mkdir(exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); "
                               "time.sleep(300)", str(tmp_path / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    STARTED.append(holder)
    holder.stdout.readline()  # it holds the lock
    procs = _start([*tiny_overrides, *SETTINGS, f"run.dir={tmp_path}"], 2)
    start = time.monotonic()
    (first, err0, seconds0), (second, _, _) = _ends(procs, start)
    assert first == 2 and err0[-1].startswith(f"cem-train: error: {tmp_path} is in use by "), err0
    assert err0[-1].endswith("(exit status 2)") and seconds0 < BOUND_S, (err0, seconds0)
    assert second in (2, 75), second
    statuses = REPO / "launch" / "statuses.sh"
    combined = subprocess.run(["bash", "-c", f'source {statuses}; combined_status "$1"', "-",
                               f"{first}\n{second}"])
    assert combined.returncode == 2
