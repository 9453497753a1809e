"""The generic numerics under every layer: RMSNorm and its vector-Jacobian product, the dense
product, and the split of a projection into heads and back. Nothing here knows of energies,
kinds or configs; `updates`, `layers`, `model`, `loss` and the preconditioners build on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


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


def dense(x: Array, w: Array, **kwargs) -> Array:
    """x [..., D] @ w [D, N] → [..., N] as one 2-D matmul over the flattened leading axes.

    The same product as `x @ w`, but on CPU XLA lays out the backward of a 3-D `[B,T,D] @
    [D,N]` with slow transposing copies of the [B,T,N] gradient, which the 2-D form avoids
    (benchmarks/train_step.py measures it). kwargs go to `jnp.matmul` (e.g.
    preferred_element_type).
    """
    return jnp.matmul(x.reshape(-1, x.shape[-1]), w, **kwargs).reshape(*x.shape[:-1], -1)


def split_heads(x: Array, w: Array) -> Array:
    """Project x [B,T,D] with w [D,N,K] to heads-major [B,N,T,K] (one 2-D matmul, then a
    transpose: faster on CPU than a direct einsum into that layout)."""
    B, T, _ = x.shape
    D, N, K = w.shape
    return dense(x, w.reshape(D, N * K)).reshape(B, T, N, K).transpose(0, 2, 1, 3)


def merge_heads(o: Array, w: Array) -> Array:
    """Σ_n o_n W_n: heads-major o [B,N,T,K] with w [N·K, D] back to [B,T,D]."""
    B, N, T, K = o.shape
    return dense(o.transpose(0, 2, 1, 3).reshape(B, T, N * K), w)
