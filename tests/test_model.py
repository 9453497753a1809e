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
from cem_jax.model import CEMTransformer, forward_with_energies
from cem_jax.monitor import descent_statistics, energy_monitor, preconditioner_stats

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
    return m(tokens).logits


def loss_fn(m, tokens):
    logits = m(tokens[:, :-1]).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn))


@nnx.jit
def energies(m, tokens, positions, segment_ids):
    return forward_with_energies(m, tokens, positions, segment_ids)[1]


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
    logits = m(TOKENS, pos, seg).logits
    other = TOKENS.at[:, :4].set((TOKENS[:, :4] + 3) % 40)
    np.testing.assert_allclose(m(other, pos, seg).logits[:, 4:], logits[:, 4:], atol=1e-6)
    alone = m(TOKENS[:, 4:]).logits  # the second document on its own: positions 0..5
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
    logits32 = model(interaction="dplr")(TOKENS).logits
    logits16 = model(interaction="dplr", dtype="bfloat16")(TOKENS).logits
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
        np.testing.assert_allclose(e["change"], e["after"] - e["before"])
        np.testing.assert_array_equal(e["down"], 1.0)  # every token's own energy went down
        np.testing.assert_allclose(e["before"][:, 1:], e["after"][:, :-1], rtol=1e-5)
    untied = energy_monitor(model(tie_attention=False, steps=2), TOKENS)
    assert set(untied) == {"mlp"}


def _trained(**kw):
    """`model(**kw)` after 8 SGD steps on TOKENS (away from its init: P is no longer I)."""
    m = model(**kw)
    for _ in range(8):
        _, grads = value_and_grad(m, TOKENS)
        nnx.update(m, jax.tree.map(lambda p, g: p - 0.5 * g, nnx.state(m, nnx.Param),
                                   nnx.state(grads)))
    return m


def test_descent_statistics_equal_a_direct_computation_from_per_token_energies():
    m = _trained(steps=2, preconditioner="diag")
    params = nnx.to_pure_dict(nnx.state(m))
    rng = np.random.default_rng(0)
    batches = []
    for b in range(2):  # packed documents, the last tokens of each row padding (weight 0)
        weights = np.ones((2, 10), np.float32)
        weights[:, 7 + b:] = 0
        batches.append({"inputs": rng.integers(0, 40, (2, 10)).astype(np.int32),
                        "positions": np.array([list(range(4)) + list(range(6))] * 2, np.int32),
                        "segment_ids": np.array([[1] * 4 + [2] * 6] * 2, np.int32),
                        "weights": weights, "targets": np.zeros((2, 10), np.int32)})
    got = descent_statistics(m.cfg, params, batches)
    per_token = [energies(m, b["inputs"], b["positions"], b["segment_ids"]) for b in batches]
    assert set(got) == {"attention", "mlp"}
    for kind in got:  # every real token of both batches, [L, steps, 2, N]
        e = np.concatenate([np.asarray(p[kind], np.float64)[..., b["weights"] > 0]
                            for p, b in zip(per_token, batches, strict=True)], axis=-1)
        assert e.shape == (2, 2, 2, 2 * 7 + 2 * 8)
        before, after = e[:, :, 0], e[:, :, 1]
        want = {"before": before.mean(-1), "after": after.mean(-1),
                "change": (after - before).mean(-1), "down": (after < before).mean(-1)}
        for name, value in want.items():
            np.testing.assert_allclose(got[kind][name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{kind} {name}")
        assert 0 < got[kind]["down"].min() and got[kind]["down"].max() <= 1
    with pytest.raises(ValueError, match="no token with weight > 0"):
        descent_statistics(m.cfg, params, [dict(batches[0], weights=np.zeros((2, 10)))])


@pytest.mark.parametrize("scan_layers", [True, False])
def test_preconditioner_stats_are_softplus_of_rho_and_the_norm_of_u(scan_layers):
    m = random_model(preconditioner="dplr", scan_layers=scan_layers)
    params = nnx.to_pure_dict(nnx.state(m))["blocks"]
    layers = [params] if scan_layers else [params[i] for i in range(2)]
    stats = preconditioner_stats(m)
    for kind in ("attention", "mlp"):
        rho = np.stack([np.asarray(p[kind]["precond"]["rho"]) for p in layers]).reshape(2, 16)
        U = np.stack([np.asarray(p[kind]["precond"]["U"]) for p in layers]).reshape(2, 16, 4)
        p = np.log1p(np.exp(rho))
        np.testing.assert_allclose(stats[kind]["mean"], p.mean(1), rtol=1e-6)
        np.testing.assert_allclose(stats[kind]["min"], p.min(1), rtol=1e-6)
        np.testing.assert_allclose(stats[kind]["max"], p.max(1), rtol=1e-6)
        np.testing.assert_allclose(stats[kind]["u_norm"], np.linalg.norm(U, axis=(1, 2)),
                                   rtol=1e-6)
        assert stats[kind]["max"].max() - stats[kind]["min"].min() > 1e-3  # not P = I
    assert preconditioner_stats(model(preconditioner="none")) == {}
    scalar = preconditioner_stats(model(preconditioner="scalar"))
    np.testing.assert_allclose(scalar["mlp"]["mean"], [1.0, 1.0], rtol=1e-6)  # init: P = I
