"""Where a training process is, told to the supervisor that started it, and how it leaves when
a peer or its storage is lost.

`cem-train` runs the training in a child process (`cem_jax.cli.supervise`), which writes one
line per event to the pipe named by CEM_TRAIN_PHASE_FD (nothing when it is unset: a notebook,
an in-process test):

    process I N        this is process I of N (after jax.distributed.initialize)
    phase TEXT         what the main thread does now ("train step 16", "evaluation at step
                       20", "start-up")
    checkpoint STEP    the newest complete checkpoint is STEP
    lock PATH          it holds the run directory's bucket lock object PATH ("-": no more)

The supervisor names the phase and the checkpoint in the one line it prints when the child
dies of a fault that the child could not report itself (JAX's coordination service aborts the
process when a peer or the coordinator is lost).

Faults the child sees itself end it through `leave`: one line, then `os._exit(75)` (the
retryable status, `ExitStatus.STOPPED`): after a peer is lost, a normal exit would wait in
JAX's shutdown barrier for the dead peer (`mesh.shutdown_timeout_s`) and then abort. A save in
flight is watched (`SaveWatch`): one that does not finish within its bound (a storage that went
away: TensorStore retries for many minutes) is abandoned so; its temporary folder is never
restored.

This module imports no JAX.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

PHASE_FD = "CEM_TRAIN_PHASE_FD"
STOPPED = 75  # `cem_jax.exits.ExitStatus.STOPPED`: relaunch to resume


LAUNCHED = "CEM_TRAIN_LAUNCHED"  # set by the supervisor: when cem-train started (s since the epoch)


class _State:
    process: tuple[int, int] = (0, 1)
    phase = "start-up"
    checkpoint: int | None = None
    lock = threading.Lock()
    launched = time.time()
    kind, since = "startup", launched  # what the phase's time is spent on, since when
    spent: dict[str, float] = {}
    on_leave: list[Callable[[], None]] = []


def _tell(line: str) -> None:
    """Write `line` to the supervisor's pipe, if there is one (a supervisor gone: ignored)."""
    fd = os.environ.get(PHASE_FD)
    if fd is None:
        return
    with _State.lock, contextlib.suppress(OSError):
        os.write(int(fd), (line + "\n").encode())


def started(process: int, count: int) -> None:
    """This is process `process` of `count`, in a launch that started when cem-train did
    (CEM_TRAIN_LAUNCHED), or now (a `train` called in this process): the phases' clock starts
    there, in start-up."""
    _State.process = (process, count)
    _State.launched = float(os.environ.get(LAUNCHED) or time.time())
    _State.phase, _State.kind, _State.since, _State.spent = ("start-up", "startup",
                                                             _State.launched, {})
    _tell(f"process {process} {count}")


def enter(phase: str, kind: str) -> None:
    """The main thread now does `phase` ("train step 16"), time spent on `kind` (one of
    `cem_jax.train.goodput.KINDS`: "step", "checkpoint", ...)."""
    _charge()
    _State.phase, _State.kind = phase, kind
    _tell(f"phase {phase}")


@contextlib.contextmanager
def spending(kind: str):
    """Charge the time of the block to `kind`, the phase staying what it is (the device time
    of a launch's first step, waited for in the next step's phase: its compile)."""
    _charge()
    previous, _State.kind = _State.kind, kind
    try:
        yield
    finally:
        _charge()
        _State.kind = previous


def _charge() -> None:
    """Add the time since the last charge to what it was spent on."""
    now = time.time()
    _State.spent[_State.kind] = _State.spent.get(_State.kind, 0.0) + now - _State.since
    _State.since = now


def launched() -> float:
    """When this launch started (s since the epoch; see `started`)."""
    return _State.launched


def spent(now: float) -> dict[str, float]:
    """Seconds of this launch until `now` by what they were spent on (`enter`'s kinds)."""
    spent = dict(_State.spent)
    spent[_State.kind] = spent.get(_State.kind, 0.0) + now - _State.since
    return spent


def saved(step: int) -> None:
    """The newest complete checkpoint is now step `step`."""
    _State.checkpoint = step
    _tell(f"checkpoint {step}")


def holds_lock(path: str | None) -> None:
    """This process holds the run directory's bucket lock object `path` now (None: no more),
    so that the supervisor deletes it if this process dies holding it."""
    _tell(f"lock {path or '-'}")


def phase() -> str:
    """What the main thread did last ("train step 16")."""
    return _State.phase


def who() -> str:
    """"process 1 of 2" (or "the training process" when it runs alone)."""
    index, count = _State.process
    return f"process {index} of {count}" if count > 1 else "the training process"


def resume_note(checkpoint: int | None) -> str:
    """What a relaunch resumes from."""
    if checkpoint is None:
        return "no checkpoint was written yet: relaunch to start again"
    return f"the newest complete checkpoint is step {checkpoint}: relaunch to resume from it"


def on_leave(release: Callable[[], None]) -> Callable[[], None]:
    """Have `leave` call `release()` (bounded by its own means: a bucket lock's deletion gives
    itself a few seconds) before the process ends; returns the call that cancels it."""
    _State.on_leave.append(release)
    return lambda: _State.on_leave.remove(release)


def leave(what: str) -> NoReturn:
    """End the process at once with the retryable status 75 after one stderr line:
    "cem-train: process 1 of 2 WHAT during PHASE; the newest complete checkpoint is step N:
    relaunch to resume from it (exit status 75)". Nothing is unwound: no shutdown barrier, no
    pending save waits for a peer or a storage that is gone; only what `on_leave` registered
    runs (the run directory's bucket lock is released, so that a relaunch on another host
    need not wait out its lease)."""
    line = (f"cem-train: {who()} {what} during {_State.phase}; "
            f"{resume_note(_State.checkpoint)} (exit status {STOPPED})\n")
    with contextlib.suppress(Exception):  # the main thread may be inside a write to it
        sys.stdout.flush()
    os.write(2, line.encode())
    for release in list(_State.on_leave):
        with contextlib.suppress(Exception):
            release()
    os._exit(STOPPED)


# What the errors of a collective or a barrier whose peer is gone say (Gloo on CPUs, NCCL on
# GPUs, JAX's coordination service and orbax's barriers everywhere); lower case.
_PEER_LOST = ("gloo", "nccl", "coordination service", "heartbeat", "barrier",
              "connection reset by peer")


def lost_peer(err: BaseException | None) -> str | None:
    """The first line of `err` when it says that a collective or a barrier lost its peer, in a
    run of several processes; else None."""
    if err is None or _State.process[1] == 1:
        return None
    text = str(err)
    if not any(marker in text.lower() for marker in _PEER_LOST):
        return None
    return (text.splitlines() or [""])[0][:300]


class _PeerLostEchoes(logging.Filter):
    """orbax's logs (with tracebacks, from its save threads) of a commit that failed for a lost
    peer: the main thread meets the same error at its next save or close, and leaves in one
    line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info
                    and f"{os.sep}orbax{os.sep}" in record.pathname
                    and lost_peer(record.exc_info[1]) is not None)


def drop_peer_lost_echoes() -> None:
    """From now on, drop orbax's logs of a save that failed for a lost peer (`_PeerLostEchoes`;
    once per process)."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _PeerLostEchoes) for f in absl.filters):
        absl.addFilter(_PeerLostEchoes())


def leave_if_peer_lost(exc_type, err, traceback) -> None:
    """An `ExitStack.push` callback: `leave` when the error unwinding the block is a lost peer's
    (before the block's other exits wait for that peer: a checkpoint's close, a barrier)."""
    if (cause := lost_peer(err)) is not None:
        leave(f"lost a peer ({cause})")


class SaveWatch:
    """Abandon a checkpoint save that does not finish within its bound: `timeout_s`, or three
    times the longest save that finished before it, whichever is longer (a large model's save
    to a bucket may take minutes; a dead storage's retries take longer). `in_progress()` says
    whether the newest save is still being written (orbax's `is_saving_in_progress`);
    `complete(step)` whether step `step` is a complete checkpoint now (a save that ended is not
    one when it failed: orbax ends a save whose write or peer failed as it ends one that
    succeeded). Only a complete one is told to the supervisor as the checkpoint to resume."""

    def __init__(self, in_progress: Callable[[], bool], complete: Callable[[int], bool],
                 timeout_s: float, poll_s: float = 0.25):
        self.in_progress, self.complete = in_progress, complete
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.longest = 0.0
        self._watching: threading.Thread | None = None
        self._poke = threading.Event()  # look again now: `wait` waits for the answer

    def save(self, step: int, write: Callable[[], None]) -> None:
        """Start the save of step `step` with `write()` (which returns while it is written) and
        watch it. The previous save finishes first, under its bound (orbax would wait for it in
        `write` too, unwatched)."""
        self.wait()
        start = time.monotonic()
        write()
        self._watching = threading.Thread(target=self._watch, args=(step, start),
                                          name=f"cem_jax save watch {step}", daemon=True)
        self._watching.start()

    def wait(self) -> None:
        """Return when the save watched has ended (the process leaves at its bound); call it
        before the run ends, so that no thread still calls into orbax as the process exits.
        The check that the save is complete (a read of its storage) is given the bound too."""
        if self._watching is not None:
            self._poke.set()
            self._watching.join(timeout=2 * self.bound())
            self._watching = None

    def bound(self) -> float:
        return max(self.timeout_s, 3 * self.longest)

    def _watch(self, step: int, start: float) -> None:
        while self.in_progress():
            if (waited := time.monotonic() - start) > self.bound():
                leave(f"abandoned the checkpoint save of step {step}, unfinished after "
                      f"{waited:.0f} s (run.save_timeout_s; its storage unreachable, or a "
                      f"peer lost)")
            self._poke.wait(self.poll_s)
            self._poke.clear()
        try:
            complete = self.complete(step)
        except Exception:  # its storage unreachable: the next save or the close says so
            return
        if complete:
            self.longest = max(self.longest, time.monotonic() - start)
            saved(step)
