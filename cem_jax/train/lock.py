"""One cem-train at a time in a run directory: an advisory lock on `run_dir/.lock`."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from cem_jax.fileio import LockHeld, held_lock


class RunDirInUse(RuntimeError):
    """Another cem-train holds the run directory."""


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, lead: bool) -> Iterator[None]:
    """Hold an advisory lock on `run_dir/.lock` (process 0) while training, so that a second
    cem-train on the same directory stops at once (RunDirInUse) instead of interleaving its
    checkpoints and metrics. A read-only run directory (a finished run shown again) or a file
    system without locks (some FUSE mounts) runs unlocked."""
    if not lead:
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(held_lock(run_dir / ".lock", create=True))
        except LockHeld as held:
            raise RunDirInUse(f"{run_dir} is in use by another cem-train ({held.holder}); "
                              "wait for it to finish or give another run.dir") from None
        if f is not None:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()}")
            f.flush()
        yield
