"""The sentencepiece kind of `cem_jax.data.tokenizers.Tokenizer`: a `.model` file, given or
trained here (`cem_jax.data.tokenizers.training`), through the `sentencepiece` library, with its
own control pieces as special tokens. A literal "▁" (sentencepiece's marker for a space) in the
text survives a round trip (`SentencePieceTokenizer.encode_batch`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence

import numpy as np
import sentencepiece as spm

from cem_jax.data.tokenizers.base import Tokenizer

SPACE_SYMBOL = "\u2581"  # "▁", sentencepiece's marker for a space


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (`model_proto`: its serialized bytes); its own special ids, and it
    must have an EOS (ValueError otherwise)."""

    kind = "sentencepiece"
    file_name = "tokenizer.model"

    def __init__(self, model_proto: bytes):
        self.data = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.vocab_size()
        self.unk_id, self.eos_id = self._sp.unk_id(), self._sp.eos_id()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        if self.eos_id < 0:
            raise ValueError("the sentencepiece model has no EOS id (</s>): the pipeline needs "
                             "one to separate documents")
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
        self.sha256 = hashlib.sha256(model_proto).hexdigest()
        byte_ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_SYMBOL.encode()]
        self._space_symbol_ids = [] if self.unk_id in byte_ids else byte_ids

    @classmethod
    def from_files(cls, contents: Mapping[str, bytes], source: str) -> SentencePieceTokenizer:
        """The model `contents[file_name]` (see `Tokenizer.from_files`). Raises ValueError
        naming `source` when sentencepiece cannot read it, or it has no EOS."""
        try:
            return cls(contents[cls.file_name])
        except RuntimeError as err:
            raise ValueError(f"{source} is neither a sentencepiece model nor a Hugging Face "
                             f"tokenizer.json (sentencepiece: {err})") from None

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None
                     ) -> list[list[int]]:
        """Several texts → their ids (see `Tokenizer.encode_batch`).

        sentencepiece writes spaces as U+2581 "▁" internally and would decode a literal "▁" as a
        space; with byte pieces, a literal "▁" is encoded as its three UTF-8 byte pieces instead,
        so that decoding restores it.
        """
        if not self._space_symbol_ids or not any(SPACE_SYMBOL in t for t in texts):
            return self._sp.encode(list(texts), num_threads=num_threads or os.cpu_count() or 1)
        parts = [t.split(SPACE_SYMBOL) for t in texts]
        encoded = iter(self.encode_batch([p for ps in parts for p in ps], num_threads))
        out = []
        for ps in parts:
            ids = next(encoded)
            for _ in ps[1:]:
                ids += self._space_symbol_ids + next(encoded)
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Token ids → text (see `Tokenizer.decode`; sentencepiece alone writes unk as " ⁇ ";
        a model may sample it, though encoding never gives it)."""
        return self._sp.decode([int(i) for i in ids if int(i) != self.unk_id])

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, e.g. "▁the" or "<0x0A>"."""
        return self._sp.id_to_piece(int(token_id))
