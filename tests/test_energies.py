"""The energies themselves: antiderivatives, RoPE, and the energy formulas against brute force."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close_to_scale, random_params, rotation_matrix
from scipy import integrate, special

from cem_jax.config import ModelConfig
from cem_jax.energies import (
    ACTIVATIONS,
    AttentionSpec,
    RopeScaling,
    apply_rope,
    attention_energy,
    get_activation,
    mlp_energy,
    register_activation,
    rope,
    rope_frequencies,
    rope_tables,
)
from cem_jax.model import CEMTransformer, model_from_params
from cem_jax.sample import SamplingConfig, generate
from cem_jax.updates import tied_mlp_mixer

SIGMA = {
    "silu": lambda a: a * special.expit(a),
    "gelu": lambda a: a * special.ndtr(a),
    "relu": lambda a: max(a, 0.0),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_antiderivative_is_the_integral_of_the_activation(name):
    # Φ(a) = ∫_{-∞}^a σ, checked by quadrature (float64 reference, fp32 under test).
    points = np.array([-30.0, -6.0, -1.5, -0.3, 0.0, 0.4, 2.0, 7.0, 25.0])
    want = [integrate.quad(SIGMA[name], -np.inf, a, limit=200)[0] for a in points]
    got = np.asarray(get_activation(name).antiderivative(jnp.asarray(points, jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_antiderivative_derivative_is_activation(name):
    # Finite differences of the primal formula in float64 (not the custom JVP rule).
    act = get_activation(name)
    with jax.enable_x64(True):
        a = jnp.linspace(-12.0, 12.0, 97, dtype=jnp.float64) + 0.013  # avoid ReLU's kink
        h = 1e-5
        fd = (act.antiderivative(a + h) - act.antiderivative(a - h)) / (2 * h)
        np.testing.assert_allclose(fd, act.fn(a), atol=1e-7)
        np.testing.assert_allclose(jax.vmap(jax.grad(act.antiderivative))(a), act.fn(a),
                                   atol=1e-12)


def test_silu_antiderivative_is_finite_and_accurate_at_extremes():
    a = jnp.asarray([-1e4, -500.0, -90.0, 90.0, 500.0, 1e4], jnp.float32)
    phi = np.asarray(get_activation("silu").antiderivative(a), np.float64)
    assert np.all(np.isfinite(phi))
    np.testing.assert_allclose(phi[:3], 0.0, atol=1e-30)  # Φ(-∞) = 0, no -0·inf NaNs
    big = np.asarray(a[3:], np.float64)
    np.testing.assert_allclose(phi[3:], big**2 / 2 - math.pi**2 / 6, rtol=1e-6)
    grad = jax.vmap(jax.grad(get_activation("silu").antiderivative))(a)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        get_activation("tanh")


def test_rope_equals_explicit_rotation_matrices_and_inverts():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 3, 0, 11, 2]])
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos)))
    R = np.array([[rotation_matrix(p, 8) for p in row] for row in pos])
    want = np.einsum("btij,bntj->bnti", R, x)
    np.testing.assert_allclose(got, want, atol=1e-5)
    back = rope(jnp.asarray(got), -jnp.asarray(pos))
    np.testing.assert_allclose(back, x, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's fusion decisions")
def test_rope_tables_are_computed_once_for_all_their_readers():
    """XLA counts cos/sin as cheap and would recompute them in each fusion that reads the tables
    (rope_tables' docstring); the compiled fwd+bwd of three rotations holds one cos and one sin."""
    x, w = jnp.ones((2, 3, 5, 8)), jnp.ones((8, 8))

    def loss(x, pos):
        tables = rope_tables(pos, 8)
        rotated = [apply_rope(x * i, *tables) for i in (1.0, 2.0, 3.0)]
        return sum(jnp.sum((r.reshape(-1, 8) @ w) ** 2) for r in rotated)  # a dot per rotation

    pos = jnp.tile(jnp.arange(5), (2, 1))
    hlo = jax.jit(jax.grad(loss)).lower(x, pos).compile().as_text()
    assert (hlo.count(" cosine("), hlo.count(" sine(")) == (1, 1)


# RoPE scaling (transformers' rope_type names and numbers): K, theta and the scaling. The llama3
# cases put feature pairs in all three wavelength bands (kept, blended, divided by the factor):
# Llama 3.1's own numbers at K = 128, and a short pretraining context at K = 8.
LLAMA31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position=8192)
ROPE_CASES = {
    "default": (64, 10000.0, RopeScaling()),
    "linear": (64, 10000.0, RopeScaling("linear", factor=4.0)),
    "llama3.1": (128, 500000.0, RopeScaling("llama3", **LLAMA31)),
    "llama3-short": (8, 10000.0, RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position=64)),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_equal_transformers(case):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    K, theta, scaling = ROPE_CASES[case]
    rope_parameters = {"rope_type": scaling.rope_type, "rope_theta": theta}
    if scaling.rope_type != "default":
        rope_parameters["factor"] = scaling.factor
    if scaling.rope_type == "llama3":
        rope_parameters |= {"low_freq_factor": scaling.low_freq_factor,
                            "high_freq_factor": scaling.high_freq_factor,
                            "original_max_position_embeddings": scaling.original_max_position}
    theirs = LlamaRotaryEmbedding(LlamaConfig(
        hidden_size=2 * K, num_attention_heads=2, head_dim=K, max_position_embeddings=1 << 20,
        rope_parameters=rope_parameters))
    assert theirs.attention_scaling == 1.0  # cos/sin unscaled, as ours
    got = np.asarray(rope_frequencies(K, theta, scaling))
    np.testing.assert_allclose(got, theirs.inv_freq.numpy(), rtol=2e-6, atol=0)
    plain = np.asarray(rope_frequencies(K, theta))
    kept = np.isclose(got, plain, rtol=1e-6)
    divided = np.isclose(got, plain / scaling.factor, rtol=1e-6) & ~kept
    bands = {"kept": kept, "divided": divided, "blended": ~(kept | divided)}
    present = {name for name, band in bands.items() if band.any()}
    assert present == {"default": {"kept"}, "linear": {"divided"}}.get(
        scaling.rope_type, {"kept", "divided", "blended"})


def test_scaled_rope_rotates_by_interpolated_positions_and_inverts():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 3, 5, 8)), jnp.float32)
    pos = jnp.asarray([[0, 1, 2, 3, 4], [7, 3, 0, 11, 2]])
    linear = RopeScaling("linear", factor=2.0)
    np.testing.assert_allclose(rope(x, 2 * pos, 100.0, linear), rope(x, pos, 100.0), atol=1e-5)
    llama3 = ROPE_CASES["llama3-short"][2]
    turned = rope(x, pos, 100.0, llama3)
    assert np.abs(np.asarray(turned - rope(x, pos, 100.0))).max() > 0.1
    np.testing.assert_allclose(rope(turned, -pos, 100.0, llama3), x, atol=1e-5)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(rope_type="yarn"), "'rope_type' = 'yarn' is invalid: it must be one of 'default', "
                             "'linear', 'llama3'"),
    (dict(rope_factor=8.0), "'rope_factor' = 8.0 is invalid: it must be 1.0 with "
                            "rope_type='default'"),
    (dict(rope_type="linear", rope_factor=0.0), "'rope_factor' = 0.0 is invalid: it must be > 0"),
    (dict(rope_type="llama3", rope_low_freq_factor=4.0),
     "'rope_high_freq_factor' = 4.0 is invalid: it must be > rope_low_freq_factor = 4.0"),
    (dict(rope_type="llama3", rope_original_max_position=0),
     "'rope_original_max_position' = 0 is invalid: it must be a positive integer"),
    (dict(rope_type="linear", rope_factor=2.0, position="none"),
     "'rope_type' = 'linear' is invalid: it must be 'default' with position='none'"),
])
def test_rope_scaling_fields_are_validated(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig(**fields)


@pytest.mark.parametrize("tie_attention", [True, False])
def test_scaled_rope_reaches_every_attention_path(tie_attention):
    """The closed form (xla), the energy's autodiff and the cached decode use the scaled
    frequencies: they agree with each other and differ from the unscaled model."""
    base = dict(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=24,
                tie_attention=tie_attention, tie_mlp=tie_attention, rope_theta=100.0)
    scaled = dict(rope_type="llama3", rope_factor=8.0, rope_original_max_position=16)
    params = random_params(ModelConfig(**base))
    tokens = jnp.asarray([[3, 17, 50, 9, 4, 61, 8, 20, 33, 5, 60, 11, 2, 40]])
    logits = {impl: model_from_params(ModelConfig(**base, **scaled, impl=impl),
                                      params)(tokens).logits
              for impl in (("xla", "autodiff") if tie_attention else ("xla",))}
    for got in logits.values():
        assert_close_to_scale(got, logits["xla"], 1e-5)
    plain = model_from_params(ModelConfig(**base), params)(tokens).logits
    assert np.abs(np.asarray(plain - logits["xla"])).max() > 0.1
    cfg = ModelConfig(**base, **scaled)
    out = generate(params, cfg, [list(tokens[0, :6])],
                   SamplingConfig(max_new_tokens=4, temperature=0.0))
    sequence = jnp.asarray([list(tokens[0, :6]) + list(out.tokens[0])])
    full = model_from_params(cfg, params)(sequence).logits[0, 5:-1].argmax(-1)
    assert list(full) == list(out.tokens[0])


def _brute_attention_energy(params, y, c, spec, use_rope, segment_ids=None):
    """E_t = -(1/β) Σ_h log Σ_{s≤t} exp(β a_h(y_t, c_s)), by explicit loops in float64."""
    Wq, Wk = np.asarray(params["query"], np.float64), np.asarray(params["key"], np.float64)
    d = params.get("diag")
    B, T, D = y.shape
    H, G, K = spec.num_heads, spec.num_kv_heads, spec.head_dim
    beta = 1 / math.sqrt(K)
    E = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            for h in range(H):
                g = h // (H // G)
                scores = []
                for s in range(t + 1):
                    if segment_ids is not None and segment_ids[b, s] != segment_ids[b, t]:
                        continue
                    Rt = rotation_matrix(t, K) if use_rope else np.eye(K)
                    Rs = rotation_matrix(s, K) if use_rope else np.eye(K)
                    a = (Rt @ (y[b, t] @ Wq[:, h])) @ (Rs @ (c[b, s] @ Wk[:, g]))
                    if d is not None:
                        dh = np.asarray(d)[h] if np.ndim(d) == 2 else np.asarray(d)
                        a += y[b, t] @ (dh * c[b, s])
                    scores.append(beta * a)
                E[b, t] -= special.logsumexp(scores) / beta
    return E


@pytest.mark.parametrize("use_rope", [True, False])
@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("diag", [None, "per_head", "shared"])
def test_attention_energy_matches_brute_force(use_rope, G, diag):
    rng = np.random.default_rng(1)
    B, T, D, H, K = 2, 5, 6, 4, 4
    spec = AttentionSpec(H, G, K, use_rope)
    params = {"query": rng.normal(size=(D, H, K)), "key": rng.normal(size=(D, G, K))}
    if diag == "per_head":
        params["diag"] = rng.normal(size=(H, D))
    elif diag == "shared":
        params["diag"] = rng.normal(size=(D,))
    y, c = rng.normal(size=(B, T, D)), rng.normal(size=(B, T, D))
    seg = np.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 1]])
    for segment_ids in (None, seg):
        got = attention_energy(jax.tree.map(jnp.float32, params), jnp.float32(y),
                               jnp.float32(c), spec=spec,
                               segment_ids=None if segment_ids is None else jnp.asarray(seg))
        want = _brute_attention_energy(params, y, c, spec, use_rope, segment_ids)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_mlp_energy_matches_formula(name):
    rng = np.random.default_rng(2)
    D, F = 5, 7
    params = {"gate": rng.normal(size=(D, F)), "up": rng.normal(size=(D, F))}
    y, c = rng.normal(size=(2, 3, D)), rng.normal(size=(2, 3, D))
    phi = np.vectorize(lambda a: integrate.quad(SIGMA[name], -np.inf, a)[0])
    want = -np.sum((c @ params["up"]) * phi(y @ params["gate"]), axis=-1)
    got = mlp_energy(jax.tree.map(jnp.float32, params), jnp.float32(y), jnp.float32(c),
                     activation=get_activation(name))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_registered_activation_becomes_a_model_layer():
    """A new σ with its antiderivative, registered by name, builds a CEM MLP whose update is the
    -∇ of its energy (the closed form uses σ = tanh, the energy Φ = log cosh)."""
    name = "logcosh_test"
    if name not in ACTIVATIONS:
        register_activation(name, jnp.tanh, lambda a: jnp.logaddexp(a, -a) - jnp.log(2.0))
    with pytest.raises(ValueError, match="already registered"):
        register_activation(name, jnp.tanh, jnp.cosh)
    cfg = ModelConfig(vocab_size=16, d_model=8, num_layers=1, num_heads=2, mlp_dim=12,
                      activation=name)
    assert CEMTransformer(cfg, rngs=nnx.Rngs(0)).blocks.mlp.mixer.kind == "cem_mlp"
    params = {"gate": jax.random.normal(jax.random.PRNGKey(1), (8, 12)),
              "up": jax.random.normal(jax.random.PRNGKey(2), (8, 12))}
    y, c = jax.random.normal(jax.random.PRNGKey(3), (2, 1, 5, 8))
    mixer = tied_mlp_mixer(params, get_activation(cfg.activation))
    def energy(y):  # E(y | c) = -Σ_j (Wu c)_j log cosh((Wg y)_j), summed over tokens
        return -jnp.sum((c @ params["up"]) * jnp.log(jnp.cosh(y @ params["gate"])))

    assert_close_to_scale(mixer.direction(y, mixer.prepare(c, 0)), -jax.grad(energy)(y), 1e-5)
    assert_close_to_scale(jnp.sum(mixer.energy(y, c)), energy(y), 1e-5)
    with pytest.raises(ValueError, match="activation"):
        ModelConfig(activation="not_registered")
