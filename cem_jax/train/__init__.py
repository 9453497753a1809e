"""Training: config sections, optimizer, compiled steps, checkpoints,
metrics, and the `cem-train` loop (see `cem_jax.train.loop`)."""

from cem_jax.train.config import TrainConfig, load_config
from cem_jax.train.loop import TrainingDiverged
from cem_jax.train.run import main, train

__all__ = ["TrainConfig", "TrainingDiverged", "load_config", "main", "train"]
