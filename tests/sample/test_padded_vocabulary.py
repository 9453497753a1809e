"""A model whose vocabulary is padded past its tokenizer's never emits a padded id: ids at or
above `SamplingConfig.vocab_size` are masked, greedy and sampled, even where their output
weights would win."""

from __future__ import annotations

import numpy as np
import pytest
from decode_helpers import tiny_config
from helpers import random_params

from cem_jax.sample import SamplingConfig, generate

TOKENIZER_VOCAB = 48  # the model's vocabulary is 96: ids 48..95 are padding
PROMPTS = [[3, 5, 7], [3, 9, 1, 2], [3, 11]]


@pytest.fixture(scope="module")
def padded():
    """(config, params) whose padded output columns are 5 × the real ones: a padded id's
    logit is 5 × the largest real one wherever that is positive."""
    cfg = tiny_config(vocab_size=96, tie_embeddings=False)
    params = random_params(cfg, seed=4)
    head = params["lm_head"]
    head[:, TOKENIZER_VOCAB:] = 5 * head[:, :TOKENIZER_VOCAB]
    return cfg, params


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_ids_are_never_chosen(padded, temperature):
    cfg, params = padded
    options = dict(max_new_tokens=12, temperature=temperature, seed=3)
    unmasked = generate(params, cfg, PROMPTS, SamplingConfig(**options))
    assert (unmasked.tokens >= TOKENIZER_VOCAB).mean() > 0.5  # the padded rows would win
    out = generate(params, cfg, PROMPTS, SamplingConfig(**options, vocab_size=TOKENIZER_VOCAB),
                   keep_logits=True)
    assert out.tokens.shape == (3, 12) and out.tokens.max() < TOKENIZER_VOCAB
    assert np.isneginf(out.logits[..., TOKENIZER_VOCAB:]).all()
    assert np.isfinite(out.logits[..., :TOKENIZER_VOCAB]).all()
    if temperature == 0:
        assert np.array_equal(out.tokens, out.logits.argmax(-1))


def test_a_tokenizer_larger_than_the_model_is_refused(padded):
    cfg, params = padded
    with pytest.raises(ValueError, match="sampling vocab_size = 97 is more than the model's "
                                         "vocab_size = 96"):
        generate(params, cfg, PROMPTS, SamplingConfig(vocab_size=97))
    with pytest.raises(ValueError, match="vocab_size = 0 must be at least 1"):
        SamplingConfig(vocab_size=0)
