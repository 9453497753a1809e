"""Next-token cross entropy from the final hidden states, without the whole logits.

At a large vocabulary the fp32 logits [B,T,V] and their gradient are most of a train step's
activations (the 100M config on 16 chips: 8 GiB of its 8.7 GiB per device). `cross_entropy`
computes Σ_t w_t·CE_t = Σ_t w_t (logsumexp_v z_tv − z_t,y_t), z = h·head, over chunks of the
sequence (a loop over chunks of c positions): each chunk's logits [B,c,V] are made, reduced and
dropped. Under `jax.grad` the gradients are computed in that same pass (a custom VJP, as Liger
Kernel's fused linear cross entropy does; MaxText's vocabulary tiling and levanter's blockwise
loss recompute the logits in the backward instead): per chunk the logits' gradient
dz = w·(softmax(z) − onehot(y)) gives dh = dz·headᵀ and adds hᵀ·dz to d head, so the head costs
3 × 2·D·V FLOPs per token, as with whole logits, and nothing of size B·T·V outlives a chunk.
Sharded, d head is reduced over the batch devices once per chunk (whole logits: once), which is
why the chunks are few (`model.loss_chunks`, default 4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cem_jax.numerics import dense
from cem_jax.sharding import constrain

Array = jax.Array


def cross_entropy(h: Array, head: Array, targets: Array, weights: Array,
                  chunks: int) -> Array:
    """Σ weights · cross entropy (nats, fp32 scalar) of the logits h·head, never whole.

    h [B,T,D] (the final norm's output, model dtype), head [D,V] (same dtype), targets int
    [B,T] in [0, V), weights fp32 [B,T]; `chunks`: how many chunks the sequence is cut into,
    each of c = ⌈T / chunks⌉ positions (the logits held at once are [B,c,V] fp32; the last
    chunk is padded with weight 0; more chunks than positions: one position each). Logits are
    accumulated in fp32. Differentiable in h, head and weights (the gradient of a weight is its
    token's cross entropy); equals `optax.softmax_cross_entropy_with_integer_labels` on the
    whole logits (tests/test_loss.py). Raises ValueError for chunks < 1.
    """
    if chunks < 1:
        raise ValueError(f"the loss is cut into {chunks} chunks: give a positive number")
    return _cross_entropy(chunk_length(h.shape[1], chunks), h, head, targets, weights)


def chunk_length(seq_len: int, chunks: int) -> int:
    """c, the positions per chunk when a sequence of `seq_len` is cut into `chunks` chunks."""
    return -(-seq_len // min(chunks, seq_len))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cross_entropy(chunk, h, head, targets, weights):
    return _chunks(chunk, h, head, targets, weights, grads=False)[0]


def _forward(chunk, h, head, targets, weights):
    loss, dh, dhead, ce = _chunks(chunk, h, head, targets, weights, grads=True)
    return loss, (dh, dhead, ce, targets)


def _backward(chunk, residuals, g):
    dh, dhead, ce, targets = residuals
    return ((g * dh).astype(dh.dtype), (g * dhead).astype(dhead.dtype),
            jnp.zeros(targets.shape, jax.dtypes.float0), g * ce)


_cross_entropy.defvjp(_forward, _backward)


def _chunks(chunk: int, h: Array, head: Array, targets: Array, weights: Array, grads: bool):
    """The loop over chunks: (loss) or, with `grads`, (loss, dh [B,T,D] in h's dtype, d head
    [D,V] in head's dtype, cross entropy fp32 [B,T]) of the unit-cotangent loss."""
    B, T, D = h.shape
    V = head.shape[1]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        weights = jnp.pad(weights, ((0, 0), (0, pad)))
    weights = weights.astype(jnp.float32)

    def body(i, carry):
        start = i * chunk
        hc = jax.lax.dynamic_slice_in_dim(h, start, chunk, axis=1)  # [B,c,D]
        tc = jax.lax.dynamic_slice_in_dim(targets, start, chunk, axis=1)
        wc = jax.lax.dynamic_slice_in_dim(weights, start, chunk, axis=1)
        logits = constrain(dense(hc, head, preferred_element_type=jnp.float32),
                           "batch", "length", "vocab")
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        is_target = jnp.arange(V) == tc[..., None]  # [B,c,V]: a compare, not a gather
        label = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
        e = jnp.exp(logits - top)
        total = jnp.sum(e, axis=-1)
        ce = top[..., 0] + jnp.log(total) - label
        loss = carry[0] + jnp.sum(ce * wc)
        if not grads:
            return (loss,)
        _, dh, dhead, ces = carry
        dz = ((e / total[..., None] - is_target) * wc[..., None]).astype(h.dtype)
        dh_c = dense(dz, head.T, preferred_element_type=jnp.float32).astype(dh.dtype)
        dhead = dhead + jnp.matmul(hc.reshape(-1, D).T, dz.reshape(-1, V),
                                   preferred_element_type=jnp.float32)
        return (loss, jax.lax.dynamic_update_slice_in_dim(dh, dh_c, start, axis=1),
                constrain(dhead, "embed", "vocab"),
                jax.lax.dynamic_update_slice_in_dim(ces, ce, start, axis=1))

    carry = (jnp.zeros((), jnp.float32),)
    if grads:
        carry += (jnp.zeros_like(h), constrain(jnp.zeros((D, V), jnp.float32), "embed", "vocab"),
                  jnp.zeros((B, n * chunk), jnp.float32))
    out = jax.lax.fori_loop(0, n, body, carry)
    if not grads:
        return out
    loss, dh, dhead, ce = out
    return loss, dh[:, :T], dhead.astype(head.dtype), ce[:, :T]
