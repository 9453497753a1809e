"""How `cem-train` ends: its exit statuses, and its stops on SIGINT and SIGTERM at safe points.

Exit statuses (`ExitStatus`; docs/training.md and launch/README.md; the launchers act on them;
docs/exit_statuses.md has every command's):

    0  FINISHED    every run.steps step taken and the final validation logged (also: a finished
                   run started again, a dry run)
    1  CRASHED     an unexpected error, a bug or a device lost: the traceback, then one line
                   (or, when the training process died of a signal, the supervisor's line:
                   `cem_jax.cli.supervise`); the launchers retry a bounded number of times
                   (Python's own status for an uncaught exception is 1 too)
    2  CANNOT_RUN  the run cannot go on as configured and a retry will not help: a bad config,
                   a missing or corrupt data file or checkpoint, an unwritable, full or in-use
                   run.dir, a step that does not fit in device memory; not retried
    3  DIVERGED    a non-finite loss, gradient or updated parameter; not retried (it would
                   diverge again); the last good checkpoint is kept
    75 STOPPED     before run.steps, for a reason a relaunch gets past (EX_TEMPFAIL); the
                   launchers start it again, and it resumes from the newest complete
                   checkpoint: SIGINT or SIGTERM (what it trained is saved); a peer process
                   lost (a host killed, stalled or preempted: `cem_jax.train.watchdog`, within
                   mesh.heartbeat_timeout_s); object storage (a `gs://` run.dir or data)
                   unreachable or failing (`cem_jax.data.storage_errors`: one line naming the
                   URL, within about a minute of gcsfs's retries); a checkpoint save that did
                   not finish within run.save_timeout_s (abandoned: TensorStore would retry
                   for many minutes). Each is one line naming the process and its phase; a
                   relaunch on the same host takes a bucket's lock at once
                   (`cem_jax.train.lock`)

Signals: `caught()` (all of cem-train, from before JAX is imported) makes SIGINT and SIGTERM set
a flag instead of raising KeyboardInterrupt wherever the main thread happens to be (inside XLA's
compiler, a peak-FLOPs probe, a handoff to grain's or orbax's threads, a garbage-collector
callback that swallows it: a traceback of dozens of lines, now and then a crash or a lost
signal). The run reads the flag at safe points, `check()`: between start-up phases, before each
document it tokenizes (tokenizing a large corpus takes hours) and before each validation batch;
the loop stops after a step (`cem_jax.train.hooks.StopOnSignal`). In cem-train (and cem-compare)
a second SIGINT ends the process at once (Ctrl-C twice: leave now, without saving the step in
progress; the newest checkpoint stays as it is, and the lock goes with the process); in a
process that called `train` itself (a notebook) it raises KeyboardInterrupt, as Python does.
The handlers are installed even
where the signals were ignored (a trainer started in the background of a script stops on SIGINT
too). On several processes with JAX's preemption service, SIGTERM is the service's from
`jax.distributed.initialize` on (`StopOnSignal`).

`cem-data tokenize` reads the same flag (`caught()`, `check()` before each document it
tokenizes) and exits with 128 + the signal, its finished units kept.

This module imports no JAX (`cem_jax.cli.train.main` installs the handlers before JAX
loads).
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ExitStatus(enum.IntEnum):
    """cem-train's exit statuses; the module docstring says what each means."""

    FINISHED = 0
    CRASHED = 1
    CANNOT_RUN = 2
    DIVERGED = 3
    STOPPED = 75


class StoppedBySignal(BaseException):  # noqa: N818 (a stop, not an error)
    """A SIGINT or SIGTERM stopped the run at a safe point. A BaseException, as
    KeyboardInterrupt is: a stop is not an error, and no `except Exception` may take it for one.

    signum: the signal. where: where it stopped and what was kept. str(): "stopped by a signal
    (SIGTERM) at step 10; checkpoint saved in ..." (the words of `where` after the signal).
    """

    def __init__(self, signum: int, where: str = ""):
        self.signum, self.where = signum, where
        name = signal.Signals(signum).name
        super().__init__(f"stopped by a signal ({name}){' ' + where if where else ''}")

    def at(self, where: str) -> StoppedBySignal:
        """The same stop, saying where it happened and what was kept."""
        return StoppedBySignal(self.signum, where)


class _State:
    """The process's handlers: the first signal received, whether `caught` is active (and for
    which command, None in-process), the handlers it replaced, and the child process signals
    go to."""

    received: int | None = None
    caught = False
    program: str | None = None
    previous: dict[int, object] = {}
    child: int | None = None


def _handle(signum: int, frame) -> None:
    first = _State.received is None
    if first:
        _State.received = signum
    if _State.child is not None:  # the child stops on it (a second SIGINT: at once)
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(_State.child, signum)
    elif not first and signum == signal.SIGINT:  # Ctrl-C twice: leave now
        if _State.program is None:
            raise KeyboardInterrupt
        _leave_at_once()


def _leave_at_once() -> None:
    """One line on stderr, then exit with STOPPED without unwinding (no cleanup, no hook, no
    thread can hold the exit up)."""
    os.write(2, f"{_State.program}: stopped at once by a second SIGINT, without saving the "
                f"step in progress; start it again to resume from its newest checkpoint (exit "
                f"status {int(ExitStatus.STOPPED)})\n".encode())
    with contextlib.suppress(Exception):  # the main thread may be inside a write to it
        sys.stdout.flush()
    os._exit(ExitStatus.STOPPED)


@contextlib.contextmanager
def caught(program: str | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM set the flag (see the module docstring) inside the block; the
    handlers found are put back after it. `program`: the command whose process this is (a
    second SIGINT exits it at once, with a line naming it), None for code called in-process (a
    second SIGINT raises KeyboardInterrupt). Nested blocks share the outermost's handlers, flag
    and program (a new outermost block starts with the flag clear). Outside the main thread,
    where Python cannot handle signals, it does nothing."""
    if _State.caught or threading.current_thread() is not threading.main_thread():
        yield
        return
    _State.received, _State.caught, _State.program = None, True, program
    _State.previous = {s: signal.signal(s, _handle) for s in SIGNALS}
    try:
        yield
    finally:
        _State.caught = False
        for s, handler in _State.previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def forwarding(pid: int) -> Iterator[None]:
    """Inside `caught`: every SIGINT and SIGTERM received in the block is also sent to process
    `pid` (a cem-train this process runs and waits for, in its own session so that a Ctrl-C in
    the terminal reaches it once), and a second SIGINT is left to that process."""
    _State.child = pid
    try:
        yield
    finally:
        _State.child = None


def received() -> int | None:
    """The first SIGINT or SIGTERM received inside `caught`, or None."""
    return _State.received


def check() -> None:
    """A safe point: raises StoppedBySignal if a signal was received."""
    if _State.received is not None:
        raise StoppedBySignal(_State.received)


def report(status: ExitStatus, message: str) -> int:
    """Print cem-train's last line, "cem-train: MESSAGE (exit status N)", on stderr; returns
    N."""
    print(f"cem-train: {message} (exit status {int(status)})", file=sys.stderr, flush=True)
    return int(status)
