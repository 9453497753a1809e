"""Training: the compiled steps, metrics, the `cem-train` loop (see `cem_jax.train.loop`) and its
command; the run's config sections, optimizer and checkpoints are `cem_jax.train_config`,
`cem_jax.optim` and `cem_jax.checkpoint` (the run reader and the exports use them too).

The names below are imported when first used (they import JAX), so that `cem-train` (`main`)
catches SIGINT and SIGTERM before JAX loads (`cem_jax.exits`)."""

import importlib

_EXPORTS = {"TrainConfig": "cem_jax.train_config", "load_config": "cem_jax.train_config",
            "TrainingDiverged": "cem_jax.train.loop", "train": "cem_jax.train.run"}

__all__ = ["TrainConfig", "TrainingDiverged", "load_config", "main", "train"]


def main(argv=None) -> int:
    """`cem-train` (`cem_jax.train.command.run_command`); returns its exit status
    (`cem_jax.exits.ExitStatus`). The arguments are parsed before JAX is imported (`--help`
    and a usage error, status 2, answer at once); SIGINT and SIGTERM are caught from the
    start: one that comes while JAX is imported stops it right after the imports."""
    from cem_jax import exits
    from cem_jax.arguments import parse_train_args

    with exits.caught("cem-train"):
        args = parse_train_args(argv)
        from cem_jax.train.command import run_command

        return run_command(args)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cem_jax.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
