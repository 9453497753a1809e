"""The language model: causality, implementations agree, gradients, scan, the energy monitor."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close_to_scale, random_params

from cem_jax.config import ModelConfig
from cem_jax.model import CEMTransformer
from cem_jax.monitor import energy_monitor

SMALL = dict(vocab_size=40, d_model=16, num_layers=2, num_heads=4, mlp_dim=24, init_std=0.2,
             attention_block=4)
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, 10), 0, 40)

# Every tie mix × interaction (DPLR only with tied attention) × position; GQA, preconditioner,
# steps and diagonal cycle through the rows so that each of their values meets each of those
# (the sub-layer tests in test_updates.py cover the full product of the step options). Two more
# rows take gradients through the norm (gradient_wrt="residual"): a scalar P is folded into the
# output projections there, a diagonal one is not.
VARIANTS = [
    dict(tie_attention=ta, tie_mlp=tm, interaction=i, position=p, num_kv_heads=(4, 2)[n % 2],
         preconditioner=("none", "scalar", "diag", "dplr")[n % 4], steps=1 + n % 3,
         diagonal=("per_head", "shared")[n // 2 % 2])
    for n, (ta, tm, i, p) in enumerate(
        (ta, tm, i, p) for ta, tm, i, p in itertools.product(
            [True, False], [True, False], ["lowrank", "dplr"], ["rope", "none"])
        if ta or i == "lowrank")  # the diagonal term belongs to the tied attention energy
] + [dict(gradient_wrt="residual", preconditioner=p, steps=2) for p in ("scalar", "diag")]


def model(**kw):
    return CEMTransformer(ModelConfig(**dict(SMALL, **kw)), rngs=nnx.Rngs(0))


def random_model(**kw):
    """`model` with `random_params`: preconditioners and norms away from their identity
    starts, so that a preconditioner folded into the output projections is seen."""
    m = model(**kw)
    state = nnx.state(m)
    nnx.replace_by_pure_dict(state, random_params(m.cfg))
    nnx.update(m, state)
    return m


@nnx.jit
def forward(m, tokens):
    return m(tokens)


def loss_fn(m, tokens):
    logits = m(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_causal_and_impls_agree(variant):
    m = random_model(**variant)
    logits = forward(m, TOKENS)
    changed = forward(m, TOKENS.at[:, 6:].set((TOKENS[:, 6:] + 7) % 40))
    np.testing.assert_array_equal(np.asarray(changed[:, :6]), np.asarray(logits[:, :6]))
    assert np.max(np.abs(changed[:, 6:] - logits[:, 6:])) > 1e-4  # the change is seen
    assert_close_to_scale(forward(random_model(**variant, impl="autodiff"), TOKENS), logits)


def test_documents_do_not_see_each_other():
    m = model(interaction="dplr", steps=2)
    seg = jnp.array([[1] * 4 + [2] * 6] * 2)
    pos = jnp.array([list(range(4)) + list(range(6))] * 2)
    logits = m(TOKENS, pos, seg)
    other = TOKENS.at[:, :4].set((TOKENS[:, :4] + 3) % 40)
    np.testing.assert_allclose(m(other, pos, seg)[:, 4:], logits[:, 4:], atol=1e-6)
    alone = m(TOKENS[:, 4:])  # the second document on its own: positions 0..5
    np.testing.assert_allclose(alone, logits[:, 4:], atol=1e-5)


@pytest.mark.parametrize("variant", [dict(), dict(interaction="dplr", preconditioner="dplr",
                                                  steps=2, num_kv_heads=2, tie_mlp=False)])
def test_parameter_gradients_autodiff_equal_xla_and_finite_differences(variant):
    m_xla, m_auto = model(**variant), model(**variant, impl="autodiff")
    loss, g_xla = value_and_grad(m_xla, TOKENS)
    _, g_auto = value_and_grad(m_auto, TOKENS)
    flat_xla, flat_auto = nnx.to_flat_state(nnx.state(g_xla)), nnx.to_flat_state(nnx.state(g_auto))
    for (path, a), (_, b) in zip(flat_xla, flat_auto, strict=True):
        assert np.all(np.isfinite(np.asarray(a[...]))), path
        assert_close_to_scale(a[...], b[...], 1e-4)
    # Directional finite difference along the gradient, in float64.
    with jax.enable_x64(True):
        graphdef, params = nnx.split(m_xla)
        params64 = jax.tree.map(lambda v: v.astype(jnp.float64), params)
        grads64 = jax.tree.map(lambda v: v.astype(jnp.float64), nnx.state(g_xla))
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads64)))

        @jax.jit
        def loss_at(h):
            moved = jax.tree.map(lambda p, g: p + h * g / norm, params64, grads64)
            return loss_fn(nnx.merge(graphdef, moved), TOKENS)

        h = 1e-4
        fd = (loss_at(h) - loss_at(-h)) / (2 * h)
        # d loss / d h along g/|g| = |g| (computed in fp32).
        np.testing.assert_allclose(fd, norm, rtol=2e-3)
        assert abs(loss_at(0.0) - loss) < 1e-5


def test_scanned_unscanned_and_remat_models_agree():
    scanned = model(interaction="dplr", steps=2)
    unscanned = model(interaction="dplr", steps=2, scan_layers=False)
    stacked = nnx.state(scanned.blocks)
    for layer, block in enumerate(unscanned.blocks):
        nnx.update(block, jax.tree.map(lambda a, i=layer: a[i], stacked))
    nnx.update(unscanned, nnx.state(scanned, nnx.Not(nnx.PathContains("blocks"))))
    assert_close_to_scale(forward(unscanned, TOKENS), forward(scanned, TOKENS))
    remat = model(interaction="dplr", steps=2, remat="full")
    _, g1 = value_and_grad(scanned, TOKENS)
    _, g2 = value_and_grad(remat, TOKENS)
    for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g2)), strict=True):
        assert_close_to_scale(a, b, 1e-5)


def test_bfloat16_compute_tracks_float32():
    logits32 = model(interaction="dplr")(TOKENS)
    logits16 = model(interaction="dplr", dtype="bfloat16")(TOKENS)
    assert logits16.dtype == jnp.float32
    assert_close_to_scale(logits16, logits32, 3e-2)


def test_energy_monitor_reports_descent_at_every_step():
    # Gradient through the norm with a small positive definite step: each step lowers the energy.
    m = model(steps=3, gradient_wrt="residual", preconditioner="scalar", init_std=0.5,
              tie_embeddings=False)
    for sub in (m.blocks.attention, m.blocks.mlp):
        sub.precond.rho[...] = jnp.full_like(sub.precond.rho[...], -4.0)  # η = softplus(-4)
    report = energy_monitor(m, TOKENS)
    assert set(report) == {"attention", "mlp"}
    for name, e in report.items():
        assert e["before"].shape == e["after"].shape == (2, 3)
        assert np.all(e["after"] < e["before"]), (name, e)
        np.testing.assert_allclose(e["before"][:, 1:], e["after"][:, :-1], rtol=1e-5)
    untied = energy_monitor(model(tie_attention=False, steps=2), TOKENS)
    assert set(untied) == {"mlp"}
