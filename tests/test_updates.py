"""Closed-form (`xla`) updates against the autodiff definition, preconditioners, descent."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close_to_scale
from hypothesis import given
from hypothesis import strategies as st

from cem_jax.attention import attend
from cem_jax.energies import AttentionSpec, get_activation
from cem_jax.layers import precondition, run_steps
from cem_jax.numerics import rms_norm, rms_norm_vjp
from cem_jax.updates import tied_attention_mixer, tied_mlp_mixer


def attention_params(key, D, H, G, K, diag=None, std=0.3):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"query": std * jax.random.normal(k1, (D, H, K)),
              "key": std * jax.random.normal(k2, (D, G, K))}
    if diag == "per_head":
        params["diag"] = 0.3 * jax.random.normal(k3, (H, D))
    elif diag == "shared":
        params["diag"] = 0.3 * jax.random.normal(k3, (D,))
    return params


def mlp_params(key, D, F, std=0.3):
    k1, k2 = jax.random.split(key)
    return {"gate": std * jax.random.normal(k1, (D, F)), "up": std * jax.random.normal(k2, (D, F))}


def precond_params(key, kind, D, r=3):
    k1, k2 = jax.random.split(key)
    if kind == "none":
        return {}
    rho = jax.random.normal(k1, () if kind == "scalar" else (D,))
    return {"rho": rho, "U": 0.3 * jax.random.normal(k2, (D, r))} if kind == "dplr" else \
        {"rho": rho}


def autodiff_direction(mixer, y, c):
    return -jax.grad(lambda y_: mixer.energy(y_, c).sum())(y)


def assert_directions_agree(mixer, y, c):
    """The closed form equals -∇_y E (one compiled call: fast for many shapes)."""
    got, want = jax.jit(lambda y, c: (mixer.direction(y, mixer.prepare(c, 0)),
                                      autodiff_direction(mixer, y, c)))(y, c)
    assert_close_to_scale(got, want)


@pytest.mark.parametrize("use_rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("G", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("diag", [None, "per_head", "shared"],
                         ids=["lowrank", "dplr", "dplr_shared"])
def test_attention_closed_form_equals_autodiff(use_rope, G, diag):
    B, T, D, H, K = 2, 7, 12, 4, 6
    key = jax.random.PRNGKey(0)
    params = attention_params(key, D, H, G, K, diag)
    y, c = jax.random.normal(jax.random.PRNGKey(1), (2, B, T, D))
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0, 1], list(range(T))])
    for positions, segment_ids in ((None, None), (pos, seg)):
        spec = AttentionSpec(H, G, K, use_rope, block_size=3)
        mixer = tied_attention_mixer(params, spec, positions, segment_ids)
        assert_directions_agree(mixer, y, c)


@pytest.mark.parametrize("name", ["silu", "gelu", "relu"])
def test_mlp_closed_form_equals_autodiff(name):
    params = mlp_params(jax.random.PRNGKey(0), 10, 24)
    y, c = jax.random.normal(jax.random.PRNGKey(1), (2, 2, 5, 10))
    mixer = tied_mlp_mixer(params, get_activation(name))
    assert_directions_agree(mixer, y, c)


@given(B=st.integers(1, 3), T=st.integers(1, 9), G=st.sampled_from([1, 2, 3]),
       R=st.sampled_from([1, 2]), K=st.sampled_from([2, 4, 8]), D=st.integers(2, 12),
       diag=st.sampled_from([None, "per_head", "shared"]), use_rope=st.booleans(),
       block=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_attention_closed_form_equals_autodiff_hypothesis(B, T, G, R, K, D, diag, use_rope, block,
                                                          seed):
    H = G * R
    params = attention_params(jax.random.PRNGKey(seed), D, H, G, K, diag)
    y, c = jax.random.normal(jax.random.PRNGKey(seed + 1), (2, B, T, D))
    mixer = tied_attention_mixer(params, AttentionSpec(H, G, K, use_rope, block_size=block),
                                 None, None)
    assert_directions_agree(mixer, y, c)


@given(B=st.integers(1, 3), T=st.integers(1, 6), D=st.integers(1, 9), F=st.integers(1, 17),
       name=st.sampled_from(["silu", "gelu", "relu"]), seed=st.integers(0, 2**16))
def test_mlp_closed_form_equals_autodiff_hypothesis(B, T, D, F, name, seed):
    params = mlp_params(jax.random.PRNGKey(seed), D, F)
    y, c = jax.random.normal(jax.random.PRNGKey(seed + 1), (2, B, T, D))
    mixer = tied_mlp_mixer(params, get_activation(name))
    assert_directions_agree(mixer, y, c)


def test_rms_norm_vjp_equals_autodiff():
    x, v = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 16))
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(1), (16,))
    _, vjp = jax.vjp(lambda x_: rms_norm(x_, scale, 1e-5), x)
    assert_close_to_scale(rms_norm_vjp(x, scale, 1e-5, v), vjp(v)[0])


def _mixers(D=12):
    key = jax.random.PRNGKey(3)
    yield "attention", tied_attention_mixer(attention_params(key, D, 4, 2, 6), AttentionSpec(
        4, 2, 6, True, block_size=4), None, None)
    yield "attention_dplr", tied_attention_mixer(attention_params(key, D, 4, 4, 6, "per_head"),
                                                 AttentionSpec(4, 4, 6, False), None, None)
    yield "mlp", tied_mlp_mixer(mlp_params(key, D, 20), get_activation("silu"))


STEP_GRID = list(itertools.product(["none", "scalar", "diag", "dplr"], [1, 2, 3],
                                   ["normalized", "residual"], [False, True]))


@pytest.mark.parametrize("kind,steps,wrt,recompute", STEP_GRID)
def test_steps_xla_equal_autodiff(kind, steps, wrt, recompute):
    D = 12
    x0 = 2.0 * jax.random.normal(jax.random.PRNGKey(4), (2, 6, D))
    scale = 1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(5), (D,))
    p = precond_params(jax.random.PRNGKey(6), kind, D)
    for _, mixer in _mixers(D):
        outs = [run_steps(x0, mixer, norm_scale=scale, eps=1e-5,
                          precond=lambda u: precondition(kind, p, u), steps=steps, impl=impl,
                          gradient_wrt=wrt, recompute_context=recompute, monitor=True)
                for impl in ("xla", "autodiff")]
        assert_close_to_scale(outs[0][0] - x0, outs[1][0] - x0)
        assert outs[0][1].shape == (steps, 2, 2, 6)
        assert_close_to_scale(outs[0][1], outs[1][1])


@pytest.mark.parametrize("kind", ["scalar", "diag", "dplr"])
def test_preconditioner_is_positive_definite(kind):
    D = 9
    for seed in range(5):
        p = precond_params(jax.random.PRNGKey(seed), kind, D)
        p = {k: 4.0 * v for k, v in p.items()}  # far from init, negative ρ included
        P = np.asarray(precondition(kind, p, jnp.eye(D)[None]), np.float64)[0].T
        np.testing.assert_allclose(P, P.T, atol=1e-5)
        assert np.linalg.eigvalsh(P).min() > 0


@pytest.mark.parametrize("kind", ["none", "scalar", "diag", "dplr"])
def test_descent_in_the_update_variable(kind):
    # E(y - εP∇E(y|c) | c) < E(y | c) for every energy and preconditioner.
    D = 12
    p = precond_params(jax.random.PRNGKey(7), kind, D)
    y, c = jax.random.normal(jax.random.PRNGKey(8), (2, 2, 6, D))
    for name, mixer in _mixers(D):
        u = mixer.direction(y, mixer.prepare(c, 0))
        before = mixer.energy(y, c)
        for eps in (1e-2, 1e-3):
            after = mixer.energy(y + eps * precondition(kind, p, u), c)
            assert np.all(np.asarray(after < before)), (name, eps)


def test_unknown_impl_and_preconditioner_are_clear_errors():
    _, mixer = next(_mixers())
    x = jnp.ones((1, 2, 12))
    with pytest.raises(ValueError, match="unknown impl 'pallas2'"):
        run_steps(x, mixer, norm_scale=jnp.ones(12), eps=1e-5, precond=lambda u: u,
                  impl="pallas2")
    with pytest.raises(ValueError, match="unknown preconditioner 'adam'"):
        precondition("adam", {}, x)


@pytest.mark.parametrize("tied", [True, False], ids=["values_are_keys", "free_values"])
def test_attend_backward_equals_autodiff_of_reference(tied):
    # The hand-written (flash-style) backward of `attend` against XLA autodiff of plain jnp.
    B, G, M, S, K = 2, 3, 5, 7, 4
    q = jax.random.normal(jax.random.PRNGKey(9), (B, G, M, K))
    k = jax.random.normal(jax.random.PRNGKey(10), (B, G, S, K))
    v = k if tied else jax.random.normal(jax.random.PRNGKey(11), (B, G, S, K))
    mask = jax.random.bernoulli(jax.random.PRNGKey(12), 0.6, (B, 1, M, S)).at[..., 0].set(True)
    w = jax.random.normal(jax.random.PRNGKey(13), (B, G, M, K))

    def reference(q, k, v):
        logits = jnp.where(mask, 0.5 * q @ k.swapaxes(-1, -2), -jnp.inf)
        return jax.nn.softmax(logits, axis=-1) @ v

    def loss(fn, q, k):
        return jnp.sum(w * fn(q, k, k if tied else v))

    got = jax.grad(lambda q, k: loss(lambda *a: attend(*a, mask, 0.5), q, k), (0, 1))(q, k)
    want = jax.grad(lambda q, k: loss(reference, q, k), (0, 1))(q, k)
    assert_close_to_scale(attend(q, k, v, mask, 0.5), reference(q, k, v))
    for a, b in zip(got, want, strict=True):
        assert_close_to_scale(a, b)
