"""`cem-train`: train a CEM (or Llama) language model on a device mesh, resumably.

    cem-train --config configs/shakespeare_cem.yaml run.steps=200 optimizer.lr=3e-3
    python -m cem_jax.cli.train --config configs/shakespeare_llama.yaml run.dir=runs/llama
    cem-train --config configs/cem_full_100m.yaml --dry-run   # compile only: memory, FLOPs
    cem-train --config configs/cem_full_100m.yaml --dry-run --target tpu-v5p-32   # libtpu compiles

The command reads the config, then trains (`cem_jax.train.run.train`: what a run directory
holds, resuming, signals, divergence) or dry-runs (`cem_jax.train.dry_run`). It ends with one of
the exit statuses of `cem_jax.exits.ExitStatus`, after one line saying why unless it finished (a
crash: its traceback, then the line): 0 finished, 1 crashed (retry), 2 cannot run as configured,
3 diverged, 75 stopped before its last step for a reason a relaunch gets past (SIGTERM or
SIGINT, a lost peer process, object storage unreachable, an abandoned save: relaunch to
resume). The command trains in a child process that it watches (`cem_jax.cli.supervise`), so
that a fault ending the JAX process from inside still ends it in one line.
Messages go through `logging` (the "cem_jax" loggers; `cem-train` prints them on stdout, from
process 0 only, warnings from every process, prefixed with the process index in multi-host
runs).

The arguments are parsed before JAX is imported (`--help` and a usage error, status 2, answer
at once), so the training stack is imported inside the functions that run it; SIGINT and
SIGTERM are caught from the start: one that comes while JAX is imported stops the run right
after the imports.
"""

from __future__ import annotations

import argparse
import errno
import os
import posixpath
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cem_jax import exits
from cem_jax.cli import supervise
from cem_jax.cli.arguments import parse_train_args
from cem_jax.data import files
from cem_jax.data.storage_errors import storage_error
from cem_jax.exits import ExitStatus, StoppedBySignal

if TYPE_CHECKING:
    from cem_jax.train_config import TrainConfig

# OSErrors that say the run cannot go on as configured (a missing or unreadable file, a full
# disk; one without errno is one of our own messages); any other (EIO, ENOTCONN: a lost mount)
# is a crash, retried.
_CANNOT_RUN_ERRNOS = {None, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
                      errno.EROFS, errno.ENAMETOOLONG, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# What to do when a write in run.dir failed for want of space.
_DISK_FULL_ADVICE = {errno.ENOSPC: "free space there or give another run.dir",
                     errno.EDQUOT: "free space in your quota or give another run.dir",
                     errno.EFBIG: "raise the file size limit (ulimit -f) or give another "
                                  "run.dir"}


def console() -> int:
    """The `cem-train` command (and `python -m cem_jax.cli.train`): parses the arguments (a
    usage error or --help answers here), then trains in a child process that it watches
    (`cem_jax.cli.supervise`); in that child, `main`."""
    if os.environ.pop(supervise.WORKER, None) == "1":
        return main()
    parse_train_args(sys.argv[1:])
    return supervise.supervise(sys.argv[1:])


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-train` in this process; returns its exit status (`ExitStatus`: 0 finished, 1
    crashed, 2 cannot run as configured, 3 diverged, 75 stopped for a reason a relaunch gets
    past), after one line on stderr saying why it ended (a crash prints its traceback first)."""
    with exits.caught("cem-train"):
        return run_command(parse_train_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """`main` on parsed arguments (`cem_jax.cli.arguments.parse_train_args`)."""
    from cem_jax.train_config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
        check_config_location(args.config, args.overrides, cfg)
    except Exception as err:  # a config on a bucket: a storage failure first
        if (said := storage_error(err)) is not None:  # it may come back: relaunch
            return exits.report(ExitStatus.STOPPED, said)
        if not isinstance(err, (ValueError, FileNotFoundError)):
            raise
        return exits.report(ExitStatus.CANNOT_RUN, f"configuration error: {err}")
    if args.target is not None and args.target.startswith("tpu-"):
        # A dry run for a TPU target uses no local accelerator (libtpu gives the target's
        # devices); off a TPU VM, JAX would try libtpu as a backend and print its warnings.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from cem_jax.train.dry_run import dry_run  # JAX loads here, once the config is good
    from cem_jax.train.logs import log_to_stdout
    from cem_jax.train.run import train

    log_to_stdout()
    with exits.caught("cem-train"):
        try:
            if args.dry_run:
                dry_run(cfg, target=args.target, compile=not args.lower_only)
                exits.check()
            else:
                train(cfg)
        except StoppedBySignal as stop:  # one that says nothing more came before any step
            where = ("during the dry run" if args.dry_run
                     else "before the first step; nothing was trained")
            return exits.report(ExitStatus.STOPPED, str(stop if stop.where else stop.at(where)))
        except Exception as err:  # every ending is one of the documented statuses
            return _failed(err, cfg.run.dir)
    return ExitStatus.FINISHED


def _failed(err: Exception, run_dir: str) -> int:
    """Print cem-train's last line for the error that ended it (a crash: its traceback first,
    except a storage failure, `storage_error`: that line alone); returns the exit status
    (`ExitStatus`)."""
    import jax

    from cem_jax.checkpoint import CheckpointError, complete_steps
    from cem_jax.data.shakespeare import FetchError
    from cem_jax.memory import is_out_of_memory
    from cem_jax.train import watchdog
    from cem_jax.train.lock import RunDirInUse
    from cem_jax.train.loop import TrainingDiverged

    watchdog.leave_if_peer_lost(type(err), err, err.__traceback__)
    if isinstance(err, TrainingDiverged):
        return exits.report(ExitStatus.DIVERGED, f"diverged: {err}")
    if isinstance(err, OSError) and err.errno in _DISK_FULL_ADVICE:
        steps = complete_steps(files.join(run_dir, "checkpoints"))
        kept = (f"the newest checkpoint, step {steps[-1]}, is kept" if steps
                else "no checkpoint was written yet")
        return exits.report(ExitStatus.CANNOT_RUN, f"error: cannot write {err.filename}: "
                            f"{err.strerror}; {_DISK_FULL_ADVICE[err.errno]} ({kept})")
    if isinstance(err, jax.errors.JaxRuntimeError) and is_out_of_memory(err):
        return exits.report(
            ExitStatus.CANNOT_RUN, f"error: the step needs more memory than the device has "
            f"({str(err).splitlines()[0]}); lower data.batch_size or data.seq_len, raise "
            f"optimizer.accumulation_steps or set model.remat=full (`cem-train --dry-run` "
            f"estimates the activations). Checkpoints already written are kept.")
    if (said := storage_error(err)) is not None:  # TensorStore's are ValueErrors
        return exits.report(ExitStatus.STOPPED, f"{watchdog.who()}, during "
                            f"{watchdog.phase()}: {said}")  # one line: the storage may come back
    if isinstance(err, (RunDirInUse, CheckpointError, FetchError, ValueError)) or (
            isinstance(err, OSError) and err.errno in _CANNOT_RUN_ERRNOS):
        return exits.report(ExitStatus.CANNOT_RUN, f"error: {err}")
    traceback.print_exception(err)
    cause = (str(err).splitlines() or [""])[0][:300]
    return exits.report(ExitStatus.CRASHED, f"crashed: {type(err).__name__}: {cause}")


def check_config_location(config: str | None, overrides: Sequence[str],
                          cfg: TrainConfig) -> None:
    """A config read from inside a run directory (a config.yaml beside that run's checkpoints,
    tokenizer or metrics) trains that directory: ValueError when it names another run.dir (the
    run was moved or copied) and no `run.dir=` override says which one is meant."""
    from cem_jax.data.tokenizers import FILE_NAMES

    if config is None or any(o.startswith("run.dir=") for o in overrides):
        return
    path = files.local(config)
    home = path.rsplit("/", 1)[0] if files.is_url(path) else str(Path(path).parent)
    if posixpath.basename(path) != "config.yaml" or not any(
            files.exists(files.join(home, name)) for name in ("checkpoints", *FILE_NAMES.values(),
                                                               "metrics.jsonl")):
        return
    same = cfg.run.dir.rstrip("/") == home.rstrip("/") if files.is_url(home) else \
        Path(cfg.run.dir).resolve() == Path(home).resolve()
    if not same:
        raise ValueError(f"{path} is the config of the run directory {home}, but it names "
                         f"run.dir {cfg.run.dir} (was the run moved or copied?): add "
                         f"run.dir={home} to train the run in {home}, or run.dir={cfg.run.dir} "
                         f"to train the one there")


if __name__ == "__main__":
    sys.exit(console())
