"""Output directories that appear whole or not at all, and never outside their path."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


class ExportError(ValueError):
    """A model or checkpoint cannot be written in the asked format (the message names why)."""


def check_destination(out: str | Path, overwrite: bool) -> Path:
    """`out` as an absolute path, after checking it may be written.

    Raises FileExistsError: `out` is a file, or a non-empty directory and not `overwrite`.
    """
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose another --out or pass "
                              f"--overwrite to replace it")
    return out


@contextlib.contextmanager
def staged_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `out`; when the block ends without an error
    it becomes `out` (replacing it when `overwrite`), otherwise it is deleted.

    Raises FileExistsError as `check_destination`.
    """
    out = check_destination(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "old")
        stage.rename(out)
        shutil.rmtree(old)
    else:
        stage.rename(out)


def file_in(directory: Path, name: str) -> Path:
    """`directory / name` for a plain file name (no separators, not hidden, not `..`).

    Raises ExportError otherwise: nothing may be written outside the output directory.
    """
    path = (directory / name).resolve()
    if "/" in name or "\\" in name or name.startswith(".") or path.parent != directory.resolve():
        raise ExportError(f"refusing to write {name!r}: not a plain file name inside {directory}")
    return path
