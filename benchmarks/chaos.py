"""Chaos benchmark (issue #53): a 2-process training job that faults again and again never hangs
and loses no checkpoint, and what the faults cost.

`launch/local.sh --processes 2` trains the default config (the Shakespeare corpus, a 2-process
job over jax.distributed on 127.0.0.1) and relaunches it whenever it ends short of its last
step. Meanwhile `--faults` faults drawn from the matrix of tests/train/test_faults.py (seeded:
`--seed`) strike at random times once the job trains (a train record logged by its current
launch), each after the last one's relaunch trains again:

    kill-train-0   SIGKILL of process 0's training process (it hosts the coordinator)
    kill-train-1   SIGKILL of process 1's training process
    kill-host-1    SIGKILL of process 1's cem-train (a host gone: its training process dies with it)
    stall-1        SIGSTOP of process 1's training process for mesh.heartbeat_timeout_s + 5 s,
                   then SIGCONT (a host that stalls)
    preempt-0      SIGTERM to process 0's cem-train (a preemption notice: the job saves and stops)

For each fault: the seconds until every process of the job has exited (a hang: still running
`--hang-s` after the fault; then killed), until the relaunched job logs its next train record,
and whether the relaunch resumed from the newest checkpoint that was complete at the fault (a
lost checkpoint: it resumed from an older one). At the end: the steps recomputed and the goodput,
from the run's own goodput records (`cem_jax.train.goodput`).

Run: `python benchmarks/chaos.py [--faults 10] [--seed 0] [--steps 1500] [key=value ...]`
(about 10 minutes on 2 cores; the output recorded in `benchmarks/results/chaos_cpu.txt`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cem_jax.checkpoint import complete_steps

REPO = Path(__file__).resolve().parents[1]
KINDS = ("kill-train-0", "kill-train-1", "kill-host-1", "stall-1", "preempt-0")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def trainers(launcher: int) -> dict[int, tuple[int, int | None]]:
    """{process index: (cem-train's pid, its training process's pid or None)} of the job that
    `launch/local.sh` (pid `launcher`) runs now."""
    found = {}
    for pid in children(launcher):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        ids = [a.split("=", 1)[1] for a in argv if a.startswith("mesh.process_id=")]
        if ids:
            found[int(ids[0])] = (pid, (children(pid) or [None])[0])
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a kill
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out


def wait_until(predicate, timeout: float, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(poll)
    return None


def training_since(run_dir: Path, since: float) -> float | None:
    """The time of the first train record logged after `since` (s since the epoch), if any."""
    times = [r["time"] for r in records(run_dir, "train") if r["time"] > since]
    return min(times) if times else None


def strike(kind: str, job: dict[int, tuple[int, int | None]], stall_s: float) -> None:
    process = int(kind[-1])
    cem_train, training = job[process]
    if kind.startswith("kill-train"):
        os.kill(training, signal.SIGKILL)
    elif kind == "kill-host-1":
        os.kill(cem_train, signal.SIGKILL)
    elif kind == "preempt-0":
        os.kill(cem_train, signal.SIGTERM)
    else:  # stall-1: continued later, while the others' ends are timed
        os.kill(training, signal.SIGSTOP)
        threading.Timer(stall_s, lambda: alive(training) and os.kill(training, signal.SIGCONT)
                        ).start()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--heartbeat-s", type=int, default=10)
    parser.add_argument("--hang-s", type=float, default=180.0)
    parser.add_argument("--gap-s", type=float, nargs=2, default=(5.0, 40.0),
                        help="seconds of training between a relaunch and the next fault")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="cem_jax-chaos-")) / "run"
    overrides = [f"run.dir={run_dir}", f"run.steps={args.steps}", "run.checkpoint_every=50",
                 "run.log_every=10", "run.sample_tokens=0", "run.progress=false",
                 f"mesh.heartbeat_timeout_s={args.heartbeat_s}", "mesh.shutdown_timeout_s=10",
                 "run.save_timeout_s=30", *args.overrides]
    log = open(run_dir.parent / "launcher.log", "w")  # noqa: SIM115
    start = time.time()
    launcher = subprocess.Popen(
        ["bash", str(REPO / "launch" / "local.sh"), "--processes", "2", "--max-restarts",
         str(4 * args.faults), "--retry-delay", "1", *overrides],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "VENV": os.environ.get("VIRTUAL_ENV", sys.prefix),
             "JAX_PLATFORMS": "cpu"})  # libtpu (a dev extra) is no backend here
    print(f"chaos: {args.faults} faults (seed {args.seed}) on a 2-process job of "
          f"{args.steps} steps; run.dir {run_dir}; launcher log {log.name}", flush=True)
    results = []
    since = start
    for n in range(args.faults):
        if not wait_until(lambda since=since: training_since(run_dir, since), args.hang_s * 2):
            print(f"  fault {n + 1}: the job did not train again within {2 * args.hang_s:.0f} s")
            break
        time.sleep(rng.uniform(*args.gap_s))
        job = trainers(launcher.pid)
        if launcher.poll() is not None or len(job) < 2 or None in (t for _, t in job.values()):
            print(f"  fault {n + 1}: the job ended or was between launches; stopping the faults")
            break
        kind = rng.choice(KINDS)
        newest = (complete_steps(str(run_dir / "checkpoints")) or [0])[-1]
        fault = time.time()
        strike(kind, job, args.heartbeat_s + 5)
        pids = [pid for pair in job.values() for pid in pair if pid is not None]
        exited = wait_until(lambda pids=pids: not any(map(alive, pids)), args.hang_s)
        hang = exited is None
        if hang:
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        ended = time.time()
        trains = wait_until(lambda ended=ended: training_since(run_dir, ended), args.hang_s * 2)
        later = [r for r in records(run_dir, "goodput") if r["launch"] > fault]
        resumed = int(later[0]["first_step"]) if later else None
        results.append({"kind": kind, "exit_s": ended - fault, "hang": hang,
                        "productive_s": (trains - fault) if trains else None,
                        "newest": newest, "resumed": resumed,
                        "lost": resumed is not None and resumed < newest})
        r = results[-1]
        print(f"  fault {n + 1:2d} {kind:12s} at {fault - start:6.1f} s: all exited in "
              f"{r['exit_s']:5.1f} s{' (HANG)' if hang else ''}, training again after "
              f"{r['productive_s'] or float('nan'):5.1f} s, resumed from step {resumed} "
              f"(newest complete at the fault: {newest})", flush=True)
        since = ended
    status = launcher.wait(timeout=3600)
    wall = time.time() - start
    final = records(run_dir, "goodput")[-1]
    steps = sorted({r["step"] for r in records(run_dir, "train")})
    print(f"launcher exit status {status} after {wall:.0f} s; the run logged train records of "
          f"steps {steps[0]}-{steps[-1]}; final goodput record ended={final.get('ended', 0):.0f}")
    exit_s = [r["exit_s"] for r in results]
    productive = [r["productive_s"] for r in results if r["productive_s"] is not None]
    print(f"faults {len(results)}: hangs {sum(r['hang'] for r in results)}, lost checkpoints "
          f"{sum(r['lost'] for r in results)}")
    print(f"  fault to every process exited: mean {statistics.mean(exit_s):.1f} s, "
          f"max {max(exit_s):.1f} s")
    print(f"  fault to the next train record: mean {statistics.mean(productive):.1f} s, "
          f"max {max(productive):.1f} s")
    print(f"  steps recomputed {final['steps_recomputed']:.0f} ({final['recompute_s']:.1f} s), "
          f"lost to faults and relaunches {final['fault_s']:.1f} s, launches "
          f"{final['launches']:.0f}")
    print(f"  goodput {final['goodput']:.1%} of {final['wall_s']:.0f} s (start-up "
          f"{final['startup_s']:.0f} s and compile {final['compile_s']:.0f} s of the last launch)")
    ok = status == 0 and not any(r["hang"] or r["lost"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
