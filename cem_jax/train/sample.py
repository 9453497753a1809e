"""Text from a trained model without a cache: each new token re-runs the model on a fixed-size
window (one compiled shape), which is slow but simple (fine for a short sample)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cem_jax.data import Tokenizer


def generate(logits_fn: Callable, params, tokenizer: Tokenizer, prompt: str, num_tokens: int,
             window: int, temperature: float = 0.8, seed: int = 0,
             out_sharding: jax.sharding.Sharding | None = None) -> str:
    """Continue `prompt` (a document start: EOS then its tokens) by `num_tokens` tokens.

    `logits_fn(params, tokens int32 [1,W]) → fp32 [1,W,V]` is the model; `out_sharding` (e.g.
    replicated on the mesh) makes the chosen token readable on every process.
    The model sees the last `window` tokens (at most its training seq_len, positions from 0).
    temperature 0 decodes greedily; > 0 samples from softmax(logits / temperature).
    Returns the decoded continuation (prompt not included). Raises ValueError if `window` < 2.
    """
    if window < 2:
        raise ValueError(f"window = {window} must be at least 2 tokens")
    ids = [tokenizer.eos_id] + tokenizer.encode(prompt)
    start = len(ids)

    @functools.partial(jax.jit, out_shardings=out_sharding)
    def next_token(params, tokens, length, key):
        logits = logits_fn(params, tokens[None])[0, length - 1]
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    key = jax.random.PRNGKey(seed)
    for _ in range(num_tokens):
        context = ids[-window:]
        tokens = np.full((window,), tokenizer.pad_id, np.int32)
        tokens[:len(context)] = context
        key, sub = jax.random.split(key)
        ids.append(int(next_token(params, tokens, len(context), sub)))
    return tokenizer.decode(ids[start:])
