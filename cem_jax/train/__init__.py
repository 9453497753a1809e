"""Training: the compiled steps, metrics and the step loop (`cem_jax.train.loop`), started by
`train(cfg, hooks=...)` (`cem_jax.train.run`); the command `cem-train` is `cem_jax.cli.train`.
The run's config sections, optimizer and checkpoints are `cem_jax.train_config`,
`cem_jax.optim` and `cem_jax.checkpoint` (the run reader and the exports use them too).

The names below are imported when first used: `import cem_jax.train` loads no JAX."""

import importlib

_EXPORTS = {"TrainConfig": "cem_jax.train_config", "load_config": "cem_jax.train_config",
            "TrainingDiverged": "cem_jax.train.loop", "train": "cem_jax.train.run"}

__all__ = ["TrainConfig", "TrainingDiverged", "load_config", "train"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cem_jax.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
