"""Helpers of the export tests."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.model import CEMTransformer


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Parameters of the model's shapes (numpy fp32): weights normal(0, 0.3), norm scales
    1 + normal(0, 0.1), preconditioner ρ softplus⁻¹(1) + normal(0, 0.3): far from the
    0 / identity starts (DPLR diagonals, preconditioners), with logits of order 1."""
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


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    """fp32 logits [B,T,V] of a transformers causal LM on int ids [B,T]."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
