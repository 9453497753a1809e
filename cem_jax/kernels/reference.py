"""The plain-`jnp` reference of tied (value = key) attention: the oracle of the kernel tests and
the XLA fallback on CPU (differentiated by JAX autodiff; it materializes the [B,H,T,S] logits,
so its memory grows quadratically with T).

    o_t = Σ_{s≤t} softmax_s(β q_t·k_s) k_s,   lse_t = log Σ_{s≤t} exp(β q_t·k_s),
    energy_t = -(1/β)·lse_t                   (DESIGN.md §1, interaction energy per head)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def tied_attention_reference(q: Array, k: Array, *, causal: bool = True,
                             segment_ids: Array | None = None, scale: float | None = None
                             ) -> tuple[Array, Array]:
    """(o, lse) of tied attention, computed in fp32 without tiling.

    q [B,T,H,K], k [B,S,G,K] (H % G == 0; query head h reads key head h // (H/G)),
    causal: s ≤ t (top-left aligned when S != T); segment_ids int [B,T] (needs S == T):
    attend only within a packed document; scale: β (default 1/√K).
    Returns o [B,T,H,K] in q.dtype and lse fp32 [B,H,T]. Every row must see one key.
    """
    B, T, H, K = q.shape
    S, G = k.shape[1], k.shape[2]
    beta = 1.0 / K**0.5 if scale is None else scale
    qh = q.astype(jnp.float32).reshape(B, T, G, H // G, K)
    kf = k.astype(jnp.float32)
    logits = beta * jnp.einsum("btgrk,bsgk->bgrts", qh, kf,
                               precision=jax.lax.Precision.HIGHEST)
    mask = jnp.ones((T, S), bool)
    if causal:
        mask = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
    mask = mask[None, None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B,G,R,T]
    p = jnp.exp(logits - lse[..., None])
    o = jnp.einsum("bgrts,bsgk->btgrk", p, kf, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, T, H, K).astype(q.dtype), lse.reshape(B, H, T)
