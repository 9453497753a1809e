"""Output directories that appear whole or not at all, never outside their path, never over
their source, and that replace (with --overwrite) only what cem_jax itself wrote: every output
directory carries the marker file `MARKER`."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import safetensors.numpy

from cem_jax.fileio import umask_mode

MARKER = ".cem_jax_output"


class ExportError(ValueError):
    """A model or checkpoint cannot be written in the asked format (the message names why)."""


def check_destination(out: str | Path, overwrite: bool, source: str | Path | None = None
                      ) -> Path:
    """`out` as an absolute path, after checking it may be written.

    Raises FileExistsError: `out` is a file; or the directory `source` (what is being read),
    inside it or above it; or a non-empty directory and not `overwrite`; or, with `overwrite`,
    a non-empty directory that cem_jax did not write (it lacks `MARKER`).
    """
    out = Path(out).resolve()
    if source is not None:
        src = Path(source).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise FileExistsError(f"--out {out} overlaps the directory being read ({src}): "
                                  f"choose an --out outside it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise FileExistsError(f"{out} is not empty and was not written by cem-export or "
                                  f"cem-import, so it is never replaced: choose another --out")
        if not overwrite:
            raise FileExistsError(f"{out} holds an earlier cem-export or cem-import output: "
                                  f"choose another --out or pass --overwrite to replace it")
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
    os.chmod(stage, umask_mode(0o777))  # as a plain mkdir would make it
    try:
        yield stage
        (stage / MARKER).write_text("written by cem_jax; `--overwrite` may replace this folder\n")
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


def write_safetensors(directory: Path, name: str, tensors: dict, metadata: dict) -> None:
    """Write {name: numpy array} `tensors` as safetensors file `name` in `directory` (see
    `file_in`), readable as a plain `open` would make it (safetensors creates files 0600)."""
    path = file_in(directory, name)
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, umask_mode(0o666))


def file_in(directory: Path, name: str) -> Path:
    """`directory / name` for a plain file name (no separators, not hidden, not `..`).

    Raises ExportError otherwise: nothing may be written outside the output directory.
    """
    path = (directory / name).resolve()
    if "/" in name or "\\" in name or name.startswith(".") or path.parent != directory.resolve():
        raise ExportError(f"refusing to write {name!r}: not a plain file name inside {directory}")
    return path
