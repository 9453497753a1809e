"""The chunked cross entropy (`cem_jax.loss`) against optax's on the whole logits: the loss and
its gradients, alone and in the train step (tied and untied heads, a vocabulary of no round
size, sequences the chunks do not divide), and that the step never holds the whole logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cem_jax.config import ModelConfig
from cem_jax.loss import chunk_length, cross_entropy
from cem_jax.model import model_from_params
from cem_jax.sharding import local_mesh
from cem_jax.train.step import Trainer
from cem_jax.train_config import OptimizerConfig

B, T, D, V = 3, 37, 16, 1001  # 37 = 4 chunks of 10, the last padded with 3 positions


def _relative(got, want) -> float:
    """‖got − want‖ / ‖want‖ (Frobenius)."""
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@pytest.mark.parametrize("chunks", [1, 4, 37, 100])
def test_loss_and_gradients_equal_the_whole_logits(chunks):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    h = jax.random.normal(keys[0], (B, T, D))
    head = 0.5 * jax.random.normal(keys[1], (D, V))
    targets = jax.random.randint(keys[2], (B, T), 0, V)
    weights = jax.random.uniform(keys[3], (B, T))

    def whole(h, head, weights):
        ce = optax.softmax_cross_entropy_with_integer_labels(h @ head, targets)
        return jnp.sum(ce * weights)

    def chunked(h, head, weights):
        return cross_entropy(h, head, targets, weights, chunks)

    want, want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2))(h, head, weights)
    got, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1, 2)))(h, head, weights)
    assert abs(float(got - want)) <= 1e-6 * abs(float(want))
    for name, g, w in zip(("h", "head", "weights"), grads, want_grads, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert _relative(g, w) <= 1e-6, name
    # without a gradient (evaluation) the loss alone, the same number
    assert abs(float(jax.jit(chunked)(h, head, weights) - want)) <= 1e-6 * abs(float(want))


def test_chunk_length_and_bad_chunk_counts():
    assert [chunk_length(37, n) for n in (1, 4, 37, 100)] == [37, 10, 1, 1]
    with pytest.raises(ValueError, match="cut into 0 chunks"):
        cross_entropy(jnp.zeros((1, 4, 2)), jnp.zeros((2, 3)), jnp.zeros((1, 4), jnp.int32),
                      jnp.ones((1, 4)), 0)
    with pytest.raises(ValueError, match="'loss_chunks' = 0"):
        ModelConfig(loss_chunks=0)


def _tiny(tie_embeddings: bool, chunks: int) -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=2, mlp_dim=64,
                       tie_embeddings=tie_embeddings, loss_chunks=chunks)


def _batch(seed: int = 0) -> dict[str, jax.Array]:
    tokens = np.random.default_rng(seed).integers(0, V, (4, T + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "segment_ids": jnp.ones((4, T), jnp.int32),
            "positions": jnp.tile(jnp.arange(T, dtype=jnp.int32), (4, 1))}


def _whole_logits_loss(cfg: ModelConfig, params: dict, batch) -> jax.Array:
    logits = model_from_params(cfg, params)(batch["inputs"], batch["positions"],
                                            batch["segment_ids"]).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied head", "untied head"])
def test_train_loss_and_gradients_equal_the_whole_logits(tie_embeddings):
    cfg = _tiny(tie_embeddings, chunks=4)
    trainer = Trainer(cfg, OptimizerConfig(), 10, local_mesh())
    params = trainer.init(0)["params"]
    batch = _batch()
    loss, grads = jax.jit(jax.value_and_grad(trainer.loss))(params, batch)
    want, want_grads = jax.jit(jax.value_and_grad(
        lambda p, b: _whole_logits_loss(cfg, p, b)))(params, batch)
    assert abs(float(loss - want)) <= 1e-6 * float(want)
    assert ("lm_head" in grads) == (not tie_embeddings)
    flat, want_flat = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (grads, want_grads))
    # fp32, summed in another order over the B·T tokens (and a preconditioner's ρ over all B·T·D
    # products of its sub-layer): measured with JAX 0.10.2 for the untied head up to 1.2e-6 (ρ)
    # and 1.04e-6 (an attention norm's scale) depending on the CPU; a wrong gradient is off by
    # orders of magnitude more
    for (path, g), (_, w) in zip(flat, want_flat, strict=True):
        assert _relative(g, w) <= 4e-6, jax.tree_util.keystr(path)


def _largest_intermediate(fn, *args) -> int:
    """Elements of the largest array any equation of `fn`'s jaxpr makes (sub-jaxprs too)."""
    def walk(jaxpr) -> int:
        sizes = [0]
        for eqn in jaxpr.eqns:
            sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars
                      if hasattr(v.aval, "shape")]
            sizes += [walk(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
                      for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
        return max(sizes)

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def test_the_train_step_never_holds_the_whole_logits():
    cfg = _tiny(True, chunks=4)
    trainer = Trainer(cfg, OptimizerConfig(), 10, local_mesh())
    params, batch = trainer.init(0)["params"], _batch()
    whole = 4 * T * V
    chunked = _largest_intermediate(jax.value_and_grad(trainer.loss), params, batch)
    assert chunked == 4 * chunk_length(T, 4) * V  # one chunk's logits, the largest array
    # the detector sees the whole logits where they are made
    assert _largest_intermediate(jax.value_and_grad(
        lambda p, b: _whole_logits_loss(cfg, p, b)), params, batch) == whole
    # the train step with every chunk count is the same function
    one = dataclasses.replace(cfg, loss_chunks=1)
    a = Trainer(one, OptimizerConfig(), 10, local_mesh()).loss(params, batch)
    assert abs(float(a - trainer.loss(params, batch))) <= 1e-6 * float(a)
