"""Load what a training run left: `RUN_DIR/config.yaml`, `RUN_DIR/tokenizer.model` and the
parameters of one checkpoint `RUN_DIR/checkpoints/<step>/state` (written by
`cem_jax.train.checkpoint.Checkpointer`).

    run = load_run("runs/cem")             # newest checkpoint
    logits = run.model()(tokens)           # the CEMTransformer holding the checkpoint

Only the parameters are restored (on the local devices, replicated); the optimizer state is
read as the checkpoint's structure demands and dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from cem_jax.data import Tokenizer, load_tokenizer
from cem_jax.model import CEMTransformer
from cem_jax.train.checkpoint import Checkpointer, CheckpointError
from cem_jax.train.config import MeshConfig, TrainConfig, load_config, save_config
from cem_jax.train.optim import make_optimizer
from cem_jax.train.sharding import make_mesh
from cem_jax.train.step import Trainer


class RunDirError(FileNotFoundError):
    """A run directory lacks a file it needs (config, tokenizer or a checkpoint)."""


@dataclasses.dataclass
class Run:
    """A loaded run: its resolved `config`, `tokenizer`, checkpoint `step` and `params` (the
    model's pure parameter dict, fp32 arrays, blocks stacked on L when `scan_layers`)."""

    directory: Path
    config: TrainConfig
    tokenizer: Tokenizer
    step: int
    params: dict

    def model(self) -> CEMTransformer:
        """The NNX model holding `params`."""
        return model_from_params(self.config.model, self.params)


def model_from_params(cfg, params: dict) -> CEMTransformer:
    """A `CEMTransformer` of `ModelConfig` cfg holding the pure dict `params` (as
    `nnx.to_pure_dict(nnx.state(model))` gives). Raises ValueError if the tree differs."""
    model = nnx.eval_shape(lambda: CEMTransformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    want, got = _shapes(nnx.to_pure_dict(state)), _shapes(params)
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            raise ValueError(f"parameter {name}: the config expects (shape, dtype) "
                             f"{want.get(name, 'nothing')}, got {got.get(name, 'nothing')}")
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _shapes(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(path): (tuple(x.shape), str(x.dtype))
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def available_steps(run_dir: str | Path) -> list[int]:
    """The checkpoint steps under `run_dir/checkpoints` (complete ones only), ascending."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def load_run(run_dir: str | Path, step: int | None = None) -> Run:
    """Load config, tokenizer and the parameters of checkpoint `step` (None: the newest).

    Raises:
      RunDirError: no config.yaml, tokenizer.model or checkpoint (or no checkpoint `step`).
      CheckpointError: the checkpoint cannot be read (corrupt, partial, other config), or the
        run's tokenizer.model is not the one the checkpoint was trained with.
      ValueError: config.yaml is invalid.
    """
    run_dir = Path(run_dir)
    for name in ("config.yaml", "tokenizer.model"):
        if not (run_dir / name).is_file():
            raise RunDirError(f"{run_dir / name} is missing: {run_dir} is not a run directory")
    cfg = load_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(run_dir / "tokenizer.model", cfg.model.vocab_size)
    steps = available_steps(run_dir)
    if not steps:
        raise RunDirError(f"{run_dir / 'checkpoints'} holds no checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise RunDirError(f"{run_dir} has no checkpoint of step {step} (it has {steps})")
    params, meta = _restore(run_dir / "checkpoints", step, cfg)
    if meta.get("tokenizer_sha256") != tokenizer.sha256:
        raise CheckpointError(f"{run_dir / 'tokenizer.model'} is not the tokenizer checkpoint "
                              f"{step} was trained with (SHA-256 differs)")
    return Run(run_dir, cfg, tokenizer, step, params)


def quiet_checkpoint_logs() -> None:
    """For the command-line tools: hide orbax's informational warnings (e.g. that a
    read-only manager does not save), which go to the "absl" logger."""
    logging.getLogger("absl").setLevel(logging.ERROR)


def _restore(directory: Path, step: int, cfg: TrainConfig) -> tuple[dict, dict]:
    """The params and meta of checkpoint `step`, restored replicated on the local devices."""
    mesh = make_mesh(MeshConfig(data=-1), jax.local_devices())
    abstract = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, mesh).abstract_state()
    manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(
        create=False, read_only=True))
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as err:  # orbax raises many kinds; all mean "this step is unusable"
        raise CheckpointError(f"cannot read checkpoint {directory / str(step)}: "
                              f"{type(err).__name__}: {err}") from err
    finally:
        manager.close()
    return jax.device_get(restored["state"]["params"]), restored["meta"]


def write_run(directory: str | Path, cfg: TrainConfig, params: dict, tokenizer: Tokenizer,
              step: int = 0) -> Path:
    """Write a run directory that `load_run` reads and `cem-train` resumes: config.yaml,
    tokenizer.model and checkpoint `step` holding `params` (a model's pure dict), a fresh
    optimizer state and the data iterator at its start. Raises ValueError if `params` do not
    fit `cfg.model`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_from_params(cfg.model, params)  # checks names, shapes and dtypes
    tokenizer.save(directory / "tokenizer.model")
    save_config(cfg, directory / "config.yaml")
    params = jax.tree.map(jnp.asarray, params)
    state = {"params": params, "opt_state": make_optimizer(cfg.optimizer, cfg.run.steps)
             .init(params), "step": jnp.asarray(step, jnp.int32)}
    checkpointer = Checkpointer(directory, keep=cfg.run.keep_checkpoints)
    start = iter(grain.MapDataset.range(1).to_iter_dataset())  # iterator state {"next_index": 0}
    checkpointer.save(step, state, start, cfg.to_dict(), tokenizer)
    checkpointer.close()
    return directory
