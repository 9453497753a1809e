"""Fixtures of the export tests: a sentencepiece tokenizer of 400 pieces and a factory of tiny
run directories (config.yaml, tokenizer.model, one checkpoint of random parameters)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_params

from cem_jax.data import train_tokenizer
from cem_jax.rundir import write_run
from cem_jax.train.config import config_from_dict

VOCAB = 400
WORDS = ("the king queen lord lady sword crown night day love death honour fool wit grace "
         "speak hear come go thou thee thy art hath doth shall will not what why when").split()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A directory with train/ and val/ text files and the tokenizer trained on train/."""
    root = tmp_path_factory.mktemp("export_corpus")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 2)):
        (root / split).mkdir()
        for i in range(count):
            lines = (" ".join(rng.choice(WORDS, 9)).capitalize() + "." for _ in range(40))
            (root / split / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    train_tokenizer([p.read_text() for p in sorted((root / "train").glob("*.txt"))], VOCAB,
                    root / "tokenizer.model")
    return root


@pytest.fixture(scope="session")
def tokenizer(corpus):
    from cem_jax.data import load_tokenizer

    return load_tokenizer(corpus / "tokenizer.model")


@pytest.fixture
def make_run(tmp_path, corpus, tokenizer):
    """make_run(name, **model_fields) → (run directory, TrainConfig, params)."""
    def make(name="run", seed=0, **model):
        values = {"model": {"vocab_size": VOCAB, "d_model": 16, "num_layers": 2,
                            "num_heads": 2, "mlp_dim": 32, **model},
                  "data": {"corpus": str(corpus / "train" / "*.txt"),
                           "val_corpus": str(corpus / "val" / "*.txt"),
                           "tokenizer": str(corpus / "tokenizer.model"), "vocab_size": VOCAB,
                           "seq_len": 16, "batch_size": 4, "cache_dir": str(corpus / "cache")},
                  "run": {"dir": str(tmp_path / name), "steps": 2}}
        cfg = config_from_dict(values)
        params = random_params(cfg.model, seed)
        write_run(tmp_path / name, cfg, params, tokenizer, step=2)
        return tmp_path / name, cfg, params

    return make
