"""Sub-layer updates: closed forms of the energy gradients, the Llama baseline, preconditioners,
recursive steps, and the one dispatch point between implementations (DESIGN.md §1–§2).

A sub-layer with input x⁰ [B,T,D] fixes the context c = RMSNorm(x⁰) and takes `steps` steps

    xᵏ⁺¹ = xᵏ + P·u(yᵏ | c),   yᵏ = RMSNorm(xᵏ),   u = -∇_y E(y | c)   (k = 0 … steps-1)

`Mixer` bundles one sub-layer's math as functions of (y, c); `run_steps` is the step loop and the
dispatch: `impl="autodiff"` takes u from `-jax.grad(mixer.energy)`, `impl="xla"` from the closed
form `mixer.direction`. Untied (Llama) sub-layers have no energy: their "direction" is the
ordinary Llama output, so a baseline block is exactly a pre-norm Llama block at steps=1, P=I.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cem_jax.energies import (
    Activation,
    AttentionSpec,
    attention_energy,
    attention_mask,
    default_positions,
    mlp_energy,
    rope,
)

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# RMSNorm and its vector-Jacobian product (for gradients taken through the norm).
# ----------------------------------------------------------------------------------------------


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm: x / sqrt(mean(x²) + eps) · scale, over the last axis D, computed in fp32 and
    returned in x.dtype (Zhang & Sennrich 2019; Hugging Face LlamaRMSNorm)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale.astype(jnp.float32)).astype(x.dtype)


def rms_norm_vjp(x: Array, scale: Array, eps: float, v: Array) -> Array:
    """Jᵀv for J = ∂RMSNorm(x)/∂x, in closed form, [B,T,D]:

        (Jᵀv)_j = (s⊙v)_j / r - x_j · Σ_i (s⊙v⊙x)_i / (D r³),   r = sqrt(mean(x²) + eps)
    """
    x32, sv = x.astype(jnp.float32), (v * scale).astype(jnp.float32)
    r2 = jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps
    inv = jax.lax.rsqrt(r2)
    proj = jnp.sum(sv * x32, axis=-1, keepdims=True) / (x.shape[-1] * r2)
    return ((sv - x32 * proj) * inv).astype(v.dtype)


# ----------------------------------------------------------------------------------------------
# Attention: the closed-form update of the interaction energy, and Llama attention.
# ----------------------------------------------------------------------------------------------


def _softmax_weights(logits: Array, mask: Array) -> tuple[Array, Array]:
    """Masked softmax over the last axis, fp32: (p, logsumexp)."""
    logits = jnp.where(mask, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.exp(logits - lse[..., None]), lse


def _queries(y: Array, w: Array, positions: Array, spec: AttentionSpec) -> Array:
    """Rotated queries, heads-major [B,G,R,T,K] (heads-major layout is fastest on CPU)."""
    B, T, _ = y.shape
    q = jnp.einsum("btd,dhk->bhtk", y, w)
    q = rope(q, positions, spec.rope_theta) if spec.use_rope else q
    return q.reshape(B, spec.num_kv_heads, -1, T, spec.head_dim)


def _keys(c: Array, w: Array, positions: Array, spec: AttentionSpec) -> Array:
    """Rotated keys, heads-major [B,G,S,K]."""
    k = jnp.einsum("btd,dgk->bgtk", c, w)
    return rope(k, positions, spec.rope_theta) if spec.use_rope else k


class Mixer(NamedTuple):
    """One sub-layer's math on the variable y [B,T,D] and the fixed context c [B,T,D].

    prepare(c) -> context tensors computed once per sub-layer (keys, Wu c, ...);
    direction(y, prepared) -> the update direction u [B,T,D] (closed form, no autodiff);
    energy(y, c) -> per-token energy fp32 [B,T], or None for an untied (Llama) sub-layer.
    """

    prepare: Callable[[Array], Any]
    direction: Callable[[Array, Any], Array]
    energy: Callable[[Array, Array], Array] | None


def tied_attention_mixer(params: dict, spec: AttentionSpec, positions: Array | None,
                         segment_ids: Array | None) -> Mixer:
    """CEM attention: u = -∇_y E_attn(y | c) in closed form (DESIGN.md §1):

        u_t = Σ_h [ Wq_h R_tᵀ Σ_s p_ts R_s Wk_g c_s + d_h ⊙ Σ_s p_ts c_s ],  p_t = softmax(β a_h)

    Values are the rotated keys, the output projection is Wqᵀ; the diagonal (DPLR) part attends
    with query d_h ⊙ y and key/value c. params as in `attention_energy`.
    """
    diag = params.get("diag")

    def prepare(c):
        B, T, _ = c.shape
        pos = default_positions(B, T) if positions is None else positions
        return c, pos, _keys(c, params["key"], pos, spec), attention_mask(segment_ids, T)

    def direction(y, prepared):
        c, pos, k, mask = prepared
        B, T, D = y.shape
        q = _queries(y, params["query"], pos, spec)
        logits = jnp.einsum("bgrtk,bgsk->bgrts", q, k, preferred_element_type=jnp.float32)
        if diag is not None:
            yd = y[:, None] * diag.reshape(-1, 1, D)  # [B,H or 1,T,D]
            dl = jnp.einsum("bhtd,bsd->bhts", yd, c, preferred_element_type=jnp.float32)
            logits = logits + dl.reshape(B, -1, 1 if diag.ndim == 1 else q.shape[2], T, T)
        p, _ = _softmax_weights(logits * spec.beta, mask)
        p = p.astype(y.dtype)
        o = jnp.einsum("bgrts,bgsk->bgrtk", p, k).reshape(B, spec.num_heads, T, -1)
        o = rope(o, -pos, spec.rope_theta) if spec.use_rope else o
        u = jnp.einsum("bhtk,dhk->btd", o, params["query"])
        if diag is not None and diag.ndim == 2:  # per head: Σ_h d_h ⊙ (p_h @ c)
            oc = jnp.einsum("bhts,bsd->bhtd", p.reshape(B, -1, T, T), c)
            u = u + jnp.einsum("bhtd,hd->btd", oc, diag)
        elif diag is not None:  # shared d: Σ_h d ⊙ (p_h @ c) = d ⊙ ((Σ_h p_h) @ c)
            u = u + diag * jnp.einsum("bts,bsd->btd", p.sum(axis=(1, 2)), c)
        return u

    def energy(y, c):
        return attention_energy(params, y, c, spec=spec, positions=positions,
                                segment_ids=segment_ids)

    return Mixer(prepare, direction, energy)


def llama_attention_mixer(params: dict, spec: AttentionSpec, positions: Array | None,
                          segment_ids: Array | None) -> Mixer:
    """Untied Llama attention (the baseline): softmax(β q kᵀ) v Wo with free Wq [D,H,K],
    Wk [D,G,K], Wv [D,G,K], Wo [H,K,D]; queries from y, keys/values from c. No energy."""

    def prepare(c):
        B, T, _ = c.shape
        pos = default_positions(B, T) if positions is None else positions
        v = jnp.einsum("btd,dgk->bgtk", c, params["value"])
        return pos, _keys(c, params["key"], pos, spec), v, attention_mask(segment_ids, T)

    def direction(y, prepared):
        pos, k, v, mask = prepared
        B, T, _ = y.shape
        q = _queries(y, params["query"], pos, spec)
        logits = jnp.einsum("bgrtk,bgsk->bgrts", q, k, preferred_element_type=jnp.float32)
        p, _ = _softmax_weights(logits * spec.beta, mask)
        o = jnp.einsum("bgrts,bgsk->bgrtk", p.astype(y.dtype), v)
        return jnp.einsum("bhtk,hkd->btd", o.reshape(B, spec.num_heads, T, -1), params["out"])

    return Mixer(prepare, direction, None)


# ----------------------------------------------------------------------------------------------
# Gated MLP: the closed-form update of the element-wise energy, and SwiGLU.
# ----------------------------------------------------------------------------------------------


def tied_mlp_mixer(params: dict, activation: Activation) -> Mixer:
    """CEM MLP: u = -∇_y E_mlp(y | c) = Wgᵀ(σ(Wg y) ⊙ Wu c), gate tied to down by transpose."""

    def prepare(c):
        return jnp.einsum("btd,df->btf", c, params["up"])

    def direction(y, up):
        gate = jnp.einsum("btd,df->btf", y, params["gate"])
        return jnp.einsum("btf,df->btd", activation.fn(gate) * up, params["gate"])

    def energy(y, c):
        return mlp_energy(params, y, c, activation=activation)

    return Mixer(prepare, direction, energy)


def swiglu_mixer(params: dict, activation: Activation) -> Mixer:
    """Untied gated MLP (SwiGLU for SiLU): Wdown(σ(Wg y) ⊙ Wu c), Wdown [F,D]. No energy."""

    def prepare(c):
        return jnp.einsum("btd,df->btf", c, params["up"])

    def direction(y, up):
        gate = jnp.einsum("btd,df->btf", y, params["gate"])
        return jnp.einsum("btf,fd->btd", activation.fn(gate) * up, params["down"])

    return Mixer(prepare, direction, None)


# ----------------------------------------------------------------------------------------------
# Preconditioners: P positive definite by construction.
# ----------------------------------------------------------------------------------------------


def precondition(kind: str, params: dict, u: Array) -> Array:
    """P·u for u [B,T,D] (DESIGN.md §1, "lightweight preconditioner").

    none: P = I. scalar: P = softplus(ρ)·I, ρ []. diag: P = diag(softplus(ρ)), ρ [D].
    dplr: P = diag(softplus(ρ)) + U Uᵀ, ρ [D], U [D,r] (positive definite for any U).
    Raises `ValueError` for an unknown kind.
    """
    if kind == "none":
        return u
    if kind not in ("scalar", "diag", "dplr"):
        raise ValueError(f"unknown preconditioner {kind!r}; use none, scalar, diag or dplr")
    out = jax.nn.softplus(params["rho"]).astype(u.dtype) * u
    if kind == "dplr":
        U = params["U"].astype(u.dtype)
        out = out + jnp.einsum("btr,dr->btd", jnp.einsum("btd,dr->btr", u, U), U)
    return out


# ----------------------------------------------------------------------------------------------
# The step loop: the single dispatch point between implementations.
# ----------------------------------------------------------------------------------------------

IMPLS = ("autodiff", "xla")


def run_steps(x0: Array, mixer: Mixer, *, norm_scale: Array, eps: float,
              precond: Callable[[Array], Array], steps: int = 1, impl: str = "xla",
              gradient_wrt: str = "normalized", recompute_context: bool = False,
              monitor: bool = False) -> tuple[Array, Array | None]:
    """Apply one CEM sub-layer to the residual stream x0 [B,T,D]; returns (x_T, energies).

    impl: "xla" uses the closed form `mixer.direction`; "autodiff" uses -jax.grad of
      `mixer.energy` (untied mixers have no energy and always use their forward).
    gradient_wrt: "normalized" (u = -∇_y E) or "residual" (u = -∇_x E(RMSNorm(x) | c)).
    recompute_context: c = RMSNorm(xᵏ) at every step instead of RMSNorm(x⁰).
    monitor: also return energies fp32 [steps, 2, B, T]: E(yᵏ | cᵏ) before and E(yᵏ⁺¹ | cᵏ)
      after each step (None for untied mixers or when monitor is False).
    Raises `ValueError` for an unknown impl or gradient_wrt.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; use one of {IMPLS}")
    if gradient_wrt not in ("normalized", "residual"):
        raise ValueError(f"unknown gradient_wrt {gradient_wrt!r}; use normalized or residual")
    use_autodiff = impl == "autodiff" and mixer.energy is not None

    def norm(x):
        return rms_norm(x, norm_scale, eps)

    def direction(x, y, c, prepared):
        if use_autodiff:
            if gradient_wrt == "residual":
                return -jax.grad(lambda x_: mixer.energy(norm(x_), c).sum())(x)
            return -jax.grad(lambda y_: mixer.energy(y_, c).sum())(y)
        u = mixer.direction(y, prepared)
        return rms_norm_vjp(x, norm_scale, eps, u) if gradient_wrt == "residual" else u

    x, c = x0, norm(x0)
    prepared = None if use_autodiff else mixer.prepare(c)
    energies = []
    for k in range(steps):
        y = c if k == 0 else norm(x)
        if recompute_context and k > 0:
            c = y
            prepared = None if use_autodiff else mixer.prepare(c)
        x_next = x + precond(direction(x, y, c, prepared))
        if monitor and mixer.energy is not None:
            energies.append(jnp.stack([mixer.energy(y, c), mixer.energy(norm(x_next), c)]))
        x = x_next
    return x, (jnp.stack(energies) if energies else None)
