"""Fixtures of the export tests: tokenizers of 400 ids of both kinds (sentencepiece, and a
byte-level BPE tokenizer.json) and a factory of tiny run directories (config.yaml, the
tokenizer, one checkpoint of random parameters)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_params, train_byte_level_bpe

from cem_jax.data import train_tokenizer
from cem_jax.rundir import write_run
from cem_jax.train_config import config_from_dict

VOCAB = 400
WORDS = ("the king queen lord lady sword crown night day love death honour fool wit grace "
         "speak hear come go thou thee thy art hath doth shall will not what why when").split()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A directory with train/ and val/ text files and the tokenizers trained on train/:
    tokenizer.model (sentencepiece) and hf/tokenizer.json (byte-level BPE)."""
    root = tmp_path_factory.mktemp("export_corpus")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 2)):
        (root / split).mkdir()
        for i in range(count):
            lines = (" ".join(rng.choice(WORDS, 9)).capitalize() + "." for _ in range(40))
            (root / split / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    texts = [p.read_text() for p in sorted((root / "train").glob("*.txt"))]
    train_tokenizer(texts, VOCAB, root / "tokenizer.model")
    (root / "hf").mkdir()
    train_byte_level_bpe(texts, VOCAB, root / "hf" / "tokenizer.json")
    return root


TOKENIZERS = {"sentencepiece": "tokenizer.model", "huggingface": "hf/tokenizer.json"}


@pytest.fixture(scope="session")
def tokenizer(corpus):
    from cem_jax.data import load_tokenizer

    return load_tokenizer(corpus / "tokenizer.model")


@pytest.fixture(scope="session")
def json_tokenizer(corpus):
    """The byte-level BPE tokenizer.json (<|endoftext|> = EOS = 0, <|pad|> = PAD = 1)."""
    from cem_jax.data import load_tokenizer

    return load_tokenizer(corpus / TOKENIZERS["huggingface"])


@pytest.fixture
def make_run(tmp_path, corpus):
    """make_run(name, seed, tokenizer="sentencepiece" | "huggingface", edit=None,
    **model_fields) → (run directory, TrainConfig, params); the model's vocabulary is the
    tokenizer's 400 ids unless model_fields say otherwise (a padded one); `edit(params)` may
    change the random parameters in place before they are written."""
    from cem_jax.data import load_tokenizer

    def make(name="run", seed=0, tokenizer="sentencepiece", edit=None, **model):
        values = {"model": {"vocab_size": VOCAB, "d_model": 16, "num_layers": 2,
                            "num_heads": 2, "mlp_dim": 32, **model},
                  "data": {"corpus": str(corpus / "train" / "*.txt"),
                           "val_corpus": str(corpus / "val" / "*.txt"),
                           "tokenizer": str(corpus / TOKENIZERS[tokenizer]), "seq_len": 16,
                           "batch_size": 4, "cache_dir": str(corpus / "cache")},
                  "run": {"dir": str(tmp_path / name), "steps": 2}}
        cfg = config_from_dict(values)
        params = random_params(cfg.model, seed)
        if edit is not None:
            edit(params)
        write_run(tmp_path / name, cfg, params, load_tokenizer(cfg.data.tokenizer), step=2)
        return tmp_path / name, cfg, params

    return make
