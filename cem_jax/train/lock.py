"""One cem-train at a time in a run directory: an advisory lock on `run_dir/.lock`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path


class RunDirInUse(RuntimeError):
    """Another cem-train holds the run directory."""


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, lead: bool) -> Iterator[None]:
    """Hold an advisory lock on `run_dir/.lock` (process 0) while training, so that a second
    cem-train on the same directory stops at once (RunDirInUse) instead of interleaving its
    checkpoints and metrics. A file system without locks (some FUSE mounts) runs unlocked."""
    if not lead:
        yield
        return
    try:
        f = open(run_dir / ".lock", "a+")  # held open while training
    except OSError:  # a read-only run dir (a finished run shown again): nothing to guard
        f = None
    if f is None:
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise RunDirInUse(f"{run_dir} is in use by another cem-train ({f.read().strip()}); "
                              "wait for it to finish or give another run.dir") from None
        except OSError:  # no flock here: nothing to hold
            pass
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield
