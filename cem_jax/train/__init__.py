"""Training: config sections, mesh and sharding, optimizer, compiled steps, checkpoints,
metrics, sampling, and the `cem-train` loop (see `cem_jax.train.loop`)."""

from cem_jax.train.config import TrainConfig, load_config
from cem_jax.train.loop import TrainingDiverged, evaluate, main, train

__all__ = ["TrainConfig", "TrainingDiverged", "evaluate", "load_config", "main", "train"]
