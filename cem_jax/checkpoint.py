"""Checkpoints of a run with orbax: `RUN_DIR/checkpoints/<step>/` holds

    state/   params, opt_state, step (orbax StandardSave: sharded arrays, any mesh can restore)
    meta/    the resolved config and the tokenizer's SHA-256 (JSON)

The data position is the step (`cem_jax.data.batches`: the global batch of a step is a
function of the seed and the step), so a checkpoint holds nothing per process and restores on
any process count; the `data/` item of older checkpoints (grain iterator files, one per
process) is not read.

The run directory may be local or a bucket (`gs://`): orbax writes the arrays through
TensorStore either way. Saving is asynchronous (training continues while arrays are written).
A step is complete once orbax marks it so: locally it writes the step into a temporary folder
(`N.orbax-checkpoint-tmp-*`) and renames it to `N`; a bucket has no rename, so there it writes
`N/` in place and marks it complete with `N/commit_success.txt` last. A run killed mid-save thus
leaves the previous checkpoint as the latest either way; a training start removes the partial
steps an earlier one left (orbax's `cleanup_tmp_directories`), and a save that fails for want of
space raises `CheckpointWriteError` and leaves the complete ones as they are (its partial files
are removed when the Checkpointer closes). On a bucket that stops answering, a save in flight
(its arrays being written by TensorStore) is retried by TensorStore for many minutes before
it fails (each request tried again and again, `gcs_request_retries`, which orbax gives no
setting for; left as it is), and `wait`, `close` and the next `save` wait for it; the
complete checkpoints stay as they are. An outage between saves is seen sooner: cem-train
flushes its metrics (`files`, bounded to about a minute) before each save starts, and fails
there (`cem_jax.exits`, status 1). The newest `keep` are kept. A restore first compares the
saved arrays (names, shapes, dtypes) with the state the run builds, so a checkpoint of another
structure (another cem_jax version's optimizer, say) is refused by name, not read as corrupt.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from cem_jax.data import Tokenizer, files
from cem_jax.data.storage_errors import storage_error

# What orbax writes last into a step on object storage, which has no rename.
COMMIT_MARKER = "commit_success.txt"


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be restored (corrupt, or from another config)."""


def restore_error(path: epath.Path | str, err: Exception, verb: str = "restore") -> CheckpointError:
    """The CheckpointError for orbax's failure `err` to read checkpoint `path`: the cause's
    first line (TensorStore appends its whole spec) and what to do."""
    cause = (str(err).splitlines() or [""])[0].split(" See full TensorStore")[0][:300]
    return CheckpointError(f"cannot {verb} checkpoint {path} ({type(err).__name__}: {cause})\n"
                           f"If it is corrupt, delete that step directory (the next older step "
                           f"is then used), or start a new run directory")


# errno of a write that failed for want of space (TensorStore says "[os_error_code='28']").
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written for want of space: errno ENOSPC, EDQUOT or EFBIG
    (filename: the checkpoints directory)."""


def disk_full_errno(err: BaseException | None) -> int | None:
    """ENOSPC, EDQUOT or EFBIG when `err`, or an error it came from, is a write that failed for
    want of space (an OSError, or TensorStore's words for one); else None."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            return err.errno
        if (found := re.search(r"\[os_error_code='(\d+)'\]", str(err))) and \
                int(found.group(1)) in DISK_FULL:
            return int(found.group(1))
        err = err.__cause__ or err.__context__
    return None


class _FailureEchoes(logging.Filter):
    """asyncio's task and gather results nobody retrieved, and orbax's own logs (with
    tracebacks) of a write that failed for want of space or for an object storage that could
    not be reached (the caller gets the same error, and says it in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            first = (record.getMessage().splitlines() or [""])[0]
            return not first.endswith("exception was never retrieved")
        return not (record.levelno >= logging.ERROR and record.exc_info
                    and f"{os.sep}orbax{os.sep}" in record.pathname
                    and (disk_full_errno(record.exc_info[1]) is not None
                         or storage_error(record.exc_info[1]) is not None))


def _orbax_coroutine(obj: Any) -> bool:
    return inspect.iscoroutine(obj) and f"{os.sep}orbax{os.sep}" in obj.cr_code.co_filename


def drop_failure_echoes() -> None:
    """Call before orbax reads or writes a checkpoint. A failed restore or save leaves
    TensorStore callbacks into orbax's closed event loop, orbax coroutines closed with their
    read error pending, task and gather errors nobody retrieves and, for a write that failed for
    want of space, orbax's log of it in every thread: Python prints them as dozens to hundreds
    of tracebacks around our one message (the error itself reaches the caller). From then on
    this process drops exactly those kinds (every other unraisable error and log record still
    shows)."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_failure_echoes", False):
        return

    def hook(unraisable) -> None:
        closed_loop = (isinstance(unraisable.exc_value, RuntimeError)
                       and str(unraisable.exc_value) == "Event loop is closed")
        if not (closed_loop or _orbax_coroutine(unraisable.object)):
            previous(unraisable)

    hook.drops_failure_echoes = True
    sys.unraisablehook = hook
    for name in ("asyncio", "absl"):
        logging.getLogger(name).addFilter(_FailureEchoes())


def complete_steps(directory: str) -> list[int]:
    """The steps of the complete checkpoints in `directory` (RUN_DIR/checkpoints, local or a
    URL), ascending: a folder named by its step, and on a bucket holding `COMMIT_MARKER` (see
    the module docstring). Without orbax, for what a failed run left behind."""
    return sorted(int(name) for name in files.names(directory)
                  if name.isdigit() and _complete(files.join(directory, name)))


def _complete(step_dir: str) -> bool:
    if files.is_url(step_dir):
        return files.is_file(files.join(step_dir, COMMIT_MARKER))
    return files.is_dir(step_dir)


def partial_checkpoints(directory: str) -> list[str]:
    """The paths of the partial checkpoints in `directory` (a save killed or failed): locally
    orbax's temporary folders, on a bucket the step folders without `COMMIT_MARKER`."""
    return [files.join(directory, name) for name in files.names(directory)
            if ".orbax-checkpoint-tmp" in name
            or (name.isdigit() and not _complete(files.join(directory, name)))]


def checkpoint_directory(run_dir: str) -> epath.Path:
    """`run_dir/checkpoints` (made absolute when local) as orbax takes it. Raises ValueError
    when its path holds "[" or "]": orbax reads them as a glob pattern when it joins a
    checkpoint's per-process parts, so it would write checkpoints there that can never be
    restored."""
    directory = files.join(run_dir, "checkpoints")
    if not files.is_url(directory):
        directory = os.path.abspath(directory)
    if "[" in directory or "]" in directory:
        raise ValueError(f"the run directory {directory.rsplit('/checkpoints', 1)[0]} has '[' or "
                         f"']' in its path: orbax would write checkpoints there that can never "
                         f"be restored (it reads brackets as a glob pattern); rename the folder "
                         f"or choose another run directory")
    return epath.Path(directory)


class Checkpointer:
    """Save and restore (train state, metadata) under `run_dir/checkpoints`
    (a path without brackets, `checkpoint_directory`)."""

    def __init__(self, run_dir: str, keep: int):
        drop_failure_echoes()
        self.directory = checkpoint_directory(run_dir)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True,
                                               cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        # orbax >= 0.12 removes the temporary folders of a killed save in a thread that
        # `close` does not wait for: a start stopped at once removed the run directory under
        # it, and the thread's 42-line traceback followed the one-line message. Wait for it.
        cleanup = getattr(self.manager, "_cleanup_tmp_directory_future", None)
        if cleanup is not None:
            cleanup.result()
        self.write_failed = False

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def is_complete(self, step: int) -> bool:
        """Whether step `step` is a complete checkpoint on its storage now (as
        `complete_steps` reads them)."""
        return _complete(files.join(str(self.directory), str(step)))

    def save(self, step: int, state: dict, config: dict[str, Any], tokenizer: Tokenizer
             ) -> None:
        """Start saving step `step` (returns before the arrays are written; see `wait`).
        The caller must only pass a state whose loss, gradients and parameters are finite.
        Raises CheckpointWriteError when this or the previous save failed for want of space."""
        meta = {"config": config, "tokenizer_sha256": tokenizer.sha256}
        with self._writing():
            self.manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict[str, Any]]:
        """Restore step `step` onto the shardings of `abstract_state` (ShapeDtypeStructs with
        `sharding`, from `Trainer.abstract_state`), whatever mesh and process count wrote it.
        Returns (state, meta). Raises CheckpointError naming the directory when it fails, and
        naming the differing arrays when the checkpoint's state has another structure."""
        self._check_structure(step, abstract_state)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        except Exception as err:  # orbax raises many kinds; all mean "this step is unusable"
            raise restore_error(self.directory / str(step), err) from err
        return restored["state"], restored["meta"]

    def _check_structure(self, step: int, abstract_state: dict) -> None:
        """CheckpointError unless step `step` saved the arrays of `abstract_state` (same
        names, shapes and dtypes); a metadata read that fails is left to the restore."""
        handler = ocp.StandardCheckpointHandler()
        try:
            saved = _arrays(handler.metadata(self.directory / str(step) / "state").tree)
        except Exception:  # unreadable metadata: the restore reports the checkpoint corrupt
            return
        finally:
            handler.close()
        built = _arrays(abstract_state)
        if differ := sorted(k for k in saved.keys() | built.keys() if saved.get(k) != built.get(k)):
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds a train state unlike the one "
                f"this run builds ({len(differ)} arrays differ, first {differ[0]}: saved "
                f"{saved.get(differ[0], 'none')}, built {built.get(differ[0], 'none')}): it was "
                f"written by another version of cem_jax or another config; resume it with the "
                f"ones that wrote it, or give another run.dir")

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk; raises CheckpointWriteError
        when one failed for want of space."""
        with self._writing():
            self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager's threads (raises as `wait`). After a
        save that failed for want of space, its partial files are removed (process 0): the
        complete checkpoints are all kept."""
        try:
            with self._writing():
                self.manager.close()
        finally:
            if self.write_failed and jax.process_index() == 0:
                for partial in partial_checkpoints(str(self.directory)):
                    files.remove_tree(partial)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Orbax's error for a write that failed for want of space (one line of TensorStore's
        spec dump) as a CheckpointWriteError; any other error as it is."""
        try:
            yield
        except Exception as err:
            code = disk_full_errno(err)
            if code is None:
                raise
            self.write_failed = True
            raise CheckpointWriteError(code, os.strerror(code), str(self.directory)) from err


def _arrays(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """{dotted path ("opt_state.1.0.mu.embed", as orbax names saved arrays): (shape, dtype)}
    of the array leaves of `tree` (arrays, ShapeDtypeStructs or orbax ArrayMetadata)."""
    def part(key) -> str:
        return str(next(getattr(key, a) for a in ("key", "idx", "name") if hasattr(key, a)))

    return {".".join(part(k) for k in path): (tuple(leaf.shape), str(leaf.dtype))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
