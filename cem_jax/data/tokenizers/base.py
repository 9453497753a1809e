"""The `Tokenizer` API, which every kind of tokenizer of the table `cem_jax.data.tokenizers`
holds implements: encoding, decoding, its special ids and vocabulary size, its identity
(`sha256`), and the files it is saved as and read back from (`files`, `save`, `from_files`).
It is a module of its own, re-exported by the package, because the package names the kinds,
which subclass it, in its table.

Special tokens. The packed pipeline separates documents with EOS (and cem-sample starts a
prompt with it); BOS is reserved (unused by the pipeline); PAD fills evaluation rows (EOS when
the tokenizer has none). A sentencepiece model's are its own control pieces. A tokenizer.json's
are named by a `tokenizer_config.json` beside it when present (`eos_token`, `bos_token`,
`pad_token`: strings or {"content": ...} objects, as transformers writes them; a key given as
null means none), otherwise found among its special added tokens by the names models use
(`huggingface.EOS_TOKENS`, `BOS_TOKENS`, `PAD_TOKENS`); EOS is required. Text is never read as
a special token: a literal "</s>" or "<|endoftext|>" in a document or prompt is encoded as its
characters (sentencepiece never matches control pieces in text; for a tokenizer.json the
`tokenizers` library is told not to, `encode_special_tokens`), and special ids decode to
nothing.

Vocabulary sizes. `Tokenizer.vocab_size` is the tokenizer's own (its largest id + 1); a model's
vocabulary (`model.vocab_size`) may be larger (padded, e.g. to a multiple of 128) and must not
be smaller (`check_fits`).
"""

from __future__ import annotations

import abc
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cem_jax.data import files


class Tokenizer(abc.ABC):
    """A tokenizer as the pipeline, sampling and export use it. Ids are int; `encode` gives a
    list, `decode` takes any int sequence of ids in [0, vocab_size).

    Attributes (`kind` and `file_name` are the class's, which a row of the package's table names):
      kind: "sentencepiece" or "huggingface".
      file_name: its name in a run directory, "tokenizer.model" or "tokenizer.json".
      data: the bytes of that file (what `save` writes there, and checkpoints carry).
      vocab_size: the tokenizer's own vocabulary size V (ids 0..V-1).
      eos_id, pad_id (EOS when it has none): int; bos_id, unk_id: int, or None when it has none.
      sha256: hex digest of everything that decides its ids (the file, and for a
        tokenizer.json the chosen special tokens): its identity in cache keys and checkpoints.
    """

    kind: str
    file_name: str
    data: bytes
    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int
    unk_id: int | None
    sha256: str

    @classmethod
    @abc.abstractmethod
    def from_files(cls, contents: Mapping[str, bytes], source: str) -> Tokenizer:
        """The tokenizer whose `files()` are `contents` ({name: bytes}: its `file_name`, and the
        files saved beside it that exist); `source` names its file in errors. Raises ValueError
        when they are not a tokenizer of this kind (the message names `source`)."""

    def encode(self, text: str) -> list[int]:
        """Text → token ids (no BOS/EOS added)."""
        return self.encode_batch([text], num_threads=1)[0]

    @abc.abstractmethod
    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None
                     ) -> list[list[int]]:
        """Several texts → their ids (no BOS/EOS added), on `num_threads` threads (None: all
        CPU cores; 1: this thread alone, for callers that are workers themselves)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Token ids → text. Special ids (pad, bos, eos, unk and other control tokens) decode
        to nothing; byte pieces that are not valid UTF-8 decode to U+FFFD."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, e.g. "▁the", "<0x0A>" or "Ġthe"."""

    def files(self) -> dict[str, bytes]:
        """{name: content} of the files `save` writes: `file_name` (`data`), and beside a
        tokenizer.json the tokenizer_config.json of its special tokens."""
        return {self.file_name: self.data}

    def saved_paths(self, path: str | Path) -> list[str]:
        """Where `save(path)` writes `files()`, in their order: `path`, and the others beside
        it under their names."""
        path = files.local(str(path))
        beside = posixpath.dirname(path) if files.is_url(path) else str(Path(path).parent)
        return [path if name == self.file_name else files.join(beside, name)
                for name in self.files()]

    def save(self, path: str | Path) -> Path | str:
        """Write `data` to `path` (e.g. `files.join(run_dir, tokenizer.file_name)`, local or a
        URL) and the other `files()` beside it, each whole (`files.write_bytes`);
        `load_tokenizer(path)` gives back this tokenizer (same ids, same sha256). Returns
        `path`: a Path when local, the URL as given otherwise."""
        for target, content in zip(self.saved_paths(path), self.files().values(), strict=True):
            files.write_bytes(target, content)
        return str(path) if files.is_url(str(path)) else Path(files.local(str(path)))

