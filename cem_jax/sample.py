"""Cached decoding: `cem-sample --run DIR [--step N] --prompt "..."`.

The decode path is a second implementation of the model's forward pass, `forward_cached`, that
evaluates M new positions of every row against a cache of the earlier ones; tests hold it to the
full recomputation of `CEMTransformer`. It reuses the pure pieces of `cem_jax.updates`: the step
loop `run_steps` (so preconditioners, recursive steps and `gradient_wrt` are the model's own), the
MLP mixers, `attend`, RMSNorm and RoPE; only the attention mixer is rebuilt to read the cache.

The cache, per attention sub-layer (stacked: leading axes L, then C = the contexts a sub-layer
holds: `steps` with `recompute_context`, else 1), slot s = position s:

    tied CEM:        "key"     [L,C,B,G,S,K]   R_s Wk c_s (rotated when written; values = keys)
      + DPLR:        "context" [L,C,B,S,D]     c_s itself, the diagonal head's key and value
    baseline:        "key", "value" [L,C,B,G,S,K]

so a tied low-rank model holds half the bytes of its baseline twin's key/value cache (DPLR adds
D per position and layer). The MLP is token-wise: it has no cache. With `recompute_context` the
context of step k ≥ 1 is RMSNorm(xᵏ) of every earlier token, hence one cache per step (C =
steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cem_jax.config import ModelConfig
from cem_jax.energies import AttentionSpec, get_activation, rope
from cem_jax.updates import (
    Mixer,
    attend,
    precondition,
    rms_norm,
    run_steps,
    swiglu_mixer,
    tied_mlp_mixer,
)

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Parameters and cache
# ----------------------------------------------------------------------------------------------


def stacked_blocks(params: dict, cfg: ModelConfig) -> dict:
    """The per-layer parameters of `params` (a model's pure dict) stacked on a leading L axis,
    whether the model scans its layers (already stacked) or lists them ({0: ..., 1: ...})."""
    blocks = params["blocks"]
    if cfg.scan_layers:
        return blocks
    return jax.tree.map(lambda *a: jnp.stack(a), *(blocks[i] for i in range(cfg.num_layers)))


def cache_contexts(cfg: ModelConfig) -> int:
    """C, the contexts an attention sub-layer caches: `steps` with recompute_context, else 1."""
    return cfg.steps if cfg.recompute_context and cfg.steps > 1 else 1


def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict[str, Array]:
    """An empty cache of `length` slots for `batch` rows, in `cfg.dtype` (layout in the module
    docstring)."""
    L, C, G, K = cfg.num_layers, cache_contexts(cfg), cfg.kv_heads, cfg.head_width
    dt = jnp.dtype(cfg.dtype)
    cache = {"key": jnp.zeros((L, C, batch, G, length, K), dt)}
    if not cfg.tie_attention:
        cache["value"] = jnp.zeros((L, C, batch, G, length, K), dt)
    elif cfg.interaction == "dplr":
        cache["context"] = jnp.zeros((L, C, batch, length, cfg.d_model), dt)
    return cache


def cache_bytes(cache: dict[str, Array]) -> int:
    """Bytes held by the arrays of a cache."""
    return sum(int(a.size) * a.dtype.itemsize for a in cache.values())


# ----------------------------------------------------------------------------------------------
# The cached forward pass
# ----------------------------------------------------------------------------------------------


def _write(cache: Array, new: Array, start: Array) -> Array:
    """Write new [B,...,M,X] into cache [B,...,S,X] at slots start[b] .. start[b]+M-1."""
    def one(c, n, s):
        return jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=c.ndim - 2)
    return jax.vmap(one)(cache, new, start)


def _cached_attention_mixer(p: dict, cfg: ModelConfig, positions: Array, mask: Array,
                            cache: dict[str, Array], written: list) -> Mixer:
    """The attention sub-layer's `Mixer` for M new positions [B,M] read against the cache.

    prepare(c) writes this context's keys (values, c) into the cache context it is the k-th
    call for and returns the whole updated cache context; direction(y, ctx) is the attention
    output for queries y [B,M,D] over slots mask [B,1,R·M,S]. Updated contexts go to `written`.
    Math: `updates.tied_attention_mixer` / `llama_attention_mixer` (DESIGN.md §1).
    """
    H, G, K = cfg.num_heads, cfg.kv_heads, cfg.head_width
    spec = AttentionSpec(H, G, K, cfg.position == "rope", cfg.rope_theta)
    start = positions[:, 0]

    def rotate(x, pos):
        return rope(x, pos, spec.rope_theta) if spec.use_rope else x

    def heads(x, w):  # [B,M,D] @ [D,N,K] -> [B,N,M,K]
        return jnp.einsum("bmd,dnk->bnmk", x, w)

    def prepare(c):
        k = len(written)
        new = {"key": rotate(heads(c, p["key"]), positions)}
        if "value" in cache:
            new["value"] = heads(c, p["value"])
        if "context" in cache:
            new["context"] = c
        ctx = {n: _write(cache[n][k], new[n], start) for n in cache}
        written.append(ctx)
        return ctx

    def direction(y, ctx):
        B, M, D = y.shape
        q = rotate(heads(y, p["query"]), positions)  # [B,H,M,K]
        key = ctx["key"]
        if "context" in ctx:  # the DPLR diagonal as a second head of width D
            d = p["diag"]
            yd = jnp.broadcast_to(y[:, None] * d.reshape(-1, 1, D), (B, H, M, D))
            q = jnp.concatenate([q, yd], axis=-1)
            S = key.shape[-2]
            key = jnp.concatenate([key, jnp.broadcast_to(ctx["context"][:, None],
                                                         (B, G, S, D))], axis=-1)
        value = ctx.get("value", key)
        o = attend(q.reshape(B, G, -1, q.shape[-1]), key, value, mask, spec.beta)
        o = o.reshape(B, H, M, -1)
        if "value" in ctx:
            return jnp.einsum("bhmk,hkd->bmd", o, p["out"])
        u = jnp.einsum("bhmk,dhk->bmd", rotate(o[..., :K], -positions), p["query"])
        if "context" in ctx and p["diag"].ndim == 2:
            u = u + jnp.einsum("bhmd,hd->bmd", o[..., K:], p["diag"])
        elif "context" in ctx:
            u = u + p["diag"] * o[..., K:].sum(axis=1)
        return u

    return Mixer(prepare, direction, None)


def _sublayer(x: Array, p: dict, mixer: Mixer, cfg: ModelConfig) -> Array:
    precond = functools.partial(precondition, cfg.preconditioner,
                                {n: v.astype(jnp.float32) for n, v in p.get("precond", {}).items()})
    x, _ = run_steps(x, mixer, norm_scale=p["norm"]["scale"].astype(x.dtype), eps=cfg.norm_eps,
                     precond=precond, steps=cfg.steps, impl="xla",
                     gradient_wrt=cfg.gradient_wrt, recompute_context=cfg.recompute_context)
    return x


def forward_cached(params: dict, cfg: ModelConfig, tokens: Array, positions: Array,
                   cache: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    """Logits of M new tokens per row and the updated cache.

    tokens, positions: int32 [B,M]; row b's positions must be start_b, start_b+1, … (its slots
    before start_b already written). Query (b,m) reads slots s ≤ positions[b,m]; slots are
    written at positions[b,:] (with M > 1, a padded row may write garbage beyond its real
    tokens: later writes at those slots overwrite it before any query reads it).
    Returns fp32 logits [B,M,V] (as `CEMTransformer.__call__`) and the cache.
    """
    dt = jnp.dtype(cfg.dtype)
    B, M = tokens.shape
    S = cache["key"].shape[-2]
    R = cfg.num_heads // cfg.kv_heads
    mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B,M,S]
    mask = jnp.broadcast_to(mask[:, None], (B, R, M, S)).reshape(B, 1, R * M, S)
    activation = get_activation(cfg.activation)
    x = params["embed"].astype(dt)[tokens]

    def layer(x, inputs):
        p, layer_cache = inputs
        p = jax.tree.map(lambda a: a.astype(dt) if a.dtype != dt else a, p)
        written: list = []
        attn = _cached_attention_mixer(p["attention"]["mixer"], cfg, positions, mask,
                                       layer_cache, written)
        x = _sublayer(x, p["attention"], attn, cfg)
        layer_cache = {n: jnp.stack([w[n] for w in written]) for n in layer_cache}
        mlp = (tied_mlp_mixer if cfg.tie_mlp else swiglu_mixer)(p["mlp"]["mixer"], activation)
        return _sublayer(x, p["mlp"], mlp, cfg), layer_cache

    x, cache = jax.lax.scan(layer, x, (stacked_blocks(params, cfg), cache))
    h = rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("bmd,dv->bmv", h, head.astype(h.dtype),
                        preferred_element_type=jnp.float32)
    return logits, cache


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen: temperature 0 is greedy (argmax); otherwise a sample of
    softmax(logits / temperature) restricted to the `top_k` most likely tokens (0: all) and to
    the smallest set whose probability reaches `top_p` (1.0: all). Generation stops at
    `max_new_tokens` or when every row has produced `eos_id` (None: never)."""

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = None
    pad_id: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")


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
    distribution each new token was drawn from, when asked for) and the `cache` bytes."""

    tokens: np.ndarray
    lengths: np.ndarray
    logits: np.ndarray | None
    cache_bytes: int


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "keep_logits"))
def _generate(params, prompts, lengths, options, cfg: ModelConfig, max_new_tokens: int,
              keep_logits: bool):
    """The compiled decode loop; options = (temperature, top_k, top_p, eos_id or -1, pad_id,
    seed) as traced scalars, so that changing them does not recompile."""
    temperature, top_k, top_p, eos_id, pad_id, seed = options
    B, P = prompts.shape
    N = max_new_tokens
    cache = init_cache(cfg, B, P + N)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = forward_cached(params, cfg, prompts, positions, cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    V = logits.shape[-1]
    state = {"i": jnp.int32(0), "last": last, "cache": cache,
             "done": jnp.zeros((B,), bool), "key": jax.random.PRNGKey(seed),
             "tokens": jnp.full((B, N), pad_id, jnp.int32),
             "logits": jnp.zeros((B, N, V) if keep_logits else (0,), jnp.float32)}

    def cond(st):
        return (st["i"] < N) & ~jnp.all(st["done"])

    def body(st):
        key, sub = jax.random.split(st["key"])
        token = jnp.where(st["done"], pad_id, choose(st["last"], sub, temperature, top_k, top_p))
        out = {"i": st["i"] + 1, "key": key,
               "tokens": st["tokens"].at[:, st["i"]].set(token),
               "done": st["done"] | (token == eos_id)}
        if keep_logits:
            out["logits"] = st["logits"].at[:, st["i"]].set(st["last"])
        else:
            out["logits"] = st["logits"]
        pos = (lengths + st["i"])[:, None]
        new_logits, out["cache"] = forward_cached(params, cfg, token[:, None], pos, st["cache"])
        out["last"] = new_logits[:, 0]
        return out

    final = jax.lax.while_loop(cond, body, state)
    return final["tokens"], final["logits"], final["i"]


def generate(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling: SamplingConfig, keep_logits: bool = False) -> Generation:
    """Continue each prompt (token ids, lengths may differ, each ≥ 1) with one compiled decode
    loop and a cache (`forward_cached`): the prompts are evaluated at once, then one token per
    row per step. Raises ValueError for an empty prompt or a token outside the vocabulary."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. EOS, a document start)")
    lengths = np.array([len(p) for p in prompts], np.int32)
    ids = np.full((len(prompts), int(lengths.max())), sampling.pad_id, np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
    s = sampling
    options = (jnp.float32(s.temperature), jnp.int32(s.top_k), jnp.float32(s.top_p),
               jnp.int32(-1 if s.eos_id is None else s.eos_id), jnp.int32(s.pad_id),
               jnp.uint32(s.seed))
    tokens, logits, steps = jax.device_get(_generate(params, jnp.asarray(ids),
                                                     jnp.asarray(lengths), options, cfg,
                                                     s.max_new_tokens, keep_logits))
    tokens = tokens[:, :int(steps)]
    new = np.full(len(prompts), tokens.shape[1])
    if sampling.eos_id is not None:
        for b, row in enumerate(tokens):
            hit = np.flatnonzero(row == sampling.eos_id)
            new[b] = hit[0] + 1 if hit.size else tokens.shape[1]
    bytes_ = cache_bytes(jax.eval_shape(lambda: init_cache(cfg, len(prompts),
                                                           ids.shape[1] + sampling.max_new_tokens)))
    return Generation(tokens, new, logits[:, :int(steps)] if keep_logits else None, bytes_)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """`cem-sample`: print continuations of the prompts; returns the exit status (0 ok,
    1 the run cannot be loaded, 2 bad arguments)."""
    parser = argparse.ArgumentParser(prog="cem-sample", description="Generate text from a "
                                     "trained run with a cached, compiled decode loop.")
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="prompt text; repeat for a batch (default: one empty prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-stop-at-eos", action="store_true",
                        help="keep generating after the end-of-document token")
    args = parser.parse_args(argv)
    # the training stack (checkpoint loading) is imported only by the command
    from cem_jax.rundir import load_run, quiet_checkpoint_logs
    from cem_jax.train.checkpoint import CheckpointError

    quiet_checkpoint_logs()
    try:
        run = load_run(args.run, args.step)
    except (FileNotFoundError, CheckpointError, ValueError) as err:
        print(f"cem-sample: error: {err}", file=sys.stderr)
        return 1
    tok = run.tokenizer
    try:
        sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                                  None if args.no_stop_at_eos else tok.eos_id, tok.pad_id,
                                  args.seed)
    except ValueError as err:
        print(f"cem-sample: {err}", file=sys.stderr)
        return 2
    texts = args.prompt or [""]
    prompts = [[tok.eos_id] + tok.encode(t) for t in texts]  # EOS starts a document
    out = generate(run.params, run.config.model, prompts, sampling)
    for text, row, n in zip(texts, out.tokens, out.lengths, strict=True):
        print(text + tok.decode(row[:n]))
        print("-" * 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
