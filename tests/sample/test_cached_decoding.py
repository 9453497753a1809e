"""Cached decoding (`cem_jax.sample`, the model's forward with `cem_jax.kvcache`) against full
recomputation with `CEMTransformer`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from decode_helpers import BASELINE, tiny_config
from helpers import random_params

from cem_jax.kvcache import cache_bytes
from cem_jax.model import init_cache, model_from_params
from cem_jax.sample import SamplingConfig, generate

PROMPTS = [[3, 5, 7], [3, 9, 1, 2, 4, 6, 8, 10], [3, 11, 12, 13, 14]]  # different lengths

VARIANTS = {  # baseline, tied + DPLR + GQA, T = 2: the default run
    "baseline-gqa": dict(BASELINE, num_heads=4, num_kv_heads=2, tie_embeddings=False),
    "dplr-gqa": dict(interaction="dplr", preconditioner="dplr", num_heads=4, num_kv_heads=2),
    "steps2-shared-dplr": dict(steps=2, interaction="dplr", diagonal="shared",
                               preconditioner="diag", scan_layers=False),
}
SLOW_VARIANTS = {
    "tied": dict(),
    "steps2-recompute-residual-nope": dict(steps=2, recompute_context=True,
                                           gradient_wrt="residual", position="none"),
    "scalar-gelu-untied-head": dict(activation="gelu", tie_embeddings=False),
}


@pytest.mark.parametrize("name", list(VARIANTS) + [
    pytest.param(n, marks=pytest.mark.slow) for n in SLOW_VARIANTS])
def test_cached_logits_equal_full_recomputation(name):
    cfg = tiny_config(**{**VARIANTS, **SLOW_VARIANTS}[name])
    params = random_params(cfg)
    out = generate(params, cfg, PROMPTS, SamplingConfig(max_new_tokens=6, temperature=0.0),
                   keep_logits=True)
    assert out.tokens.shape == (3, 6) and out.logits.shape == (3, 6, cfg.vocab_size)
    sequences = np.zeros((3, 8 + 6), np.int32)  # right padding: causal, so harmless
    for b, prompt in enumerate(PROMPTS):
        sequences[b, :len(prompt) + 6] = prompt + list(out.tokens[b])
    full = np.asarray(model_from_params(cfg, params)(jnp.asarray(sequences)).logits)
    for b, prompt in enumerate(PROMPTS):
        want = full[b, len(prompt) - 1:len(prompt) - 1 + 6]  # the logits each token came from
        np.testing.assert_allclose(out.logits[b], want, atol=1e-5, rtol=0)
        assert np.array_equal(out.tokens[b], want.argmax(-1))
    assert np.abs(out.logits).max() > 1.0  # the check compares logits that are not all ~0


def test_key_only_cache_is_half_the_baseline_key_value_cache():
    tied = init_cache(tiny_config(num_heads=4, num_kv_heads=2), 3, 40)
    baseline = init_cache(tiny_config(**BASELINE, num_heads=4, num_kv_heads=2), 3, 40)
    assert tied.layers.value is None and tied.layers.context is None
    assert tied.layers.key.shape == baseline.layers.value.shape == (2, 1, 3, 2, 40, 4)
    assert cache_bytes(tied) * 2 == cache_bytes(baseline) == 2 * 2 * 3 * 2 * 40 * 4 * 4
    dplr = init_cache(tiny_config(interaction="dplr"), 3, 40)  # keys + the context c [B,S,D]
    assert cache_bytes(dplr) == cache_bytes(init_cache(tiny_config(), 3, 40)) + 2 * 3 * 40 * 16 * 4
    per_step = init_cache(tiny_config(steps=2, recompute_context=True), 3, 40)
    assert per_step.layers.key.shape[1] == 2  # one context per step


def test_sampling_options_and_eos():
    cfg = tiny_config()
    params = random_params(cfg, seed=1)
    greedy = generate(params, cfg, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=0.0),
                      keep_logits=True)
    for kwargs in (dict(top_k=1), dict(top_p=1e-6)):  # both leave only the argmax
        same = generate(params, cfg, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=1.5,
                                                             **kwargs), keep_logits=True)
        assert np.array_equal(same.tokens, greedy.tokens)
    sampled = generate(params, cfg, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=1.0,
                                                            top_k=3, seed=7), keep_logits=True)
    top3 = np.argsort(sampled.logits, axis=-1)[..., -3:]
    assert (sampled.tokens[..., None] == top3).any(-1).all()
    again = generate(params, cfg, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=1.0,
                                                          top_k=3, seed=7), keep_logits=True)
    assert np.array_equal(again.tokens, sampled.tokens)
    # an EOS the greedy text produces, after its first token and in no prompt
    eos = next(int(t) for t in greedy.tokens[:, 1:].ravel() if all(t not in p for p in PROMPTS))
    through = generate(params, cfg, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=0.0,
                                                            eos_id=eos, stop_at_eos=False))
    stopped = generate(params, cfg, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=0.0,
                                                            eos_id=eos, pad_id=0),
                       keep_logits=True)
    assert (through.tokens == eos).any() and (through.lengths == 5).all()
    first = (through.tokens == eos).argmax(-1)
    hit = (through.tokens == eos).any(-1)
    for b in range(3):
        n = first[b] + 1 if hit[b] else 5
        assert stopped.lengths[b] == n
        assert np.array_equal(stopped.tokens[b, :n], through.tokens[b, :n])
        assert (stopped.tokens[b, n:] == 0).all()


def test_bad_prompts_and_options_raise():
    cfg = tiny_config()
    params = random_params(cfg)
    with pytest.raises(ValueError, match="at least one token"):
        generate(params, cfg, [[3], []], SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        generate(params, cfg, [[3, 64]], SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


EOS_VARIANTS = {"tied": dict(), "dplr": dict(interaction="dplr"),
                "steps2": dict(steps=2, recompute_context=True), "baseline": BASELINE}


@pytest.mark.parametrize("name", [  # ~12 s each: two in the default run
    pytest.param(n, marks=pytest.mark.slow) if n in ("dplr", "steps2") else n
    for n in EOS_VARIANTS])
def test_an_eos_starts_a_new_document(name):
    """As in training (positions restart, attention stays in the document): the token after
    `… [EOS]` is predicted exactly as after a fresh `[EOS]`, whether the EOS is in the prompt
    or was generated."""
    cfg = tiny_config(**EOS_VARIANTS[name])
    params = random_params(cfg, seed=2)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    free = generate(params, cfg, [[3, 9, 1, 2]], greedy)
    eos = next(int(t) for t in free.tokens[0, 1:4] if t not in (3, 9, 1, 2))
    k = list(free.tokens[0]).index(eos)
    docs = dataclasses.replace(greedy, eos_id=eos, stop_at_eos=False)
    fresh = generate(params, cfg, [[eos]], docs, keep_logits=True).logits[0, 0]
    in_prompt = generate(params, cfg, [[eos, 3, 9, 1, 2, eos]], docs, keep_logits=True)
    np.testing.assert_allclose(in_prompt.logits[0, 0], fresh, atol=1e-5, rtol=0)
    generated = generate(params, cfg, [[3, 9, 1, 2]], docs, keep_logits=True)
    assert np.array_equal(generated.tokens[0, :k + 1], free.tokens[0, :k + 1])
    np.testing.assert_allclose(generated.logits[0, k + 1], fresh, atol=1e-5, rtol=0)
    without = generate(params, cfg, [[3, 9, 1, 2]], greedy, keep_logits=True)
    assert np.abs(without.logits[0, k + 1] - fresh).max() > 1e-2  # the old context mattered


def test_a_forward_past_the_cache_slots_is_a_clear_error():
    cfg = tiny_config()
    model = model_from_params(cfg, random_params(cfg))
    tokens = jnp.ones((1, 5), jnp.int32)
    with pytest.raises(ValueError, match="holds 4 slots per row and 0 are filled: 5 more"):
        model(tokens, cache=init_cache(cfg, 1, 4))
    cache = model(tokens[:, :3], cache=init_cache(cfg, 1, 4)).cache
    cache = model(tokens[:, :1], cache=cache).cache  # the fourth slot
    with pytest.raises(ValueError, match="4 are filled: 1 more tokens do not fit"):
        model(tokens[:, :1], cache=cache)
    with pytest.raises(ValueError, match="segment_ids must be None"):
        model(tokens[:, :1], segment_ids=tokens[:, :1], cache=init_cache(cfg, 1, 4))
