"""cem-train's supervisor: the command trains in a child process and watches it, so that a fault
that ends the JAX process from inside still ends `cem-train` with one line and a status a
launcher can act on.

    cem-train ARGS  →  this process (no JAX)  →  python -m cem_jax.cli.train ARGS  (trains)

JAX's coordination service aborts a process whose peer or coordinator is lost (SIGABRT, dozens of
lines of C++ log and stack on stderr) and cannot be told otherwise from Python. The supervisor:

- leaves stdout to the child and passes its stderr through line by line; JAX's C++ log lines
  (glog's "E1207 11:59:19.961413 26381 file.cc:289] ..." and the lines right after them) are
  passed on a second late, once it is clear that no fault follows them. Once one tells of a
  fault, everything but the child's own last line ("cem-train: ...") goes to a local log file
  instead, named in the last line: the C++ logs and stacks, the tracebacks of orbax's threads;
- sends the SIGINT and SIGTERM it receives on to the child (`cem_jax.exits.forwarding`; the
  child has its own process group, so a terminal's Ctrl-C reaches it once, through here); the
  child dies with the supervisor (Linux's PR_SET_PDEATHSIG);
- reads what the child does from a pipe (`cem_jax.train.watchdog`: its process index, its
  phase, its newest complete checkpoint, the bucket lock it holds, which the supervisor
  deletes if the child dies holding it);
- ends with the child's status (after a crash, with what was diverted passed on), unless the
  child died of a signal: after a fault of the coordination service's, one line "process 1 of
  2 lost process 0 (the coordinator) during train step 16; the newest complete checkpoint is
  step 10: relaunch to resume from it" and the retryable status 75; after any other signal
  (the child alone killed, a segmentation fault), "crashed", status 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from cem_jax import exits
from cem_jax.exits import ExitStatus
from cem_jax.train import watchdog

WORKER = "CEM_TRAIN_WORKER"  # set in the child: it trains instead of supervising
HOLD_S = 1.0  # a C++ log line is passed on this late, unless a fault follows it
_GLOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ")
_CXX = ("*** Check failure stack trace", "    @ ", "terminate called", "  what():",
        "Additional GRPC error information", ":UNKNOWN:Error received from peer", "=== Source")
# What the coordination service's messages say when it ends a process for a lost peer.
_SAID = re.compile(r"\(exit status (\d+)\)$")  # the end of cem-train's own last line
_FAULT = ("Terminating process because", "Polled an error from coordination service",
          "heartbeat timeout", "stopped sending heartbeats", "missing heartbeat",
          "Shutdown barrier", "Barrier failed")


class _Child:
    """What the child told the supervisor, and what its stderr showed."""

    def __init__(self) -> None:
        self.process: tuple[int, int] = (0, 1)
        self.phase = "start-up"
        self.checkpoint: int | None = None
        self.lock: str | None = None  # the bucket lock object it holds
        self.said: int | None = None  # the status its own last line gave
        self.fault = False
        self.diverted: list[str] = []


def supervise(argv: Sequence[str]) -> int:
    """Run `python -m cem_jax.cli.train ARGV` as the training child and return cem-train's exit
    status (the module docstring)."""
    read_end, write_end = os.pipe()
    env = {**os.environ, WORKER: "1", watchdog.PHASE_FD: str(write_end),
           watchdog.LAUNCHED: repr(time.time())}
    child = subprocess.Popen([sys.executable, "-m", "cem_jax.cli.train", *argv], env=env,
                             stderr=subprocess.PIPE, pass_fds=(write_end,), process_group=0,
                             preexec_fn=_die_with_parent)
    os.close(write_end)
    state = _Child()
    threads = [threading.Thread(target=target, args=(stream, state), daemon=True)
               for target, stream in ((_read_phases, os.fdopen(read_end, "rb")),
                                      (_pass_stderr, child.stderr))]
    for thread in threads:
        thread.start()
    with exits.caught("cem-train"), exits.forwarding(child.pid):
        status = child.wait()
    for thread in threads:
        thread.join(timeout=5)
    if state.lock is not None:  # it died holding the run directory's bucket lock
        from cem_jax.train.lock import release_dead_holder

        release_dead_holder(state.lock)
    return _ended(status, state)


def _ended(status: int, state: _Child) -> int:
    """cem-train's status for a child that ended with `status` (Popen's: -N for signal N). A
    child that left with a status of its own after a fault showed printed its own last line;
    when that says it crashed (a status other than 0 and 75), what was diverted (its
    traceback among the C++ echo) is passed on: nothing of a crash is hidden."""
    if status < 0:
        return _died(signal.Signals(-status), state)
    if state.diverted and status not in (ExitStatus.FINISHED, ExitStatus.STOPPED):
        sys.stderr.writelines(state.diverted)
        sys.stderr.flush()
    return status


def _die_with_parent() -> None:
    """In the child before it runs: SIGKILL when the supervisor dies (Linux; elsewhere the
    child outlives a killed supervisor)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _read_phases(stream, state: _Child) -> None:
    for raw in stream:
        kind, _, value = raw.decode(errors="replace").rstrip("\n").partition(" ")
        if kind == "process":
            index, count = value.split()
            state.process = (int(index), int(count))
        elif kind == "phase":
            state.phase = value
        elif kind == "checkpoint":
            state.checkpoint = int(value)
        elif kind == "lock":
            state.lock = None if value == "-" else value


def _pass_stderr(stream, state: _Child) -> None:
    """Pass the child's stderr on (the module docstring): C++ log lines are held for `HOLD_S`
    with what follows them, then passed on, or kept in `state.diverted` once a fault shows."""
    fd, pending, held, since = stream.fileno(), b"", [], 0.0
    while True:
        if select.select([fd], [], [], HOLD_S / 4)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                since = _take(raw.decode(errors="replace") + "\n", held, since, state)
        if held and time.monotonic() - since > HOLD_S:
            _flush(held, state)
    if pending:
        _take(pending.decode(errors="replace"), held, since, state)
    _flush(held, state)


def _take(line: str, held: list[str], since: float, state: _Child) -> float:
    """Hold, divert or pass on one line of the child's stderr; returns the time of the newest
    held C++ line. Once a fault shows, every line but the child's own last one ("cem-train:
    ...") is diverted: the rest (C++ logs, the tracebacks of orbax's threads) is its echo."""
    if line.startswith("cem-train: ") and (said := _SAID.search(line)):
        state.said = int(said.group(1))
    if state.fault and not line.startswith("cem-train: "):
        state.diverted.append(line)
        return since
    if _GLOG.match(line) or line.startswith(_CXX):
        held.append(line)
        since = time.monotonic()
    elif held and not line.startswith("cem-train: ") and time.monotonic() - since < HOLD_S:
        held.append(line)  # a C++ message's own next lines
    else:
        _flush(held, state)
        sys.stderr.write(line)
        sys.stderr.flush()
        return since
    if any(marker in line for marker in _FAULT):
        state.fault = True
    if state.fault:
        _flush(held, state)
    return since


def _flush(held: list[str], state: _Child) -> None:
    if state.fault:
        state.diverted += held
    else:
        sys.stderr.writelines(held)
        sys.stderr.flush()
    held.clear()


def _died(sig: signal.Signals, state: _Child) -> int:
    """cem-train's last line and status for a child ended by signal `sig`: none and the status
    it gave when it had printed its own last line (aborted afterwards in JAX's shutdown barrier,
    waiting for a peer that waits for it: a run directory in use refuses process 0 alone)."""
    if state.said is not None:
        return state.said
    index, count = state.process
    who = f"process {index} of {count}" if count > 1 else "the training process"
    log = _keep(state.diverted)
    if state.fault:
        return exits.report(ExitStatus.STOPPED, f"{who} lost {_peer(state.diverted)} during "
                            f"{state.phase} (JAX's coordination service ended it; its "
                            f"messages: {log}); {watchdog.resume_note(state.checkpoint)}")
    return exits.report(ExitStatus.CRASHED, f"crashed: {who} died of {sig.name} during "
                        f"{state.phase}{f' (its C++ messages: {log})' if log else ''}; "
                        f"{watchdog.resume_note(state.checkpoint)}")


def _peer(lines: list[str]) -> str:
    """Which process the coordination service's messages say was lost."""
    text = "".join(lines)
    if found := re.search(r"Task (\d+) heartbeat timeout", text):
        return f"process {found[1]}"
    if found := re.search(r"stopped sending heartbeats\):\s*(?:\S*task:)?(\d+)", text):
        return f"process {found[1]}"
    if "coordinator" in text or "Socket closed" in text or "Connection refused" in text:
        return "process 0 (the coordinator)"
    return "a peer"


def _keep(lines: list[str]) -> str | None:
    """A local file holding `lines` (None when there are none)."""
    if not lines:
        return None
    with tempfile.NamedTemporaryFile("w", prefix="cem-train-", suffix=".log",
                                     delete=False) as log:
        log.writelines(lines)
    return log.name
