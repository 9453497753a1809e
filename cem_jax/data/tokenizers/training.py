"""Training a sentencepiece tokenizer here (`train_tokenizer`): a byte-fallback BPE model of
exactly the configured size, the same for the same text.

Ids of a model trained here:
  0 `<pad>` (PAD_ID), 1 `<unk>` (UNK_ID), 2 `<s>` (BOS_ID), 3 `</s>` (EOS_ID),
  4..259 the byte pieces `<0x00>`..`<0xFF>` (byte fallback: any text is encodable, never unk),
  260..V-1 BPE merges, learned from the training split only. V is exactly the configured size.
Text is kept verbatim (identity normalization, no dummy prefix, whitespace kept, newlines are
ordinary characters that merges may contain), so `decode(encode(text)) == text` for all text,
a literal "▁" included (see `SentencePieceTokenizer.encode_batch`).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from cem_jax.data.config import MIN_VOCAB_SIZE
from cem_jax.data.tokenizers.sentencepiece import SentencePieceTokenizer

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TRAINER_VERSION = 1  # bump when the training settings change: it invalidates cached tokenizers
CHARACTER_COVERAGE = 0.9995  # rarer characters get no piece of their own: bytes encode them
MAX_CHUNK_CHARS = 4096  # training text is fed to sentencepiece in paragraphs of at most this
MAX_TRAINING_CHUNKS = 2_000_000  # sentencepiece samples this many chunks from a larger corpus


def train_tokenizer(texts: Iterable[str], vocab_size: int,
                    out_path: str | Path | None = None) -> SentencePieceTokenizer:
    """Train a byte-fallback BPE model of exactly `vocab_size` pieces on `texts`.

    Deterministic: the same texts give the same model bytes. Texts are cut into paragraphs (at
    blank lines, at most MAX_CHUNK_CHARS characters); beyond MAX_TRAINING_CHUNKS paragraphs a
    random sample is used. Saves to `out_path` when given.
    Raises what reading `texts` raises, and ValueError when `vocab_size` pieces cannot be had
    from the text: fewer than 260 plus the number of distinct characters kept
    (CHARACTER_COVERAGE), or more than its merges allow; the message names the sizes that work.
    """
    model = io.BytesIO()
    spm.set_random_generator_seed(0)
    # the text's own error (or a stop, a KeyboardInterrupt), not sentencepiece's wrapping of it
    reading_error: list[BaseException] = []

    def sentences() -> Iterator[str]:
        try:
            yield from _paragraphs(texts)
        except BaseException as err:
            reading_error.append(err)
            raise

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=model, model_type="bpe",
            vocab_size=vocab_size, byte_fallback=True, character_coverage=CHARACTER_COVERAGE,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            normalization_rule_name="identity", add_dummy_prefix=False,
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            split_digits=True, max_sentence_length=4 * MAX_CHUNK_CHARS,
            input_sentence_size=MAX_TRAINING_CHUNKS, shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as err:
        if reading_error:
            raise reading_error[0] from None
        raise ValueError(_training_advice(str(err), vocab_size)) from None
    tokenizer = SentencePieceTokenizer(model.getvalue())
    if out_path is not None:
        tokenizer.save(out_path)
    return tokenizer


def _training_advice(error: str, vocab_size: int) -> str:
    """sentencepiece's training error as what to set: too few pieces in the text ("a value <=
    M") or more distinct characters than the vocabulary holds ("V vs N required_chars")."""
    what = f"sentencepiece cannot train a {vocab_size}-piece BPE model on this text"
    instead = "or give a trained tokenizer as data.tokenizer"
    if most := re.search(r"Please set it to a value <= (\d+)", error):  # >= MIN_VOCAB_SIZE
        return (f"{what}: it holds only enough distinct pieces for {most[1]}; set "
                f"data.vocab_size to at most {most[1]} (the least is {MIN_VOCAB_SIZE}; "
                f"model.vocab_size may stay larger), {instead}")
    if least := re.search(r"smaller than required_chars\. \d+ vs (\d+)", error):
        return (f"{what}: it has more distinct characters than that many pieces hold; raise "
                f"data.vocab_size to at least {least[1]} (and model.vocab_size, which must "
                f"hold it), {instead}")
    return f"{what}: {error}; {instead}"


def _paragraphs(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for paragraph in text.split("\n\n"):
            paragraph += "\n\n"
            for start in range(0, len(paragraph), MAX_CHUNK_CHARS):
                yield paragraph[start:start + MAX_CHUNK_CHARS]
