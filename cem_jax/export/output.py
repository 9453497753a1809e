"""Output directories that appear whole or not at all, never outside their path, never over
their source or a training run, and that replace (with --overwrite) only what cem_jax itself
wrote.

Every output directory carries the marker file `MARKER`: JSON whose "files" lists the entries
(files and folders) the output wrote. `--overwrite` replaces those and keeps every other entry
(a model card the user added, cem-train's `.lock`), which moves into the new output; it refuses,
before anything is written, when the new output would write over such an entry. A directory
that holds a training run (`metrics.jsonl`, a checkpoint step above 0, or a `.lock` that a
cem-train holds) is never replaced, whatever the flags; cem-train removes the marker of a
directory it trains in (`unmark_output`: a cem-import's run), so that it is no output any more.

A marker of an older cem_jax is plain text and lists no files. `--overwrite` then replaces the
folder only when each of its entries is a file one of those older outputs wrote
(`LEGACY_OUTPUTS`), and otherwise refuses naming the others: such a marker cannot tell a file the
user added from the export's, and refusing loses nothing (move them out and run it again).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

import safetensors.numpy

from cem_jax.fileio import LockHeld, held_lock, umask_mode

MARKER = ".cem_jax_output"
RUN_LOCK = ".lock"  # the lock file a running cem-train holds (`cem_jax.train.lock`)
# What the outputs of cem_jax before file lists wrote, their marker aside: the `hf` export (the
# `safetensors` and `hf-llama` exports wrote subsets of it) and cem-import's run directory.
LEGACY_OUTPUTS = (frozenset({"config.json", "model.safetensors", "tokenizer.model",
                             "tokenizer_config.json", "generation_config.json",
                             "configuration_cem.py", "modeling_cem.py"}),
                  frozenset({"config.yaml", "tokenizer.model", "checkpoints"}))


class ExportError(ValueError):
    """A model or checkpoint cannot be written in the asked format (the message names why)."""


def check_destination(out: str | Path, overwrite: bool, source: str | Path | None = None,
                      names: Collection[str] = ()) -> Path:
    """`out` as an absolute path, after checking that an output writing the entries `names`
    may be written there.

    Raises ValueError: `out` is a URL (an output is written on a local disk: copy it to a
    bucket after). FileExistsError: `out` is a file; or the directory `source` (what is being read),
    inside it or above it; or a non-empty directory that holds a training run or is in use by
    a cem-train; or one that cem_jax did not write (it lacks `MARKER`); or, not `overwrite`, an
    earlier output; or, with `overwrite`, one holding an entry of `names` that the earlier
    output did not write (or, with an older marker, any entry an older output did not write).
    """
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(out)):
        raise ValueError(f"--out {out} is a URL: an export or import is written to a local "
                         f"directory; write it there, then copy it (gcloud storage cp -r DIR "
                         f"{out})")
    out = Path(out).resolve()
    if source is not None and "://" not in str(source):
        src = Path(source).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise FileExistsError(f"--out {out} overlaps the directory being read ({src}): "
                                  f"choose an --out outside it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    with _run_lock(out):
        _kept_entries(out, overwrite, names)
    return out


@contextlib.contextmanager
def staged_dir(out: str | Path, overwrite: bool = False, names: Collection[str] = ()
               ) -> Iterator[Path]:
    """Yield an empty temporary directory beside `out`, in which the block writes the entries
    `names`; when the block ends without an error it becomes `out`, otherwise it is deleted.
    With `overwrite` it replaces an earlier output `out`: the entries that output did not write
    move into the new one. The checks of `check_destination` are made again at the end, on
    what the block wrote and under cem-train's lock, so that neither a cem-train that began
    meanwhile nor a file the user added meanwhile is replaced.

    Raises FileExistsError as `check_destination` (then or at the end, writing nothing).
    """
    out = check_destination(out, overwrite, names=names)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    os.chmod(stage, umask_mode(0o777))  # as a plain mkdir would make it
    try:
        yield stage
        written = sorted(p.name for p in stage.iterdir())
        (stage / MARKER).write_text(json.dumps(
            {"written_by": "cem_jax", "files": written,
             "note": "`--overwrite` replaces these files, and keeps any other"}, indent=1))
        with _run_lock(out):
            _install(stage, out, _kept_entries(out, overwrite, written))
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)  # (gone once installed)
        raise


def unmark_output(directory: Path) -> None:
    """Make `directory` (a run cem-train is about to train) no output of cem-export or
    cem-import: remove its marker, so that no --overwrite replaces it."""
    (directory / MARKER).unlink(missing_ok=True)


def _kept_entries(out: Path, overwrite: bool, names: Collection[str]) -> list[str]:
    """The entries of directory `out` that an output writing `names` keeps when it replaces
    `out` (those the earlier output did not write; none when `out` is empty or absent).
    Raises FileExistsError as `check_destination`."""
    entries = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if not entries:
        return []
    if (state := _training_state(out)) is not None:
        raise FileExistsError(f"{out} holds a training run ({state}): it is never replaced by "
                              f"an export or import, --overwrite or not; choose another --out")
    if not (out / MARKER).is_file():
        raise FileExistsError(f"{out} is not empty and was not written by cem-export or "
                              f"cem-import, so it is never replaced: choose another --out")
    if not overwrite:
        raise FileExistsError(f"{out} holds an earlier cem-export or cem-import output: "
                              f"choose another --out or pass --overwrite to replace it")
    entries.discard(MARKER)
    kept = sorted(entries - _earlier_output(out, entries))
    if clash := [name for name in kept if name in names]:
        raise FileExistsError(f"{out} holds {', '.join(clash)}, which the earlier cem-export or "
                              f"cem-import did not write and this one would replace: move "
                              f"{'it' if len(clash) == 1 else 'them'} elsewhere or choose "
                              f"another --out")
    return kept


def _earlier_output(out: Path, entries: set[str]) -> set[str]:
    """The `entries` of `out` its marker says the earlier output wrote. Raises
    FileExistsError when an older marker, which lists no files, leaves that unclear."""
    listed = _listed_files(out / MARKER)
    if listed is not None:
        return entries & listed
    extra = min((sorted(entries - files) for files in LEGACY_OUTPUTS), key=len)
    if extra:
        raise FileExistsError(f"{out} holds {', '.join(extra)} besides the files of an earlier "
                              f"output whose marker (of an older cem_jax) lists none, so "
                              f"--overwrite cannot tell them apart: move {', '.join(extra)} "
                              f"elsewhere or choose another --out")
    return entries


def _listed_files(marker: Path) -> set[str] | None:
    """The "files" of a marker; None for a marker of an older cem_jax (plain text)."""
    try:
        value = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    files = value.get("files") if isinstance(value, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def _training_state(directory: Path) -> str | None:
    """What shows that `directory` holds a training run: "metrics.jsonl" or "checkpoint N"
    (N > 0, the newest, complete or not); None if nothing does."""
    if (directory / "metrics.jsonl").exists():
        return "metrics.jsonl"
    checkpoints = directory / "checkpoints"  # orbax's step folders: "N", "N.orbax-...-tmp-..."
    steps = [p.name.split(".")[0] for p in checkpoints.iterdir()] if checkpoints.is_dir() else []
    newest = max((int(step) for step in steps if step.isdigit()), default=0)
    return f"checkpoint {newest}" if newest > 0 else None


@contextlib.contextmanager
def _run_lock(directory: Path) -> Iterator[None]:
    """Hold cem-train's lock on `directory/.lock` (when that file exists), so that no cem-train
    starts there meanwhile. Raises FileExistsError when a cem-train holds it."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(held_lock(directory / RUN_LOCK))
        except LockHeld as held:
            raise FileExistsError(f"{directory} is in use by cem-train ({held.holder}): a "
                                  f"training run is never replaced by an export or import; "
                                  f"choose another --out") from None
        yield


def _install(stage: Path, out: Path, kept: list[str]) -> None:
    """Rename `stage` to `out`; an existing `out` is deleted, except its entries `kept`, which
    move into the new one."""
    if not out.exists():
        stage.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent)) / "old"
    out.rename(old)
    try:
        stage.rename(out)
    except BaseException:
        old.rename(out)
        old.parent.rmdir()
        raise
    for name in kept:
        (old / name).rename(out / name)
    shutil.rmtree(old.parent)


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
