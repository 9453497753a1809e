"""One cem-train at a time in a run directory.

Locally it is an advisory lock (flock) on `run_dir/.lock`, which the operating system releases
when the process ends, however it ends. A bucket has neither flock nor a conditional delete
that every emulator serves, so there the lock is a numbered object `run_dir/.lock.N`, holding
"pid P on HOST (pid namespace I), token T"; the highest N present is the lock:

- a launcher that finds none creates `.lock.1`, only if no object is there
  (`files.create_new`: a generation precondition, so of two launchers exactly one gets it);
- the holder (process 0) refreshes it every `REFRESH_S` seconds from a thread, and deletes it
  when the run ends (finished, failed, stopped by a signal, or left at once for a lost peer or
  an abandoned save: `cem_jax.train.watchdog.leave`), giving that `RELEASE_S` at most:
  a bucket that cannot be reached (the run failing for that) leaves the lock behind rather
  than holding the exit up for gcsfs's retries;
- one not refreshed for `LEASE_S` seconds is a dead holder's (a slice deleted without its
  cleanup, SIGKILL): the next launcher takes it over by creating `.lock.N+1` under the same
  precondition (of two takers, one gets it) and deleting the older ones. So is, at once, one
  whose holder ran on this host, in this pid namespace, and is no longer running (`_gone`):
  a run relaunched on the machine where it failed (the storage unreachable for a while, a
  SIGKILL) does not wait out the lease. A training process that dies holding it (killed, or
  aborted by JAX's coordination service) has it deleted by its supervisor
  (`cem_jax.cli.supervise`), so a relaunch on another host does not wait either.

What it guards: a second cem-train (a launcher run twice, a relaunch while the old slice still
trains) stops at once with `RunDirInUse` instead of interleaving checkpoints and metrics. What
it cannot guard: a holder whose refreshes stop reaching the bucket for `LEASE_S` seconds while
it still trains; its refresh thread then finds a newer lock and logs an error.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from cem_jax.data import files
from cem_jax.fileio import LockHeld, held_lock
from cem_jax.train import watchdog

logger = logging.getLogger(__name__)

LEASE_S = 120.0  # a bucket lock not refreshed for this long is a dead holder's
REFRESH_S = 30.0
RELEASE_S = 5.0  # at most, the release of a bucket lock waits for its refresh and deletion
_HOLDER = re.compile(r"pid (\d+) on (.*), token [0-9a-f]+")  # what a bucket lock holds


class RunDirInUse(RuntimeError):
    """Another cem-train holds the run directory."""


@contextlib.contextmanager
def run_dir_lock(run_dir: str, lead: bool) -> Iterator[None]:
    """Hold the run directory's lock (process 0) while training, so that a second
    cem-train on the same directory stops at once (RunDirInUse). Locally, a read-only run
    directory (a finished run shown again) or a file system without locks (some FUSE mounts)
    runs unlocked."""
    if not lead:
        yield
    elif files.is_url(run_dir):
        with _bucket_lock(run_dir):
            yield
    else:
        with _local_lock(Path(run_dir)):
            yield


@contextlib.contextmanager
def _local_lock(run_dir: Path) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(held_lock(run_dir / ".lock", create=True))
        except LockHeld as held:
            raise _in_use(str(run_dir), held.holder) from None
        if f is not None:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()}")
            f.flush()
        yield


def _in_use(run_dir: str, holder: str) -> RunDirInUse:
    return RunDirInUse(f"{run_dir} is in use by another cem-train ({holder}); wait for it to "
                       "finish or give another run.dir")


@contextlib.contextmanager
def _bucket_lock(run_dir: str) -> Iterator[None]:
    holder = f"pid {os.getpid()} on {_place()}, token {secrets.token_hex(8)}"
    path = _acquire(run_dir, holder)
    stop = threading.Event()
    refresher = threading.Thread(target=_refresh, args=(run_dir, path, holder, stop),
                                 daemon=True, name="cem-train run.dir lock")
    refresher.start()
    watchdog.holds_lock(path)  # the supervisor deletes it if this process dies holding it
    cancel = watchdog.on_leave(lambda: _release(path, RELEASE_S))  # a lost peer's fast exit
    try:
        yield
    finally:
        cancel()
        stop.set()
        deadline = time.monotonic() + RELEASE_S
        refresher.join(RELEASE_S)  # a refresh under way ends in ms, unless the bucket is gone
        _release(path, max(deadline - time.monotonic(), 0.5))
        watchdog.holds_lock(None)


def release_dead_holder(path: str) -> None:
    """Delete the bucket lock object `path` of a training process known to be dead (cem-train's
    supervisor saw it die holding it), within RELEASE_S: a relaunch on any host takes the run
    directory at once instead of waiting out LEASE_S."""
    _release(path, RELEASE_S)


def _release(path: str, timeout: float) -> None:
    """Delete lock object `path`, giving it `timeout` seconds at most (in a thread): a bucket
    that cannot be reached would hold the exit for gcsfs's retries (~35 s or more). A lock left
    behind lapses after LEASE_S, and a relaunch on this host takes it at once (`_gone`)."""
    def remove() -> None:
        with contextlib.suppress(Exception):
            files.remove(path)

    thread = threading.Thread(target=remove, daemon=True, name="cem-train run.dir unlock")
    thread.start()
    thread.join(timeout)


def _place() -> str:
    """Where this process runs, as a bucket lock names it: the host, and on Linux the pid
    namespace (the containers of one host may share its name, not their pids)."""
    place = socket.gethostname()
    with contextlib.suppress(OSError):
        place += f" (pid namespace {os.stat('/proc/self/ns/pid').st_ino})"
    return place


def _gone(held_by: str) -> bool:
    """Whether the holder a bucket lock names ("pid P on PLACE, token T") ran here (this
    `_place`) and is no longer running: its lock is left from a run that failed or was
    killed. False when unsure (another place, an older lock's words, a live pid, this
    process)."""
    found = _HOLDER.fullmatch(held_by.strip())
    if found is None or found.group(2) != _place() or int(found.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(found.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it runs, as another user
        return False
    return False


def _locks(run_dir: str) -> list[tuple[int, str]]:
    """[(N, path)] of the lock objects `.lock.N` in `run_dir`, ascending."""
    found = [name.rsplit(".", 1)[1] for name in files.names(run_dir)
             if name.startswith(".lock.")]
    return sorted((int(n), files.join(run_dir, f".lock.{n}")) for n in found if n.isdigit())


def _acquire(run_dir: str, holder: str) -> str:
    """Create this launcher's lock object, taking over a lapsed one or one whose holder is
    gone from this host (`_gone`); its path. Raises
    RunDirInUse when a live cem-train (or a launcher that took over just now) holds it."""
    locks = _locks(run_dir)
    number = 1
    if locks:
        number, newest = locks[-1]
        try:
            modified, held_by = files.info(newest)["modified"], files.read_text(newest)
        except FileNotFoundError:  # released meanwhile
            modified, held_by = None, ""
        if modified is not None:
            age = (datetime.datetime.now(datetime.UTC) - modified).total_seconds()
            if age >= LEASE_S:
                logger.warning("%s: taking over the lock of %s, not refreshed for %.0f s (that "
                               "process is gone)", run_dir, held_by, age)
            elif _gone(held_by):
                logger.warning("%s: taking over the lock of %s, left %.0f s ago by that "
                               "process, which no longer runs on this host", run_dir, held_by,
                               age)
            else:
                raise _in_use(run_dir, f"{held_by}; its lock {newest} was refreshed {age:.0f} "
                              f"s ago: if that process is gone, the lock lapses "
                              f"{LEASE_S - age:.0f} s from now")
        number += 1
    path = files.join(run_dir, f".lock.{number}")
    if not files.create_new(path, holder.encode()):
        raise _in_use(run_dir, "a launcher that took the lock just now")
    for _, older in locks:
        files.remove(older)
    return path


def _refresh(run_dir: str, path: str, holder: str, stop: threading.Event) -> None:
    while not stop.wait(REFRESH_S):
        try:
            locks = _locks(run_dir)
            if not locks or locks[-1][1] != path:
                logger.error("the lock %s is no longer this run's (its refreshes did not reach "
                             "the bucket for %.0f s, and another cem-train took it over): two "
                             "runs may write %s", path, LEASE_S, run_dir)
                return
            if stop.is_set():  # released meanwhile: not written again
                return
            files.write_text(path, holder)
        except Exception as err:  # the bucket unreachable for a while: try again
            logger.warning("cannot refresh the lock %s (%s); trying again in %.0f s", path,
                           str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
                           REFRESH_S)
