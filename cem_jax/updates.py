"""Closed forms of the energy gradients u = -∇_y E(y | c), and the Llama baseline (DESIGN.md
§1–§2).

`Mixer` bundles one sub-layer's math as functions of the variable y and the fixed context c:
its energy (the oracle), and its closed-form direction, whose attention core
(`cem_jax.attention`: XLA, the Pallas kernel or cuDNN) the attention mixers choose at trace
time. The step loop that applies a mixer, and the preconditioner P, sit with the sub-layer
(`cem_jax.layers.run_steps`). Untied (Llama) sub-layers have no energy: their
"direction" is the ordinary Llama output, so a baseline block is exactly a pre-norm Llama block
at steps=1, P=I. The attention mixers read their context from the sequence itself or from a
decode cache (`cem_jax.kvcache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cem_jax import kvcache
from cem_jax.attention import (
    attention_impl,
    causal_attention,
    cudnn_attention,
    pallas_attention,
    splash_attention,
)
from cem_jax.energies import (
    Activation,
    AttentionSpec,
    apply_rope,
    attention_energy,
    attention_mask,
    default_positions,
    mlp_energy,
    rope_tables,
)
from cem_jax.kvcache import Cache, KVCache
from cem_jax.numerics import dense, merge_heads, split_heads

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Attention: the closed-form update of the interaction energy, and Llama attention.
# ----------------------------------------------------------------------------------------------


def _rope_tables(positions: Array, spec: AttentionSpec) -> tuple[Array, Array] | None:
    """RoPE's cos/sin for this sub-layer, computed once (None without RoPE)."""
    return (rope_tables(positions, spec.head_dim, spec.rope_theta, spec.rope_scaling)
            if spec.use_rope else None)


def _rotated(x: Array, tables: tuple[Array, Array] | None, inverse: bool = False) -> Array:
    """R_t x (or R_tᵀ x with `inverse`) for heads-major x [B,N,T,K]; x itself without RoPE."""
    if tables is None:
        return x
    cos, sin = tables
    return apply_rope(x, cos, -sin if inverse else sin)


class AttentionContext(NamedTuple):
    """What the queries of one attention sub-layer step read (`Mixer.prepare` of attention):

    key:     [B,G,S,K] rotated keys R_s Wk c_s (tied attention: the values too)
    value:   [B,G,S,K] values Wv c_s (untied attention), else None
    context: [B,S,D] c_s, key and value of the DPLR diagonal head (tied DPLR), else None
    mask:    bool [B|1,1,1,T,S], True where query t may read slot s
    rope:    RoPE tables (cos, sin) fp32 [B,1,T,K/2] at the queries' positions, None for NoPE

    S is the sequence itself (T slots), or a decode cache's slots with the T new tokens written
    in (`cem_jax.kvcache`); then key/value/context are the updated cache of this context.
    """

    key: Array
    value: Array | None
    context: Array | None
    mask: Array
    rope: tuple[Array, Array] | None


class Mixer(NamedTuple):
    """One sub-layer's math on the variable y [B,T,D] and the fixed context c [B,T,D].

    prepare(c, index) -> what the direction reads of the context, computed once per context
      (keys or an `AttentionContext`, Wu c, ...); `index` numbers a sub-layer's contexts (0, and
      k at step k with recompute_context) so that a decode cache keeps one per context;
    direction(y, prepared) -> the update direction u [B,T,D] (closed form, no autodiff), or
      P·u when the mixer was built with a preconditioner folded in (params["out_scale"]);
    energy(y, c) -> per-token energy fp32 [B,T], or None (an untied Llama sub-layer, or a
      cached one: its context is the cache, and the update is the closed form).
    """

    prepare: Callable[[Array, int], Any]
    direction: Callable[[Array, Any], Array]
    energy: Callable[[Array, Array], Array] | None


def _attention_context(params: dict, spec: AttentionSpec, positions: Array | None,
                       segment_ids: Array | None, cache: Cache | None, *, values: bool,
                       context: bool) -> Callable[[Array, int], AttentionContext]:
    """`Mixer.prepare` of both attention kinds: keys (and `values`, and c itself as the DPLR
    `context`) of the tokens c [B,T,D] at `positions` (default 0..T-1), read with the causal
    mask of `segment_ids`; or, with a `cache` (`KVCache` leaves [C,...], `length`), written into
    cache context `index` at slots length … length+T-1 and read with `kvcache.slot_mask`."""

    def prepare(c, index):
        B, T, _ = c.shape
        if positions is not None:
            pos = positions
        elif cache is None:
            pos = default_positions(B, T)
        else:
            pos = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        tables = _rope_tables(pos, spec)
        new = KVCache(_rotated(split_heads(c, params["key"]), tables),
                      split_heads(c, params["value"]) if values else None,
                      c if context else None)
        if cache is None:
            return AttentionContext(*new, attention_mask(segment_ids, T), tables)
        slots = jax.tree.map(lambda s, n: kvcache.write(s[index], n, cache.length),
                             cache.layers, new)
        return AttentionContext(*slots, kvcache.slot_mask(pos, cache.length,
                                                          slots.key.shape[-2]), tables)

    return prepare


def _query_heads(y: Array, params: dict, spec: AttentionSpec, ctx: AttentionContext) -> Array:
    """Rotated queries R_t Wq y grouped by key head: y [B,T,D] → [B,G,H/G,T,K]."""
    B, T, _ = y.shape
    q = _rotated(split_heads(y, params["query"]), ctx.rope)
    return q.reshape(B, spec.num_kv_heads, -1, T, spec.head_dim)


def _with_diagonal_head(q: Array, k: Array, y: Array, diag: Array, context: Array,
                        spec: AttentionSpec) -> tuple[Array, Array]:
    """The DPLR diagonal as a second head concatenated onto the low-rank one: queries
    [B,G,H/G,T,K] gain d_h ⊙ y [.., D] (d [H,D] per head or [D] shared), keys [B,G,S,K] gain the
    context c [B,S,D] itself, so one attention gives both (values = keys)."""
    B, T, D = y.shape
    G, S = spec.num_kv_heads, k.shape[-2]
    yd = y[:, None] * diag.reshape(-1, 1, D)  # [B,H or 1,T,D]
    yd = jnp.broadcast_to(yd, (B, spec.num_heads, T, D)).reshape(B, G, -1, T, D)
    return (jnp.concatenate([q, yd], axis=-1),
            jnp.concatenate([k, jnp.broadcast_to(context[:, None], (B, G, S, D))], axis=-1))


def tied_attention_mixer(params: dict, spec: AttentionSpec, positions: Array | None,
                         segment_ids: Array | None, *, impl: str = "xla",
                         cache: Cache | None = None) -> Mixer:
    """CEM attention: u = -∇_y E_attn(y | c) in closed form (DESIGN.md §1):

        u_t = Σ_h [ Wq_h R_tᵀ Σ_s p_ts R_s Wk_g c_s + d_h ⊙ Σ_s p_ts c_s ],  p_t = softmax(β a_h)

    Values are the rotated keys, the output projection is Wqᵀ; the diagonal (DPLR) part attends
    with query d_h ⊙ y and key/value c, computed as a second head concatenated onto the
    low-rank one. params as in `attention_energy`. The attention core follows `impl`
    (`attention_impl`): "xla" and "autodiff" (its closed form, for monitors) attend in causal
    blocks of `spec.block_size` queries that skip the keys after them; "pallas" runs the fused
    kernel `cem_jax.kernels.tied_attention` (interpreted on CPU); "cudnn" runs cuDNN's flash
    attention as dpa(R q, R k, R k); "auto" picks per platform. RoPE, its un-rotation, the
    DPLR concatenation and the output projection stay in XLA around the core.

    With a decode `cache` (`cem_jax.kvcache.Cache` of this sub-layer: leaves [C,...]) the
    context is the cache: `prepare` writes the tokens' keys into it and the core is `attend`
    over every slot under the slot mask, whatever `impl` says (the block-skipping core and the
    kernel serve whole sequences); the mixer then has no energy (monitor full sequences).

    params may hold "out_scale" ([] or [D]): a scalar or diagonal preconditioner P folded into
    the output projection, so that direction returns P·u (`fold_preconditioner`).
    """
    diag = params.get("diag")
    out_scale = params.get("out_scale", 1.0)
    # P Wq as the output projection [H·K, D]: scaled in Wq's own layout, so that the transpose
    # folds into the matmul instead of being materialised (and its gradient transposed back)
    out = (params["query"] * jnp.reshape(out_scale, (-1, 1, 1))).reshape(len(params["query"]),
                                                                            -1).T
    prepare = _attention_context(params, spec, positions, segment_ids, cache, values=False,
                                 context=diag is not None)

    def direction(y, ctx):
        B, T, _ = y.shape
        K = spec.head_dim
        q, k = _query_heads(y, params, spec, ctx), ctx.key
        if diag is not None:
            q, k = _with_diagonal_head(q, k, y, diag, ctx.context, spec)
        core = "xla" if cache is not None else attention_impl(impl, q.dtype, q.shape[-1],
                                                                   tied=True)
        if core == "pallas":
            o = pallas_attention(q.reshape(B, spec.num_heads, T, -1), k, segment_ids, spec)
        elif core == "cudnn":  # dpa(R q, R k, R k): the values are the rotated keys
            o = cudnn_attention(q.reshape(B, spec.num_heads, T, -1), k, k, segment_ids, spec)
        else:
            o = causal_attention(q, k, k, ctx.mask, spec, skip=cache is None)
            o = o.reshape(B, spec.num_heads, T, -1)
        u = merge_heads(_rotated(o[..., :K], ctx.rope, inverse=True), out)  # P Wq R_tᵀ o
        if diag is not None and diag.ndim == 2:  # Σ_h P d_h ⊙ (p_h @ c)
            u = u + jnp.einsum("bhtd,hd->btd", o[..., K:], diag * out_scale)
        elif diag is not None:
            u = u + diag * out_scale * o[..., K:].sum(axis=1)
        return u

    def energy(y, c):
        return attention_energy(params, y, c, spec=spec, positions=positions,
                                segment_ids=segment_ids)

    return Mixer(prepare, direction, energy if cache is None else None)


def llama_attention_mixer(params: dict, spec: AttentionSpec, positions: Array | None,
                          segment_ids: Array | None, *, impl: str = "xla",
                          cache: Cache | None = None) -> Mixer:
    """Untied Llama attention (the baseline): softmax(β q kᵀ) v Wo with free Wq [D,H,K],
    Wk [D,G,K], Wv [D,G,K], Wo [H,K,D]; queries from y, keys/values from c. No energy.
    params["out_scale"] ([] or [D], `fold_preconditioner`) scales Wo's output: P·u. The core
    is cuDNN's flash attention with impl "cudnn" (or "auto" on a GPU), JAX's splash attention
    with "pallas" or "auto" on a TPU (`splash_attention`), else the blocked XLA core (the tied
    kernel's values are its keys). A decode `cache` works as in `tied_attention_mixer`."""
    out = (params["out"] * params.get("out_scale", 1.0)).reshape(-1, params["out"].shape[-1])
    prepare = _attention_context(params, spec, positions, segment_ids, cache, values=True,
                                 context=False)

    def direction(y, ctx):
        B, T, _ = y.shape
        q = _query_heads(y, params, spec, ctx)
        core = "xla" if cache is not None else attention_impl(impl, q.dtype, q.shape[-1],
                                                                   tied=False)
        if core == "cudnn":
            o = cudnn_attention(q.reshape(B, spec.num_heads, T, -1), ctx.key, ctx.value,
                                 segment_ids, spec)
        elif core == "splash":
            o = splash_attention(q.reshape(B, spec.num_heads, T, -1), ctx.key, ctx.value,
                                 segment_ids, spec)
        else:
            o = causal_attention(q, ctx.key, ctx.value, ctx.mask, spec, skip=cache is None)
        return merge_heads(o.reshape(B, spec.num_heads, T, -1), out)

    return Mixer(prepare, direction, None)


# ----------------------------------------------------------------------------------------------
# Gated MLP: the closed-form update of the element-wise energy, and SwiGLU.
# ----------------------------------------------------------------------------------------------


def _gated_mixer(params: dict, activation: Activation, down: Array, energy) -> Mixer:
    """u = Wdown(σ(Wg y) ⊙ Wu c) with `down` [F,D]; Wu c is computed once per sub-layer.
    `down` already includes params["out_scale"] ([] or [D], `fold_preconditioner`) when there is
    one: the direction is then P·u."""

    def prepare(c, index):
        del index  # token-wise: nothing to cache
        return dense(c, params["up"])

    def direction(y, up):
        return dense(activation.fn(dense(y, params["gate"])) * up, down)

    return Mixer(prepare, direction, energy)


def tied_mlp_mixer(params: dict, activation: Activation) -> Mixer:
    """CEM MLP: u = -∇_y E_mlp(y | c) = Wgᵀ(σ(Wg y) ⊙ Wu c), gate tied to down by transpose."""

    def energy(y, c):
        return mlp_energy(params, y, c, activation=activation)

    # P Wg scaled in Wg's own layout [D,F]: the transpose then folds into the matmul
    down = (params["gate"] * jnp.reshape(params.get("out_scale", 1.0), (-1, 1))).T
    return _gated_mixer(params, activation, down, energy)


def swiglu_mixer(params: dict, activation: Activation) -> Mixer:
    """Untied gated MLP (SwiGLU for SiLU): Wdown(σ(Wg y) ⊙ Wu c), Wdown [F,D]. No energy."""
    return _gated_mixer(params, activation, params["down"] * params.get("out_scale", 1.0), None)
