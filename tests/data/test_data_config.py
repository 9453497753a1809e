"""DataConfig: defaults are valid, every bad field is named in the error."""

import dataclasses
import re

import pytest

from cem_jax.data import DataConfig


def test_defaults_describe_the_tiny_run():
    cfg = DataConfig()
    assert (cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.batch_size) == ("shakespeare", None,
                                                                          128, 32)
    assert all(isinstance(getattr(cfg, f.name), (str, int, float, bool, type(None)))
               for f in dataclasses.fields(cfg))


@pytest.mark.parametrize("field, value, allowed", [
    ("corpus", "", "non-empty string"),
    ("val_corpus", "  ", "null or a non-empty string"),
    ("tokenizer", 3, "null or a non-empty string"),
    ("vocab_size", 100, "null or an integer >= 261"),
    ("vocab_size", 2048.0, "null or an integer >= 261"),
    ("seq_len", 1, "an integer >= 2"),
    ("batch_size", -4, "positive integer"),
    ("batch_size", True, "positive integer"),
    ("num_threads", -1, "non-negative integer"),
    ("prefetch", -1, "non-negative integer"),
    ("seed", 2**32, "[0, 2**32)"),
    ("seed", -1, "[0, 2**32)"),
    ("allow_invalid_utf8", "yes", "true or false"),
])
def test_bad_field_is_named(field, value, allowed):
    with pytest.raises(ValueError, match=rf"'{field}' = .* it must be .*{re.escape(allowed)}"):
        DataConfig(**{field: value})

