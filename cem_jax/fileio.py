"""Files written so that a crash never leaves a half-written one at its final name, with the
permissions a plain `open` or `mkdir` would give (data caches, tokenizers, metrics, exports),
and the advisory lock that keeps one cem-train in a run directory and exports out of it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, BinaryIO


class LockHeld(OSError):
    """Another process holds the lock; `holder` is what it wrote in the lock file."""

    def __init__(self, holder: str):
        super().__init__(f"held by {holder}")
        self.holder = holder


@contextlib.contextmanager
def held_lock(path: Path, create: bool = False) -> Iterator[IO[str] | None]:
    """Hold an exclusive advisory lock (flock) on the file `path` while the block runs, and
    yield it open: for reading, or with `create` for reading and appending (made when absent).
    Yields None when it cannot be opened (absent without `create`, a read-only folder):
    nothing to hold. Raises LockHeld when another process holds it; a file system without
    flock (some FUSE mounts) holds nothing."""
    try:
        f = open(path, "a+" if create else "r")
    except OSError:
        yield None
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise LockHeld(f.read().strip()) from None
        except OSError:  # no flock here: nothing to hold
            pass
        yield f


def umask_mode(mode: int) -> int:
    """`mode` less the process umask: the permissions `open` or `mkdir` would give (tempfile
    creates files 0600 and folders 0700, unreadable to others on a shared cluster)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """Open a temporary file beside `path` for binary writing; on success fsync and rename it
    to `path` (with the permissions a plain `open` would give), on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, umask_mode(0o666))
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
