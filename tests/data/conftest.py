"""Fixtures of the data tests: a small synthetic corpus with a tokenizer trained on it, and a
summary line with the real corpus' token counts (the real archive: `archive_cache`,
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import train_byte_level_bpe

from cem_jax.data import DataConfig, train_tokenizer

REPORT: dict[str, str] = {}  # lines the real-corpus test adds to the terminal summary
SMALL_VOCAB = 400
WORDS = ("the king queen lord lady sword crown night day love death honour fool wit grace "
         "speak hear come go thou thee thy art hath doth shall will not what why when where "
         "o alas sweet noble gentle brave false true heaven earth fire water").split()


def make_documents(count: int, seed: int) -> list[str]:
    """`count` documents of pseudo-English lines, 200 to 600 words each."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        words = rng.choice(WORDS, size=rng.integers(200, 600))
        lines = [" ".join(words[i:i + 9]).capitalize() + "." for i in range(0, len(words), 9)]
        docs.append("\n".join(lines) + "\n")
    return docs


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> dict[str, Path]:
    """Text files: `train/*.txt` (12 documents) and `val/*.txt` (2), as {"train", "val"} dirs."""
    root = tmp_path_factory.mktemp("small_corpus")
    for split, docs in (("train", make_documents(12, 0)), ("val", make_documents(2, 1))):
        (root / split).mkdir()
        for i, doc in enumerate(docs):
            (root / split / f"doc{i:02d}.txt").write_text(doc)
    return {"train": root / "train", "val": root / "val"}


@pytest.fixture(scope="session")
def small_tokenizer_path(small_corpus, tmp_path_factory) -> Path:
    """A SMALL_VOCAB BPE tokenizer trained on the small training documents."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    texts = [p.read_text() for p in sorted(small_corpus["train"].glob("*.txt"))]
    train_tokenizer(texts, SMALL_VOCAB, path)
    return path


@pytest.fixture(scope="session")
def small_hf_tokenizer_path(small_corpus, tmp_path_factory) -> Path:
    """A SMALL_VOCAB byte-level BPE tokenizer.json (GPT-2's kind: `<|endoftext|>` id 0,
    `<|pad|>` id 1) trained on the small training documents, without a tokenizer_config.json."""
    path = tmp_path_factory.mktemp("hf_tok") / "tokenizer.json"
    texts = [p.read_text() for p in sorted(small_corpus["train"].glob("*.txt"))]
    train_byte_level_bpe(texts, SMALL_VOCAB, path)
    return path


@pytest.fixture
def small_cfg(small_corpus, small_tokenizer_path, tmp_path):
    """DataConfig factory for the small corpus, with a fresh cache dir per test."""

    def make(**overrides) -> DataConfig:
        values = dict(corpus=str(small_corpus["train"] / "*.txt"),
                      val_corpus=str(small_corpus["val"] / "*.txt"),
                      tokenizer=str(small_tokenizer_path), vocab_size=SMALL_VOCAB, seq_len=32,
                      batch_size=4, seed=7, cache_dir=str(tmp_path / "cache"))
        return DataConfig(**{**values, **overrides})

    return make


@pytest.fixture(scope="session")
def report() -> dict[str, str]:
    """Lines a test adds here are printed in the terminal summary of the run."""
    return REPORT


def pytest_terminal_summary(terminalreporter):
    for line in REPORT.values():
        terminalreporter.write_line(line)
