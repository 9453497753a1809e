"""The forward of the train and eval steps: the model's hidden states under the mesh, and the
loss in chunks (`cem_jax.loss`); the compiled eval step that training's validation and
`cem-eval` share.

    loss_sum = batch_cross_entropy(cfg, params, batch, mesh, weights)   # Σ weights·CE, nats
    eval_step = make_eval_step(cfg, mesh)     # (params, batch) → (Σ weights·CE, Σ weights)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from cem_jax.config import ModelConfig
from cem_jax.loss import cross_entropy
from cem_jax.model import abstract_params, model_from_params
from cem_jax.sharding import batch_sharding, param_shardings, replicated

Batch = dict[str, jax.Array]
EvalStep = Callable[[dict, Batch], tuple[jax.Array, jax.Array]]


def batch_cross_entropy(cfg: ModelConfig, params: dict, batch: Batch, mesh: jax.sharding.Mesh,
                        weights: jax.Array) -> jax.Array:
    """Σ weights · next-token cross entropy (nats, fp32 scalar) of int32 [B,T]
    `batch["targets"]` given `inputs`, `positions`, `segment_ids`; weights fp32 [B,T]. The
    forward of the train and eval steps: traced under `mesh` so that the model's activations
    are split over its batch axes (`cem_jax.sharding.constrain`), the logits taken in
    `cfg.loss_chunks` chunks of the sequence (`cem_jax.loss.cross_entropy`: never the whole
    [B,T,V])."""
    model = model_from_params(cfg, params)  # built outside the mesh: its names are logical
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        h = model(batch["inputs"], batch["positions"], batch["segment_ids"], logits=False).hidden
        return cross_entropy(h, model.output_head(), batch["targets"], weights,
                             cfg.loss_chunks)


def make_eval_step(cfg: ModelConfig, mesh: jax.sharding.Mesh,
                   params_sharding=None) -> EvalStep:
    """The compiled eval step: (params, batch with "weights" fp32 [B,T]) → (Σ weights · cross
    entropy in nats, Σ weights), fp32 scalars replicated on `mesh`. `params_sharding`: the
    parameters' shardings (default: by their logical names on `mesh`)."""
    if params_sharding is None:
        params_sharding = param_shardings(*abstract_params(cfg), mesh)
    batch = {k: batch_sharding(mesh) for k in ("inputs", "targets", "segment_ids", "positions",
                                               "weights")}

    def step(params, batch):
        return (batch_cross_entropy(cfg, params, batch, mesh, batch["weights"]),
                jnp.sum(batch["weights"]))

    return jax.jit(step, in_shardings=(params_sharding, batch), out_shardings=replicated(mesh))
