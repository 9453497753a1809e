"""Checkpoints of a run with orbax: `RUN_DIR/checkpoints/<step>/` holds

    state/   params, opt_state, step (orbax StandardSave: sharded arrays, any mesh can restore)
    meta/    the resolved config and the tokenizer's SHA-256 (JSON)

The data position is the step (`cem_jax.data.pipeline`: the global batch of a step is a
function of the seed and the step), so a checkpoint holds nothing per process and restores on
any process count; the `data/` item of older checkpoints (grain iterator files, one per
process) is not read.

Saving is asynchronous (training continues while arrays are written); orbax writes each step
into a temporary directory and renames it when complete, so a run killed mid-save leaves the
previous checkpoint as the latest. The newest `keep` are kept. A restore first compares the
saved arrays (names, shapes, dtypes) with the state the run builds, so a checkpoint of another
structure (another cem_jax version's optimizer, say) is refused by name, not read as corrupt.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from cem_jax.data import Tokenizer


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be restored (corrupt, or from another config)."""


def restore_error(path: Path, err: Exception, verb: str = "restore") -> CheckpointError:
    """The CheckpointError for orbax's failure `err` to read checkpoint `path`: the cause's
    first line (TensorStore appends its whole spec) and what to do."""
    cause = (str(err).splitlines() or [""])[0].split(" See full TensorStore")[0][:300]
    return CheckpointError(f"cannot {verb} checkpoint {path} ({type(err).__name__}: {cause})\n"
                           f"If it is corrupt, delete that step directory (the next older step "
                           f"is then used), or start a new run directory")


class _FailedRestoreEchoes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Task exception was never retrieved")


def drop_failed_restore_echoes() -> None:
    """Call before an orbax restore. A failed one leaves TensorStore callbacks into orbax's
    closed event loop and task errors nobody retrieves, which Python prints as dozens of
    tracebacks repeating the cause around our one-line CheckpointError: from then on this
    process drops exactly those two kinds (every other unraisable error and asyncio record
    still shows)."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop", False):
        return

    def hook(unraisable) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_FailedRestoreEchoes())


def checkpoint_directory(run_dir: str | Path) -> Path:
    """The absolute `run_dir/checkpoints`. Raises ValueError when its path holds "[" or "]":
    orbax reads them as a glob pattern when it joins a checkpoint's per-process parts, so it
    would write checkpoints there that can never be restored."""
    directory = (Path(run_dir) / "checkpoints").absolute()
    if "[" in str(directory) or "]" in str(directory):
        raise ValueError(f"the run directory {Path(run_dir).absolute()} has '[' or ']' in its "
                         f"path: orbax would write checkpoints there that can never be restored "
                         f"(it reads brackets as a glob pattern); rename the folder or choose "
                         f"another run directory")
    return directory


class Checkpointer:
    """Save and restore (train state, metadata) under `run_dir/checkpoints`
    (a path without brackets, `checkpoint_directory`)."""

    def __init__(self, run_dir: Path, keep: int):
        self.directory = checkpoint_directory(run_dir)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state: dict, config: dict[str, Any], tokenizer: Tokenizer
             ) -> None:
        """Start saving step `step` (returns before the arrays are written; see `wait`).
        The caller must only pass a state whose loss, gradients and parameters are finite."""
        meta = {"config": config, "tokenizer_sha256": tokenizer.sha256}
        self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict[str, Any]]:
        """Restore step `step` onto the shardings of `abstract_state` (ShapeDtypeStructs with
        `sharding`, from `Trainer.abstract_state`), whatever mesh and process count wrote it.
        Returns (state, meta). Raises CheckpointError naming the directory when it fails, and
        naming the differing arrays when the checkpoint's state has another structure."""
        drop_failed_restore_echoes()
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
        """Block until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager's threads."""
        self.manager.close()


def _arrays(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """{dotted path ("opt_state.1.0.mu.embed", as orbax names saved arrays): (shape, dtype)}
    of the array leaves of `tree` (arrays, ShapeDtypeStructs or orbax ArrayMetadata)."""
    def part(key) -> str:
        return str(next(getattr(key, a) for a in ("key", "idx", "name") if hasattr(key, a)))

    return {".".join(part(k) for k in path): (tuple(leaf.shape), str(leaf.dtype))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
