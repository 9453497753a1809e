"""Fixtures of the training tests: a small text corpus with its tokenizer, and the config of a
tiny model on it (run in-process with `train`, or as `cem-train` subprocesses)."""

from __future__ import annotations

import numpy as np
import pytest

from cem_jax.data import train_tokenizer

VOCAB = 400
WORDS = ("the king queen lord lady sword crown night day love death honour fool wit grace "
         "speak hear come go thou thee thy art hath doth shall will not what why when where "
         "o alas sweet noble gentle brave false true heaven earth fire water").split()


def _documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        words = rng.choice(WORDS, size=rng.integers(200, 600))
        docs.append("\n".join(" ".join(words[i:i + 9]).capitalize() + "."
                              for i in range(0, len(words), 9)) + "\n")
    return docs


@pytest.fixture(scope="session")
def tiny_overrides(tmp_path_factory) -> list[str]:
    """`key=value` overrides for a tiny CEM model (D=32, L=2) on a small synthetic corpus
    (seq_len 16, batch 8) with a trained tokenizer; add `run.dir=...`."""
    root = tmp_path_factory.mktemp("train_corpus")
    for split, docs in (("train", _documents(12, 0)), ("val", _documents(2, 1))):
        (root / split).mkdir()
        for i, doc in enumerate(docs):
            (root / split / f"doc{i:02d}.txt").write_text(doc)
    texts = [p.read_text() for p in sorted((root / "train").glob("*.txt"))]
    tokenizer = train_tokenizer(texts, VOCAB, root / "tokenizer.model")
    assert tokenizer.vocab_size == VOCAB
    return [f"data.corpus={root / 'train'}/*.txt", f"data.val_corpus={root / 'val'}/*.txt",
            f"data.tokenizer={root / 'tokenizer.model'}", f"data.vocab_size={VOCAB}",
            "data.seq_len=16", "data.batch_size=8", f"data.cache_dir={root / 'cache'}",
            f"model.vocab_size={VOCAB}", "model.d_model=32", "model.num_layers=2",
            "model.num_heads=2", "model.mlp_dim=64", "model.attention_block=16",
            "optimizer.lr=1e-2", "optimizer.warmup_steps=3", "run.log_every=1",
            "run.eval_batches=2", "run.sample_tokens=8", "run.progress=false"]

