"""Loading a tokenizer (`cem_jax.data.tokenizers.Tokenizer`) of any kind of the table
(`cem_jax.data.tokenizers.BACKENDS`): from a file, local or a URL (`load_tokenizer`: the row that
recognises its content loads it, with the files saved beside it, such as the
tokenizer_config.json of a Hugging Face tokenizer.json), or from the contents of its files
(`tokenizer_from_files`, a tokenization worker's copy).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from pathlib import Path

from cem_jax.data import files
from cem_jax.data.tokenizers import BACKENDS, Tokenizer, check_fits


def load_tokenizer(path: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
    """Load a tokenizer file: a Hugging Face tokenizer.json (a JSON object; its special tokens
    from a tokenizer_config.json beside it, see `cem_jax.data.tokenizers`) or a sentencepiece
    model.

    model_vocab_size: the vocabulary of the model it is for (`model.vocab_size`), checked to
      hold every id (`check_fits`); None: no check.
    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is neither kind, a tokenizer.json without EOS (or with a
        tokenizer_config.json beside it that is not a JSON object), or a tokenizer with more
        ids than `model_vocab_size`.
    """
    if not files.is_file(str(path)):
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    data = files.read_bytes(str(path))
    backend = next(b for b in BACKENDS if b.recognises(data))  # every content is one kind's
    contents = {backend.file_name: data}
    for name in backend.beside:
        beside = posixpath.join(posixpath.dirname(str(path)), name)
        if files.is_file(beside):
            contents[name] = files.read_bytes(beside)
    tokenizer = backend.tokenizer.from_files(contents, str(path))
    if model_vocab_size is not None:
        check_fits(tokenizer, model_vocab_size, str(path))
    return tokenizer


def tokenizer_from_files(contents: Mapping[str, bytes]) -> Tokenizer:
    """The tokenizer whose `files()` are `contents` (a tokenization worker's copy)."""
    backend = next(b for b in BACKENDS if b.file_name in contents)
    return backend.tokenizer.from_files(contents, backend.file_name)

