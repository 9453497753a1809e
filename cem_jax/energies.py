"""The conditional energies of CEM, as pure functions of arrays (DESIGN.md §1; arXiv 2605.07588).

Every CEM sub-layer is a gradient step on one of these energies: the variable `y` [B,T,D] is the
token being updated, the context `c` [B,T,D] (the sub-layer's normalized input) is held fixed.
The update `-jax.grad(energy)` with respect to `y` is the definition that every fast path in
`cem_jax.updates` (and the kernels) must reproduce.

Parameters are plain dicts of arrays (no Flax here):
  attention: {"query": Wq [D,H,K], "key": Wk [D,G,K], optional "diag": d [H,D] or [D]}
  mlp:       {"gate": Wg [D,F], "up": Wu [D,F]}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtr, spence

from cem_jax.config import ACTIVATION_NAMES, ROPE_TYPES, RopeScaling

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Activations with a true antiderivative Φ (Φ' = σ), so that the MLP energy can be evaluated.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation σ and its antiderivative Φ with Φ' = σ and Φ(-∞) = 0 (elementwise)."""

    name: str
    fn: Callable[[Array], Array]
    antiderivative: Callable[[Array], Array]


def _with_derivative(primal: Callable[[Array], Array], derivative: Callable[[Array], Array]):
    """Φ whose JVP is exactly σ: autodiff of the energy then gives the closed-form update bit for
    bit in its structure, and stays differentiable to any order (σ itself is)."""
    phi = jax.custom_jvp(primal)
    phi.defjvp(lambda primals, tangents: (primal(primals[0]), derivative(primals[0]) * tangents[0]))
    return phi


def _silu_antiderivative(a: Array) -> Array:
    # Φ(a) = a·softplus(a) + Li₂(-eᵃ), with Li₂(-eᵃ) = spence(1 + eᵃ) (scipy's convention).
    # For a > 0 use the inversion Li₂(-eᵃ) = -π²/6 - a²/2 - Li₂(-e⁻ᵃ) and
    # a·softplus(a) = a² + a·softplus(-a), so nothing overflows: finite for |a| up to 1e4 and
    # beyond in fp32 (Φ(a) ≈ a²/2 - π²/6 for large a, Φ(a) → 0 as a → -∞).
    li2 = spence(1.0 + jnp.exp(-jnp.abs(a)))  # Li₂(-e^{-|a|}) ∈ [-π²/12, 0]
    a_softplus = a * jax.nn.softplus(-jnp.abs(a))
    positive = 0.5 * a * a - math.pi**2 / 6.0 - li2
    return a_softplus + jnp.where(a > 0, positive, li2)


def _gelu_antiderivative(a: Array) -> Array:
    # Φ(a) = ((a² - 1)·Φ_N(a) + a·φ_N(a)) / 2 for the exact GELU a·Φ_N(a).
    pdf = jnp.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    return 0.5 * ((a * a - 1.0) * ndtr(a) + a * pdf)


def _relu_antiderivative(a: Array) -> Array:
    return 0.5 * jnp.square(jnp.maximum(a, 0.0))


def _gelu(a: Array) -> Array:
    return jax.nn.gelu(a, approximate=False)


ACTIVATIONS: dict[str, Activation] = {
    "silu": Activation("silu", jax.nn.silu, _with_derivative(_silu_antiderivative, jax.nn.silu)),
    "gelu": Activation("gelu", _gelu, _with_derivative(_gelu_antiderivative, _gelu)),
    "relu": Activation("relu", jax.nn.relu, _with_derivative(_relu_antiderivative, jax.nn.relu)),
}


def register_activation(name: str, fn: Callable[[Array], Array],
                        antiderivative: Callable[[Array], Array]) -> Activation:
    """Make σ = `fn` with its antiderivative Φ = `antiderivative` (Φ' = σ, elementwise) a
    model's `activation`: `ModelConfig(activation=name)` then builds CEM MLPs with the energy
    -Σ_j (Wu c)_j Φ((Wg y)_j) and the update Wgᵀ(σ(Wg y) ⊙ Wu c) (DESIGN.md §1, §2: a new
    energy gets its layer without new layer code). Autodiff of the energy uses `fn` as Φ'
    (as for the built-in ones), so check Φ' = σ yourself, e.g. against `jax.grad`.

    Returns the `Activation`. Raises `ValueError` if `name` is already registered. A
    registration lives in the process that made it: call it in a module of your own and name
    that module in the config's top-level `imports` (`cem_jax.train_config.TrainConfig`), so
    that cem-train, a resume and a loaded run (cem-eval, cem-sample) register it first.
    Exported Hugging Face models know silu, gelu, relu only.
    """
    if name in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is already registered; pick another name")
    ACTIVATIONS[name] = Activation(name, fn, _with_derivative(antiderivative, fn))
    ACTIVATION_NAMES.append(name)  # what ModelConfig accepts
    return ACTIVATIONS[name]


def get_activation(name: str) -> Activation:
    """The activation called `name`; raises `ValueError` listing the known ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# ----------------------------------------------------------------------------------------------
# Positions: RoPE and the causal (+ document) mask.
# ----------------------------------------------------------------------------------------------


NO_SCALING = RopeScaling()  # RoPE as Su et al. wrote it


def rope_frequencies(head_dim: int, theta: float = 10000.0,
                     scaling: RopeScaling = NO_SCALING) -> Array:
    """RoPE's angular frequency of each feature pair, fp32 [K/2] in radians per position:
    ω_i = theta^(-2i/K), then `scaling` (`RopeScaling`). Raises ValueError for an unknown
    `scaling.rope_type`."""
    half = head_dim // 2
    omega = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "default":
        return omega
    if kind == "linear":
        return omega / factor
    if kind == "llama3":
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / omega
        context = scaling.original_max_position
        s = (context / wavelength - low) / (high - low)
        between = (1 - s) * omega / factor + s * omega
        return jnp.where(wavelength < context / high, omega,
                         jnp.where(wavelength > context / low, omega / factor, between))
    raise ValueError(f"unknown rope_type {kind!r}; known: {', '.join(ROPE_TYPES)}")


def rope_tables(positions: Array, head_dim: int, theta: float = 10000.0,
                scaling: RopeScaling = NO_SCALING) -> tuple[Array, Array]:
    """cos and sin of the RoPE angles at integer `positions` [B,T]: fp32 [B,1,T,K/2] each
    (angle t·ω_i for feature pair i, `rope_frequencies`; compute once, rotate many heads with
    them).

    The tables leave through an identity gather. XLA's fusion (CPU, JAX 0.10.2) counts cos and
    sin as cheap and recomputes them inside every fusion that reads the tables: the rotations of
    queries, keys, the tied output and their backward, six per tied attention sub-layer step. A
    gather is not duplicated, so the tables are computed once (one rotation of the `make train`
    model's queries: 1.85 ms with cos/sin fused in, 0.38 ms reading the tables; the tied
    model's train step ~11% faster; DESIGN.md §6).
    """
    omega = rope_frequencies(head_dim, theta, scaling)
    angles = positions.astype(jnp.float32)[:, None, :, None] * omega
    tables = jnp.stack([jnp.cos(angles), jnp.sin(angles)])
    cos, sin = jnp.take(tables, jnp.arange(2), axis=0)
    return cos, sin


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate heads-major `x` [B,N,T,K] by `rope_tables`; (cos, -sin) rotates back by R_tᵀ.

    Half-split convention of Hugging Face Llama (`rotate_half`): feature i pairs with i + K/2.
    Computed in fp32, returned in x.dtype. (Su et al., RoFormer, arXiv 2104.09864.)
    """
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope(x: Array, positions: Array, theta: float = 10000.0,
         scaling: RopeScaling = NO_SCALING) -> Array:
    """RoPE of heads-major `x` [B,N,T,K] at `positions` [B,T]; `rope(x, -positions)` is the
    inverse rotation R_tᵀ. (`apply_rope` with `rope_tables`.)"""
    return apply_rope(x, *rope_tables(positions, x.shape[-1], theta, scaling))


def attention_mask(segment_ids: Array | None, seq_len: int) -> Array:
    """Boolean mask [B or 1, 1, 1, T, S]: True where query t may read key s.

    Causal (s ≤ t) and, with `segment_ids` [B,T], only within the same packed document.
    """
    mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))[None, None, None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask & same[:, None, None]
    return mask


def default_positions(batch: int, seq_len: int) -> Array:
    """Positions 0..T-1 for every row: int32 [B,T]."""
    return jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))


# ----------------------------------------------------------------------------------------------
# The energies.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static settings of one attention sub-layer: H, G, K, RoPE (theta and `RopeScaling`), and
    the query block size of the closed-form update (it does not change the math)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    use_rope: bool = True
    rope_theta: float = 10000.0
    block_size: int = 128  # query block of the closed form's causal block skipping
    rope_scaling: RopeScaling = NO_SCALING

    @property
    def beta(self) -> float:
        """Inverse temperature β = 1/√K."""
        return 1.0 / math.sqrt(self.head_dim)


def attention_logits(params: dict, y: Array, c: Array, positions: Array, spec: AttentionSpec
                     ) -> Array:
    """β·a_h(y_t, c_s) for every head and pair, fp32 [B,G,R,T,S] (H = G·R, head h = g·R + r).

    a_h(y, c) = (R_t Wq_h y)ᵀ (R_s Wk_g c) + yᵀ diag(d_h) c   (DESIGN.md §1, interaction energy).
    """
    B, T, _ = y.shape
    G, R = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    q = jnp.einsum("btd,dhk->bhtk", y, params["query"])
    k = jnp.einsum("btd,dgk->bgtk", c, params["key"])
    if spec.use_rope:
        q, k = (rope(a, positions, spec.rope_theta, spec.rope_scaling) for a in (q, k))
    q = q.reshape(B, G, R, T, -1)
    logits = jnp.einsum("bgrtk,bgsk->bgrts", q, k, preferred_element_type=jnp.float32)
    if "diag" in params:
        d = params["diag"]
        yd = y[:, None, :, :] * d.reshape(-1, 1, d.shape[-1])  # [B,H or 1,T,D]
        diag = jnp.einsum("bhtd,bsd->bhts", yd, c, preferred_element_type=jnp.float32)
        logits = logits + diag.reshape(B, -1, R if d.ndim == 2 else 1, T, T)
    return logits * spec.beta


def attention_energy(params: dict, y: Array, c: Array, *, spec: AttentionSpec,
                     positions: Array | None = None, segment_ids: Array | None = None) -> Array:
    """Interaction energy per token, fp32 [B,T]:

        E_attn(y_t | c_≤t) = -(1/β) Σ_h log Σ_{s≤t} exp(β a_h(y_t, c_s))

    y, c: [B,T,D] (variable and fixed context); positions: int [B,T] (default 0..T-1);
    segment_ids: int [B,T] packed-document ids (attention stays inside a document).
    Its negative gradient in y is weight-tied attention: value = key, output = queryᵀ.
    """
    B, T, _ = y.shape
    positions = default_positions(B, T) if positions is None else positions
    logits = attention_logits(params, y, c, positions, spec)
    logits = jnp.where(attention_mask(segment_ids, T), logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B,G,R,T]
    return -lse.sum(axis=(1, 2)) / spec.beta


def mlp_energy(params: dict, y: Array, c: Array, *, activation: Activation) -> Array:
    """Element-wise energy per token, fp32 [B,T]:

        E_mlp(y | c) = -Σ_j (Wu c)_j · Φ((Wg y)_j),   Φ' = σ

    y, c: [B,T,D]; params "gate" Wg and "up" Wu are [D,F]. Its negative gradient in y is
    Wgᵀ(σ(Wg y) ⊙ Wu c): at y = c a SwiGLU (for σ = SiLU) whose down projection is Wgᵀ.
    """
    gate = jnp.einsum("btd,df->btf", y, params["gate"], preferred_element_type=jnp.float32)
    up = jnp.einsum("btd,df->btf", c, params["up"], preferred_element_type=jnp.float32)
    return -jnp.sum(up * activation.antiderivative(gate), axis=-1)
