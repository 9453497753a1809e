"""sentencepiece BPE tokenizer: train, save, load, with fixed special ids.

Ids of a tokenizer trained here (`train_tokenizer`):
  0 `<pad>` (PAD_ID), 1 `<unk>` (UNK_ID), 2 `<s>` (BOS_ID), 3 `</s>` (EOS_ID),
  4..259 the byte pieces `<0x00>`..`<0xFF>` (byte fallback: any text is encodable, never unk),
  260..V-1 BPE merges, learned from the training split only. V is exactly the configured size.
Text is kept verbatim (identity normalization, no dummy prefix, whitespace kept, newlines are
ordinary characters that merges may contain), so `decode(encode(text)) == text` for all text,
a literal "▁" included (see `Tokenizer.encode_batch`).
The packed pipeline separates documents with EOS; BOS is reserved (unused by the pipeline).

A loaded model (`load_tokenizer`) may come from elsewhere; its own special ids are used, and it
must have an EOS id.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from cem_jax.data.config import MIN_VOCAB_SIZE
from cem_jax.fileio import atomic_file

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPACE_SYMBOL = "\u2581"  # "▁", sentencepiece's marker for a space
TRAINER_VERSION = 1  # bump when the training settings change: it invalidates cached tokenizers
CHARACTER_COVERAGE = 0.9995  # rarer characters get no piece of their own: bytes encode them
MAX_CHUNK_CHARS = 4096  # training text is fed to sentencepiece in paragraphs of at most this
MAX_TRAINING_CHUNKS = 2_000_000  # sentencepiece samples this many chunks from a larger corpus


class Tokenizer:
    """A sentencepiece model. Ids are int; `encode` gives a list, `decode` takes any int sequence.

    Attributes: vocab_size (V), pad_id, unk_id, bos_id, eos_id (int), sha256 (hex digest of the
    serialized model: the tokenizer's identity in cache keys), model_proto (bytes).
    """

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.vocab_size()
        self.unk_id, self.bos_id, self.eos_id = (self._sp.unk_id(), self._sp.bos_id(),
                                                 self._sp.eos_id())
        if self.eos_id < 0:
            raise ValueError("the sentencepiece model has no EOS id (</s>): the pipeline needs "
                             "one to separate documents")
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
        self.sha256 = hashlib.sha256(model_proto).hexdigest()
        byte_ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_SYMBOL.encode()]
        self._space_symbol_ids = [] if self.unk_id in byte_ids else byte_ids

    def encode(self, text: str) -> list[int]:
        """Text → token ids (no BOS/EOS added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Several texts → their ids, encoded in parallel on all CPU cores.

        sentencepiece writes spaces as U+2581 "▁" internally and would decode a literal "▁" as a
        space; with byte pieces, a literal "▁" is encoded as its three UTF-8 byte pieces instead,
        so that decoding restores it.
        """
        if not self._space_symbol_ids or not any(SPACE_SYMBOL in t for t in texts):
            return self._sp.encode(list(texts), num_threads=os.cpu_count() or 1)
        parts = [t.split(SPACE_SYMBOL) for t in texts]
        encoded = iter(self.encode_batch([p for ps in parts for p in ps]))
        out = []
        for ps in parts:
            ids = next(encoded)
            for _ in ps[1:]:
                ids += self._space_symbol_ids + next(encoded)
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Token ids → text. Special ids (pad, bos, eos, unk) decode to nothing (sentencepiece
        alone writes unk as " ⁇ "; a model may sample it, though encoding never gives it)."""
        return self._sp.decode([int(i) for i in ids if int(i) != self.unk_id])

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, e.g. "▁the" or "<0x0A>"."""
        return self._sp.id_to_piece(int(token_id))

    def save(self, path: str | Path) -> Path:
        """Write the model to `path` (e.g. `run_dir/tokenizer.model`) atomically."""
        with atomic_file(path) as f:
            f.write(self.model_proto)
        return Path(path)


def load_tokenizer(path: str | Path, expected_vocab_size: int | None = None) -> Tokenizer:
    """Load a sentencepiece model file.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is not a sentencepiece model, or its vocabulary size differs from
        `expected_vocab_size` (the model's/data config's `vocab_size`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    try:
        tokenizer = Tokenizer(path.read_bytes())
    except RuntimeError as err:
        raise ValueError(f"{path} is not a sentencepiece model: {err}") from None
    if expected_vocab_size is not None and tokenizer.vocab_size != expected_vocab_size:
        raise ValueError(f"tokenizer {path} has vocab_size {tokenizer.vocab_size}, but the "
                         f"config expects vocab_size {expected_vocab_size}: set vocab_size to "
                         f"{tokenizer.vocab_size} or use a tokenizer of {expected_vocab_size}")
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int,
                    out_path: str | Path | None = None) -> Tokenizer:
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
    tokenizer = Tokenizer(model.getvalue())
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
                f"data.vocab_size and model.vocab_size to at most {most[1]} (the least is "
                f"{MIN_VOCAB_SIZE}), {instead}")
    if least := re.search(r"smaller than required_chars\. \d+ vs (\d+)", error):
        return (f"{what}: it has more distinct characters than that many pieces hold; raise "
                f"data.vocab_size and model.vocab_size to at least {least[1]}, {instead}")
    return f"{what}: {error}; {instead}"


def _paragraphs(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for paragraph in text.split("\n\n"):
            paragraph += "\n\n"
            for start in range(0, len(paragraph), MAX_CHUNK_CHARS):
                yield paragraph[start:start + MAX_CHUNK_CHARS]
