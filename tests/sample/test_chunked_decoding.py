"""A decode in chunks (`generate(..., chunks=...)`, what cem-sample runs) gives the tokens and
logits of one unchunked decode, for any chunk lengths, and stops where `chunks` says."""

from __future__ import annotations

import numpy as np
import pytest
from decode_helpers import tiny_config
from helpers import random_params

from cem_jax.sample import SamplingConfig, generate

PROMPTS = [[3, 5, 7], [3, 9, 1, 2, 4, 6, 8, 10], [3, 11]]  # different lengths


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(num_heads=4, num_kv_heads=2)
    return cfg, random_params(cfg)


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=23, temperature=0.0, eos_id=None),
    SamplingConfig(max_new_tokens=23, temperature=0.9, top_p=0.9, top_k=40, seed=3, eos_id=2),
], ids=["greedy", "sampled-with-eos"])
@pytest.mark.parametrize("lengths", [[1], [3, 7], [5, 1, 64]])
def test_chunks_of_any_length_give_the_unchunked_tokens(model, sampling, lengths):
    cfg, params = model
    whole = generate(params, cfg, PROMPTS, sampling, keep_logits=True)
    asked = []

    def chunks(done: int, total: int) -> int:
        asked.append(done)
        return lengths[min(len(asked) - 1, len(lengths) - 1)]

    chunked = generate(params, cfg, PROMPTS, sampling, keep_logits=True, chunks=chunks)
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    np.testing.assert_array_equal(chunked.lengths, whole.lengths)
    np.testing.assert_array_equal(chunked.logits, whole.logits)
    assert not chunked.stopped and asked[0] == 0 and asked == sorted(asked)


def test_a_chunk_that_says_stop_returns_what_was_decoded(model):
    cfg, params = model
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.7, seed=1, eos_id=None)
    whole = generate(params, cfg, PROMPTS, sampling)
    stopped = generate(params, cfg, PROMPTS, sampling,
                       chunks=lambda done, total: 6 if done < 12 else None)
    assert stopped.stopped and stopped.tokens.shape == (3, 12)
    np.testing.assert_array_equal(stopped.tokens, whole.tokens[:, :12])
    np.testing.assert_array_equal(stopped.lengths, [12, 12, 12])
