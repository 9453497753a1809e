"""Helpers of the decoding tests: tiny models with parameters far from their initialisation."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.model import CEMTransformer

TINY = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=32)
BASELINE = dict(tie_attention=False, tie_mlp=False, preconditioner="none")


def tiny_config(**overrides) -> ModelConfig:
    """A tiny ModelConfig (V=64, D=16, L=2, H=2, F=32) with `overrides`."""
    return ModelConfig(**{**TINY, **overrides})


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Parameters of the model's shapes (numpy fp32): weights normal(0, 0.3), norm scales
    1 + normal(0, 0.1), preconditioner ρ softplus⁻¹(1) + normal(0, 0.3), DPLR diagonals
    normal(0, 0.3): far from the 0 / identity starts, with logits of order 1. (Made from the
    abstract model: creating a model eagerly takes seconds.)"""
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: CEMTransformer(cfg, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(seed)

    def draw(path, a):
        noise = rng.normal(size=a.shape).astype(np.float32)
        name = path[-1].key
        if name == "scale":
            return 1 + 0.1 * noise
        return (math.log(math.e - 1) if name == "rho" else 0.0) + 0.3 * noise

    return jax.tree_util.tree_map_with_path(draw, abstract)
