"""The decode cache: what attention reads of earlier tokens, an argument of the model's forward.

`CEMTransformer.__call__(tokens, positions, cache=cache)` evaluates M new tokens per row against
the cache and returns the logits and the cache with those tokens written in. Per attention
sub-layer (stacked on leading axes L, then C = the contexts a sub-layer holds: `steps` with
`recompute_context`, else 1), slot s:

    "keys" (cem_attention):         key [L,C,B,G,S,K]  R_p Wk c_s, rotated at the token's
                                    position p (values = keys)
    "keys_context" (+ DPLR):        and context [L,C,B,S,D]  c_s, the diagonal head's key/value
    "keys_values" (llama_attention): key, value [L,C,B,G,S,K]
    "none": nothing (a kind whose energy at t reads c_t only)

as each sub-layer kind declares (`cem_jax.kinds.Kind.cache`; `cem_jax.model.init_cache` makes
one), so a tied low-rank model holds half the bytes of its baseline twin's key/value cache
(DPLR adds D per position and layer). The MLP is token-wise: it has no cache. With
`recompute_context` the context of step k ≥ 1 is RMSNorm(xᵏ) of every earlier token, hence one
cache per step.

Slots and positions are two things. Row b writes its M new tokens at slots `length[b]` …
`length[b] + M - 1`; RoPE uses the tokens' positions, which restart at 0 where a document starts
(as in training, where an EOS input starts a segment at position 0). A token at position p in
slot j reads slots j - p … j: its own document, whatever the cache holds before it. So a new
document costs no bytes: the positions say where it starts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from cem_jax.config import ModelConfig

Array = jax.Array


class KVCache(NamedTuple):
    """The cached context of attention sub-layers: `key` [...,B,G,S,K], `value` (untied only)
    [...,B,G,S,K] and `context` (tied DPLR only) [...,B,S,D]; absent parts are None. Leading
    axes: [L,C] in `Cache.layers`, [C] for one layer, none for one context."""

    key: Array
    value: Array | None = None
    context: Array | None = None


class Cache(NamedTuple):
    """A model's decode cache: `layers` (`KVCache` stacked [L,C,...]) and `length` int32 [B],
    the slots filled in each row (new tokens are written from there)."""

    layers: KVCache
    length: Array


def cache_contexts(cfg: ModelConfig) -> int:
    """C, the contexts an attention sub-layer caches: `steps` with recompute_context, else 1."""
    return cfg.steps if cfg.recompute_context and cfg.steps > 1 else 1


def cache_bytes(cache: Cache) -> int:
    """Bytes held by the key/value/context arrays of a cache."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(cache.layers))


def write(slots: Array, new: Array, start: Array) -> Array:
    """`new` [B,...,M,X] written into `slots` [B,...,S,X] at rows' slots start[b] … start[b]+M-1."""
    def one(s, n, b):
        return jax.lax.dynamic_update_slice_in_dim(s, n, b, axis=s.ndim - 2)
    return jax.vmap(one)(slots, new, start)


def slot_mask(positions: Array, start: Array, slots: int) -> Array:
    """bool [B,1,1,M,S]: the token in slot j = start[b] + m at position p = positions[b,m]
    reads slots j - p … j (its document up to itself)."""
    j = (start[:, None] + jnp.arange(positions.shape[1]))[:, :, None]
    s = jnp.arange(slots)[None, None, :]
    return ((s <= j) & (s >= j - positions[:, :, None]))[:, None, None]
