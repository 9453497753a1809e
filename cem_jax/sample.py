"""Sampling: `generate`, for the library, the end-of-training sample and `cem-sample`
(`cem_jax.cli.sample`).

`generate` is a compiled decode loop around the model's own forward pass with a decode cache
(`CEMTransformer.__call__(..., cache=...)`, `cem_jax.kvcache`): the prompts are evaluated at
once, then one token per row per step, in one call or in chunks (a long decode shows its
progress and stops between chunks). Decoding treats documents as training does: an EOS
token starts a new document, so the token after `… [EOS]` is predicted from that EOS alone,
exactly as after a fresh `[EOS]` (positions restart at 0 there; the cache keeps its slots).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cem_jax.config import ModelConfig
from cem_jax.data.batches import document_positions
from cem_jax.kvcache import cache_bytes
from cem_jax.memory import check_fits
from cem_jax.model import init_cache, model_from_params

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen: temperature 0 is greedy (argmax); otherwise a sample of
    softmax(logits / temperature) restricted to the `top_k` most likely tokens (0: all) and to
    the smallest set whose probability reaches `top_p` (1.0: all).

    `eos_id` is the end-of-document token (None: the text has no documents): an EOS starts a
    new document, in the prompts and in what is generated. Generation stops at
    `max_new_tokens`, or, with `stop_at_eos`, once every row has produced an EOS.
    `vocab_size`: the tokenizer's; ids at or above it (a model's vocabulary padded past its
    tokenizer's) are never chosen (None: every id of the model)."""

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = None
    stop_at_eos: bool = True
    pad_id: int = 0
    seed: int = 0
    vocab_size: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens} must be at least 1")
        if not 0 <= self.temperature < math.inf:  # nan fails too
            raise ValueError(f"temperature = {self.temperature} must be a finite number >= 0 "
                             f"(0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size = {self.vocab_size} must be at least 1 (or None)")


def choose(logits: Array, key: Array, temperature: Array, top_k: Array, top_p: Array
           ) -> Array:
    """Next tokens int32 [B] from fp32 logits [B,V] (traced scalars, see SamplingConfig:
    temperature 0 = argmax, top_k 0 = all, top_p 1 = all)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / jnp.where(temperature > 0, temperature, 1.0)
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    V = logits.shape[-1]
    kth = jnp.take(ordered, jnp.clip(jnp.where(top_k > 0, top_k, V) - 1, 0, V - 1), axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    nucleus = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1)
    cutoff = jnp.maximum(kth, nucleus)[:, None]
    sampled = jax.random.categorical(key, jnp.where(logits < cutoff, -jnp.inf, logits))
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)


@dataclasses.dataclass
class Generation:
    """Output of `generate`: `tokens` int32 [B,N] (pad after a row's EOS or its end),
    `lengths` int [B] (new tokens per row, EOS included), `logits` fp32 [B,N,V] (the
    distribution each new token was drawn from, when asked for: -inf at ids masked by
    `SamplingConfig.vocab_size`), the `cache` bytes, and whether `generate`'s `chunks` stopped
    it before its end (`stopped`)."""

    tokens: np.ndarray
    lengths: np.ndarray
    logits: np.ndarray | None
    cache_bytes: int
    stopped: bool = False


def _model(cfg: ModelConfig, params, vocab_size):
    """The model's forward pass with a decode cache, logits at ids past `vocab_size` (ids the
    tokenizer lacks) -inf; built where it runs (NNX modules hold no outer tracer)."""
    def run(tokens, positions, cache):
        out = model_from_params(cfg, params)(tokens, positions, cache=cache)
        valid = jnp.arange(out.logits.shape[-1]) < vocab_size
        return jnp.where(valid, out.logits, -jnp.inf), out.cache

    return run


def _prefill(params, prompts, positions, lengths, options, cfg: ModelConfig,
             max_new_tokens: int, keep_logits: bool) -> dict:
    """The decode state after the prompts int32 [B,P] at `positions` [B,P] with real `lengths`
    [B] (compiled by `_compiled`); options = (temperature, top_k, top_p, eos_id or -1,
    stop_at_eos, pad_id, seed, vocab_size) as traced scalars, so that changing them does not
    recompile."""
    *_, pad_id, seed, vocab_size = options
    B, P = prompts.shape
    N = max_new_tokens
    logits, cache = _model(cfg, params, vocab_size)(prompts, positions, init_cache(cfg, B, P + N))
    cache = cache._replace(length=lengths)  # a shorter row's padding slots get overwritten
    last = (lengths - 1)[:, None]
    return {"i": jnp.int32(0), "cache": cache, "done": jnp.zeros((B,), bool),
            "last": jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0],
            "position": jnp.take_along_axis(positions, last, axis=1)[:, 0],
            "key": jax.random.PRNGKey(seed), "tokens": jnp.full((B, N), pad_id, jnp.int32),
            "logits": jnp.zeros((B, N, logits.shape[-1]) if keep_logits else (0,),
                                jnp.float32)}


def _advance(params, state: dict, limit, options, cfg: ModelConfig, keep_logits: bool) -> dict:
    """The decode state after new tokens up to number `limit` (a traced scalar ≤ N: one
    compiled loop for every chunk length), or once every row is done."""
    temperature, top_k, top_p, eos_id, stop_at_eos, pad_id, _, vocab_size = options
    model = _model(cfg, params, vocab_size)

    def cond(st):
        return (st["i"] < limit) & ~jnp.all(st["done"])

    def body(st):
        key, sub = jax.random.split(st["key"])
        token = jnp.where(st["done"], pad_id,
                          choose(st["last"], sub, temperature, top_k, top_p))
        position = jnp.where(token == eos_id, 0, st["position"] + 1)  # EOS: a new document
        new_logits, cache = model(token[:, None], position[:, None], st["cache"])
        return {"i": st["i"] + 1, "key": key, "cache": cache, "position": position,
                "tokens": st["tokens"].at[:, st["i"]].set(token),
                "done": st["done"] | (stop_at_eos & (token == eos_id)),
                "last": new_logits[:, 0],
                "logits": (st["logits"].at[:, st["i"]].set(st["last"]) if keep_logits
                           else st["logits"])}

    return jax.lax.while_loop(cond, body, state)


@functools.cache
def _compiled(out_sharding: jax.sharding.Sharding | None):
    """The jitted prefill and advance (their outputs on `out_sharding`, when given)."""
    return (jax.jit(_prefill, static_argnames=("cfg", "max_new_tokens", "keep_logits"),
                    out_shardings=out_sharding),
            jax.jit(_advance, static_argnames=("cfg", "keep_logits"),
                    out_shardings=out_sharding))


def generate(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling: SamplingConfig, keep_logits: bool = False,
             out_sharding: jax.sharding.Sharding | None = None,
             chunks: Callable[[int, int], int | None] | None = None) -> Generation:
    """Continue each prompt (token ids, lengths may differ, each ≥ 1) with a compiled decode
    loop through the model and its decode cache.

    chunks: None decodes in one call of the loop; else the loop runs in chunks, and
    `chunks(done, total)` is called before each (tokens decoded so far per row, of
    `sampling.max_new_tokens`) and returns the next chunk's length, or None to stop there
    (`Generation.stopped`: what was decoded is returned). The tokens are those of one call
    (one compiled loop runs every chunk: a chunk's length recompiles nothing).

    params: the model's pure parameter dict (numpy, or jax Arrays sharded anyhow, e.g. a
    train state's across processes: then give `out_sharding`, such as the mesh's replicated
    sharding, so that every process can read the tokens). Positions are those of training
    (restarting at 0 at each EOS of `sampling.eos_id`) and may run past the training
    sequence length: RoPE has no table limit, but the model never saw such positions.
    Raises ValueError for an empty prompt, a token outside the vocabulary or a
    `sampling.vocab_size` larger than the model's, and
    `cem_jax.memory.DoesNotFit` (a ValueError) before compiling when the decode cache alone
    would exceed the device's memory.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. EOS, a document start)")
    lengths = np.array([len(p) for p in prompts], np.int32)
    ids = np.full((len(prompts), int(lengths.max())), sampling.pad_id, np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    s = sampling
    if s.vocab_size is not None and s.vocab_size > cfg.vocab_size:
        raise ValueError(f"sampling vocab_size = {s.vocab_size} is more than the model's "
                         f"vocab_size = {cfg.vocab_size}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
    bytes_ = cache_bytes(jax.eval_shape(lambda: init_cache(cfg, len(prompts),
                                                           ids.shape[1] + s.max_new_tokens)))
    check_fits(bytes_ + (len(prompts) * s.max_new_tokens * cfg.vocab_size * 4 if keep_logits
                         else 0), f"decoding {len(prompts)} prompt(s) of up to {ids.shape[1]} "
               f"tokens and {s.max_new_tokens:,} new ones (its cache)", "lower the number of "
               "new tokens (cem-sample --max-new-tokens) or of prompts")
    options = (np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p),
               np.int32(-1 if s.eos_id is None else s.eos_id), np.bool_(s.stop_at_eos),
               np.int32(s.pad_id), np.uint32(s.seed),
               np.int32(cfg.vocab_size if s.vocab_size is None else s.vocab_size))
    prefill, advance = _compiled(out_sharding)
    state = prefill(params, ids, document_positions(ids, s.eos_id), lengths, options, cfg,
                    s.max_new_tokens, keep_logits)
    done, stopped = 0, False
    while done < s.max_new_tokens:
        step = s.max_new_tokens if chunks is None else chunks(done, s.max_new_tokens)
        if step is None:
            stopped = True
            break
        if step < 1:
            raise ValueError(f"a decode chunk of {step} tokens: give at least 1 (or None)")
        state = advance(params, state, np.int32(min(done + step, s.max_new_tokens)), options,
                        cfg, keep_logits)
        done, finished = (int(x) for x in jax.device_get((state["i"], jnp.all(state["done"]))))
        if finished:
            break
    tokens, logits = jax.device_get((state["tokens"], state["logits"]))
    tokens = tokens[:, :done]
    new = np.full(len(prompts), tokens.shape[1])
    if s.eos_id is not None and s.stop_at_eos:
        for b, row in enumerate(tokens):
            hit = np.flatnonzero(row == s.eos_id)
            new[b] = hit[0] + 1 if hit.size else tokens.shape[1]
    return Generation(tokens, new, logits[:, :done] if keep_logits else None, bytes_, stopped)
