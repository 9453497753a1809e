"""The train state and the compiled steps.

The train state is a plain pytree {"params": nested dict of arrays (the model's `nnx.Param`s),
"opt_state": the optax state, "step": int32 scalar (optimizer steps taken)}; `Trainer` holds its
mesh shardings and the jitted steps:

    trainer = Trainer(model_cfg, opt_cfg, total_steps, mesh)
    state = trainer.init(seed)                       # sharded on the mesh
    state = trainer.init_from_params(nnx.to_pure_dict(nnx.state(model)))   # or a model in hand
    state, metrics = trainer.train_step(state, batch)   # state donated
    nnx.update(model, state["params"])               # back into the model (a notebook's)
    loss_sum, weight_sum = trainer.eval_step(state["params"], batch)   # `cem_jax.evaluate`'s

The model runs under the mesh (`cem_jax.forward.batch_cross_entropy`), so its activations stay
split over the batch axes whatever the parameters' sharding (`cem_jax.sharding.constrain`).

Loss: mean next-token cross entropy in nats (fp32 logits, taken with their gradient in
`model.loss_chunks` chunks of the sequence: `cem_jax.loss`). With `accumulation_steps` A, the
batch [B,T] is dealt into A micro-batches [B/A,T] (rows a, a+A, a+2A, ..., so every device holds
part of each) and `lax.scan` sums their gradients: the step equals one on the whole batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from cem_jax.config import ModelConfig
from cem_jax.forward import batch_cross_entropy, make_eval_step
from cem_jax.model import CEMTransformer, abstract_params
from cem_jax.optim import check_trainable, learning_rate, make_optimizer
from cem_jax.sharding import batch_sharding, param_shardings, replicated
from cem_jax.train_config import BATCH_AXES, OptimizerConfig

Batch = dict[str, jax.Array]
TRAIN_KEYS = ("inputs", "targets", "segment_ids", "positions")


class Trainer:
    """Compiled, sharded train and eval steps of one model and optimizer on one mesh.

    Attributes: optimizer (optax), learning_rate (its schedule), state_shardings (pytree of
    `NamedSharding` like the train state), mesh. Raises ValueError for a `model.param_dtype`
    the optimizer cannot train (bfloat16: `cem_jax.optim.check_trainable`).
    """

    def __init__(self, model_cfg: ModelConfig, opt_cfg: OptimizerConfig, total_steps: int,
                 mesh: jax.sharding.Mesh):
        check_trainable(model_cfg)
        self.model_cfg, self.mesh = model_cfg, mesh
        self.accumulation = opt_cfg.accumulation_steps
        self.optimizer = make_optimizer(opt_cfg, total_steps)
        self.learning_rate = learning_rate(opt_cfg, total_steps)
        params, specs = abstract_params(model_cfg)
        p_shard = param_shardings(params, specs, mesh)
        opt_shapes = jax.eval_shape(self.optimizer.init, params)
        opt_shard = optax.tree_map_params(self.optimizer, lambda _, s: s, opt_shapes, p_shard,
                                          transform_non_params=lambda _: replicated(mesh))
        self.state_shardings = {"params": p_shard, "opt_state": opt_shard,
                                "step": replicated(mesh)}
        batch_shard = {k: batch_sharding(mesh) for k in TRAIN_KEYS}
        self.train_step = jax.jit(self._train_step, donate_argnums=0,
                                  in_shardings=(self.state_shardings, batch_shard),
                                  out_shardings=(self.state_shardings, replicated(mesh)))
        self.eval_step = make_eval_step(model_cfg, mesh, p_shard)

    def init(self, seed: int) -> dict[str, Any]:
        """A fresh train state (parameters from `nnx.Rngs(seed)`), created sharded."""
        def create():
            params = nnx.to_pure_dict(nnx.state(CEMTransformer(self.model_cfg,
                                                               rngs=nnx.Rngs(seed))))
            return {"params": params, "opt_state": self.optimizer.init(params),
                    "step": jnp.zeros((), jnp.int32)}

        return jax.jit(create, out_shardings=self.state_shardings)()

    def init_from_params(self, params: dict) -> dict[str, Any]:
        """A train state at step 0 holding `params` (host arrays of this model's pure dict, as
        `cem_jax.rundir.load_run` gives them; every process passes the whole of them) with a
        fresh optimizer state, created sharded."""
        placed = jax.tree.map(lambda x, s: jax.make_array_from_callback(
            x.shape, s, lambda index, x=x: x[index]), params, self.state_shardings["params"])

        def create(params):
            return {"params": params, "opt_state": self.optimizer.init(params),
                    "step": jnp.zeros((), jnp.int32)}

        return jax.jit(create, out_shardings=self.state_shardings)(placed)

    def abstract_state(self) -> dict[str, Any]:
        """`jax.ShapeDtypeStruct`s of the train state carrying this mesh's shardings (the
        target of a checkpoint restore, whatever mesh wrote it)."""
        shapes = jax.eval_shape(lambda: self.init(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def loss(self, params: dict, batch: Batch) -> jax.Array:
        """Mean cross entropy (nats, fp32 scalar) of int32 [B,T] `batch["targets"]` given
        `inputs`, `positions`, `segment_ids`."""
        ones = jnp.ones(batch["targets"].shape, jnp.float32)
        return batch_cross_entropy(self.model_cfg, params, batch, self.mesh, ones) / ones.size

    def _train_step(self, state: dict, batch: Batch):
        params, A = state["params"], self.accumulation
        grad_fn = jax.value_and_grad(self.loss)
        if A == 1:
            loss, grads = grad_fn(params, batch)
        else:
            spec = NamedSharding(self.mesh, PartitionSpec(None, BATCH_AXES, None))
            micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
                x.reshape(x.shape[0] // A, A, *x.shape[1:]).swapaxes(0, 1), spec), batch)

            def accumulate(carry, mb):
                return jax.tree.map(jnp.add, carry, grad_fn(params, mb)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro)
            loss, grads = jax.tree.map(lambda x: x / A, (loss, grads))
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
        # The updated parameters' norm: a step whose loss and gradients are finite can still
        # overflow them (a huge learning rate), and the loop saves nothing non-finite. The
        # learning rate comes with the metrics: computed on the host's side it would be one more
        # device computation, queued behind the step in flight.
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads),
                           "param_norm": optax.tree.norm(new_params),
                           "lr": self.learning_rate(state["step"])}
