"""Files written so that a crash never leaves a half-written one at its final name, with the
permissions a plain `open` or `mkdir` would give (data caches, tokenizers, metrics, exports)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


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
