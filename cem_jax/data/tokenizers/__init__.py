"""Tokenizers of two kinds behind one API (`Tokenizer`): sentencepiece models (`.model`,
`sentencepiece`; trained here by `training.train_tokenizer` or given) and Hugging Face
`tokenizer.json` files (`huggingface`: the `tokenizers` library's byte-level BPE of the GPT-2 /
Llama 3 kind, converted sentencepiece models, ...). `loading.load_tokenizer` tells them apart by
content (a JSON object is a tokenizer.json).

This module holds `BACKENDS`, the table of the kinds: one `Backend` row each, naming its class
(whose `kind` and `file_name` are its name and its file's name in a run directory), how its file
is recognised by content, and the files saved beside it. The files a tokenizer is saved in
(`FILE_NAMES`, `CONFIG_FILE`, `saved_names`, `find_tokenizer`) and loading (`loading`) read the
table; a new kind is a module with its `Tokenizer` subclass and a row. The `Tokenizer` class
itself is defined in `base` (re-exported here), which the kinds' modules import: this module
imports them to name them in the table, so the class cannot be defined here without a circle.
Also here: the check of a tokenizer against a model's vocabulary (`check_fits`). What a
tokenizer's special tokens and vocabulary size are: see `base`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from cem_jax.data import files
from cem_jax.data.tokenizers.base import Tokenizer
from cem_jax.data.tokenizers.huggingface import CONFIG_FILE, HuggingFaceTokenizer
from cem_jax.data.tokenizers.sentencepiece import SentencePieceTokenizer

__all__ = ["BACKENDS", "CONFIG_FILE", "FILE_NAMES", "Backend", "Tokenizer", "check_fits",
           "find_tokenizer", "saved_names"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """A kind of tokenizer: its `Tokenizer` subclass (`tokenizer`: its `kind`, its `file_name`
    in a run directory, and `from_files`, which loads it), whether a file's content is one
    (`recognises`), and the names of the files saved `beside` it (`Tokenizer.files`)."""

    tokenizer: type[Tokenizer]
    recognises: Callable[[bytes], bool]
    beside: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return self.tokenizer.kind

    @property
    def file_name(self) -> str:
        return self.tokenizer.file_name


def _json_object(data: bytes) -> bool:
    """Whether file content `data` is a JSON object (a tokenizer.json)."""
    return data.lstrip()[:1] == b"{"


def _not_json_object(data: bytes) -> bool:
    """Whether file content `data` is not a JSON object (a sentencepiece model is a serialized
    protobuf, which has no fixed start)."""
    return not _json_object(data)


# In the order `find_tokenizer` looks for their files; each file is recognised by one row.
BACKENDS = (
    Backend(SentencePieceTokenizer, recognises=_not_json_object),
    Backend(HuggingFaceTokenizer, recognises=_json_object, beside=(CONFIG_FILE,)),
)
# The file a run directory (or a Hugging Face model directory) holds its tokenizer in, by kind.
FILE_NAMES = {b.kind: b.file_name for b in BACKENDS}


def check_fits(tokenizer: Tokenizer, model_vocab_size: int, source: str) -> None:
    """Raise ValueError unless a model of `model_vocab_size` ids holds every id of `tokenizer`
    (`source` names the tokenizer in the message, which names both sizes and the fix)."""
    if tokenizer.vocab_size > model_vocab_size:
        padded = math.ceil(tokenizer.vocab_size / 128) * 128
        raise ValueError(f"tokenizer {source} has {tokenizer.vocab_size} ids, more than the "
                         f"model's vocabulary (model.vocab_size = {model_vocab_size}): set "
                         f"model.vocab_size to at least {tokenizer.vocab_size} (e.g. {padded}, "
                         f"a multiple of 128), or use a tokenizer of at most {model_vocab_size} "
                         f"ids")


def find_tokenizer(directory: str | Path) -> str:
    """The path of the tokenizer file of `directory` (a run directory, or a Hugging Face model
    directory; local or a URL): its tokenizer.model, else its tokenizer.json. Raises
    FileNotFoundError when it has neither, or is no directory."""
    directory = files.local(str(directory))
    if not files.is_dir(directory):
        what = "is not a directory" if files.exists(directory) else "does not exist"
        raise FileNotFoundError(f"{directory} {what}")
    for name in FILE_NAMES.values():
        if files.is_file(files.join(directory, name)):
            return files.join(directory, name)
    raise FileNotFoundError(f"{directory} has no tokenizer file ({' or '.join(FILE_NAMES.values())}"
                            f"): it needs the tokenizer its model was trained with")


def saved_names(file_name: str) -> tuple[str, ...]:
    """The names of the files a tokenizer whose `file_name` is this writes (`Tokenizer.files`):
    a tokenizer.json's tokenizer_config.json too."""
    beside = next((b.beside for b in BACKENDS if b.file_name == file_name), ())
    return (file_name, *beside)
