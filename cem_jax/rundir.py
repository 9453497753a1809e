"""Load what a training run left (RUN_DIR local, or a URL such as gs://bucket/run):
`RUN_DIR/config.yaml`, its tokenizer (`RUN_DIR/tokenizer.model`,
or `tokenizer.json` beside `tokenizer_config.json`: `find_tokenizer`) and the parameters of
one checkpoint `RUN_DIR/checkpoints/<step>/state` (written by
`cem_jax.checkpoint.Checkpointer`).

    run = load_run("runs/cem")             # newest checkpoint
    logits = run.model()(tokens).logits    # the CEMTransformer holding the checkpoint

Reading a run restores the parameters only (an orbax partial restore onto the host: no
optimizer state, no `Trainer`); `write_run`, which makes a resumable run, adds a fresh optimizer
state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from cem_jax.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_directory,
    drop_failure_echoes,
    restore_error,
)
from cem_jax.data import Tokenizer, files, load_tokenizer
from cem_jax.data.tokenizers import find_tokenizer
from cem_jax.model import CEMTransformer, model_from_params
from cem_jax.optim import make_optimizer
from cem_jax.train_config import TrainConfig, load_config, save_config


class RunDirError(FileNotFoundError):
    """A run directory lacks a file it needs (config, tokenizer or a checkpoint)."""


@dataclasses.dataclass
class Run:
    """A loaded run: its resolved `config`, `tokenizer`, checkpoint `step` and `params` (the
    model's pure parameter dict, fp32 arrays, blocks stacked on L when `scan_layers`)."""

    directory: str
    config: TrainConfig
    tokenizer: Tokenizer
    step: int
    params: dict

    def model(self) -> CEMTransformer:
        """The NNX model holding `params`."""
        return model_from_params(self.config.model, self.params)


def available_steps(run_dir: str) -> list[int]:
    """The complete checkpoint steps under `run_dir/checkpoints`, ascending (orbax's own
    listing: a step still being written, or torn by a kill, is not one)."""
    directory = checkpoint_directory(files.local(str(run_dir)))
    if not files.is_dir(str(directory)):
        return []
    with _read_only_manager(directory) as manager:
        return sorted(manager.all_steps())


def check_run_dir(run_dir: str) -> str:
    """`run_dir` (local: `~` expanded) when it holds a run's config.yaml; else RunDirError in
    the words every command that reads a run uses (cem-sample, cem-eval, cem-export)."""
    run_dir = files.local(str(run_dir))
    config_path = files.join(run_dir, "config.yaml")
    if not files.is_file(config_path):
        if not files.is_dir(run_dir):
            raise RunDirError(f"{run_dir} does not exist: give a run directory cem-train wrote")
        raise RunDirError(f"{config_path} is missing: {run_dir} is not a run directory")
    return run_dir


def load_run(run_dir: str, step: int | None = None) -> Run:
    """Load config, tokenizer and the parameters of checkpoint `step` (None: the newest).

    Raises:
      RunDirError: no such directory, or no config.yaml, tokenizer or checkpoint (or no
        checkpoint `step`).
      CheckpointError: the checkpoint cannot be read (corrupt, partial, other config), or the
        run's tokenizer is not the one the checkpoint was trained with.
      ValueError: config.yaml is invalid, or the tokenizer has more ids than the model.
    """
    run_dir = check_run_dir(run_dir)
    config_path = files.join(run_dir, "config.yaml")
    try:
        tokenizer_path = find_tokenizer(run_dir)
    except FileNotFoundError as err:
        raise RunDirError(str(err)) from None
    cfg = load_config(config_path)
    tokenizer = load_tokenizer(tokenizer_path, cfg.model.vocab_size)
    steps = available_steps(run_dir)
    if not steps:
        raise RunDirError(f"{files.join(run_dir, 'checkpoints')} holds no checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise RunDirError(f"{run_dir} has no checkpoint of step {step} (it has {steps})")
    params, meta = _restore_params(checkpoint_directory(run_dir), step, cfg)
    if meta.get("tokenizer_sha256") != tokenizer.sha256:
        raise CheckpointError(f"{tokenizer_path} is not the tokenizer checkpoint {step} was "
                              f"trained with (SHA-256 differs)")
    return Run(run_dir, cfg, tokenizer, step, params)


def quiet_checkpoint_logs() -> None:
    """For the command-line tools: hide orbax's informational warnings, which go to the "absl"
    logger."""
    logging.getLogger("absl").setLevel(logging.ERROR)


@contextlib.contextmanager
def _read_only_manager(directory: epath.Path) -> Iterator[ocp.CheckpointManager]:
    """An orbax manager that only reads `directory`, without the warnings orbax logs about
    read-only managers (which say nothing to someone loading a run)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(max(level, logging.ERROR))
    try:
        manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            create=False, read_only=True))
    finally:
        absl.setLevel(level)
    try:
        yield manager
    finally:
        manager.close()


def _restore_params(directory: epath.Path, step: int, cfg: TrainConfig) -> tuple[dict, dict]:
    """The parameters (numpy, on the host) and meta of checkpoint `step`: an orbax partial
    restore of the state's "params" subtree (the optimizer state is not read)."""
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: CEMTransformer(cfg.model, rngs=nnx.Rngs(0)))))
    target = {"params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)}
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=device), target)
    drop_failure_echoes()
    with _read_only_manager(directory) as manager:
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args, partial_restore=True),
                meta=ocp.args.JsonRestore()))
        except ValueError as err:
            if "not compatible with the stored shape" not in str(err):
                raise restore_error(directory / str(step), err, "read") from err
            raise CheckpointError(_other_model(directory / str(step), str(err))) from None
        except Exception as err:  # orbax raises many kinds; all mean "this step is unusable"
            raise restore_error(directory / str(step), err, "read") from err
    params = restored["state"]["params"]
    absent = [jax.tree_util.keystr(path) for path, leaf in
              jax.tree_util.tree_flatten_with_path(params)[0]
              if isinstance(leaf, jax.ShapeDtypeStruct)]
    if absent:
        raise CheckpointError(_other_model(directory / str(step), f"it has no {absent[0]}"))
    return jax.device_get(params), restored["meta"]


def _other_model(path: epath.Path, what: str) -> str:
    """The message for a checkpoint whose parameters are not those the config's model builds."""
    what = (what.splitlines() or [""])[0].split(" See full TensorStore")[0][:300]
    return (f"checkpoint {path} holds other parameters than the model of config.yaml builds "
            f"({what}): the model section, or a sub-layer kind's parameters in the module its "
            f"imports names, changed since the run was written; load it with the code that "
            f"wrote it")


def write_run(directory: str, cfg: TrainConfig, params: dict, tokenizer: Tokenizer,
              step: int = 0) -> str:
    """Write a run directory that `load_run` reads and `cem-train` resumes: config.yaml, the
    tokenizer's files (`Tokenizer.files`) and checkpoint `step` holding `params` (a model's
    pure dict), a fresh optimizer state and the step. Raises ValueError
    if `params` do not fit `cfg.model`."""
    directory = files.local(str(directory))
    files.make_dirs(directory)
    model_from_params(cfg.model, params)  # checks names, shapes and dtypes
    tokenizer.save(files.join(directory, tokenizer.file_name))
    save_config(cfg, files.join(directory, "config.yaml"))
    params = jax.tree.map(jnp.asarray, params)
    state = {"params": params, "opt_state": make_optimizer(cfg.optimizer, cfg.run.steps)
             .init(params), "step": jnp.asarray(step, jnp.int32)}
    checkpointer = Checkpointer(directory, keep=cfg.run.keep_checkpoints)
    checkpointer.save(step, state, cfg.to_dict(), tokenizer)
    checkpointer.close()
    return directory
