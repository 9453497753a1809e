"""Loading a tokenizer (`cem_jax.data.tokenizer.Tokenizer`) of either kind: from a file, local
or a URL (`load_tokenizer`: a JSON object is a Hugging Face tokenizer.json, with the special
tokens of a tokenizer_config.json beside it; anything else a sentencepiece model), or from the
contents of its files (`tokenizer_from_files`, a tokenization worker's copy).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from pathlib import Path

from cem_jax.data import files
from cem_jax.data.tokenizer import CONFIG_FILE, FILE_NAMES, Tokenizer, check_fits
from cem_jax.data.tokenizer_hf import SPECIAL_KEYS, HuggingFaceTokenizer
from cem_jax.data.tokenizer_sentencepiece import SentencePieceTokenizer


def load_tokenizer(path: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
    """Load a tokenizer file: a Hugging Face tokenizer.json (a JSON object; its special tokens
    from a tokenizer_config.json beside it, see `cem_jax.data.tokenizer`) or a sentencepiece
    model.

    model_vocab_size: the vocabulary of the model it is for (`model.vocab_size`), checked to
      hold every id (`check_fits`); None: no check.
    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is neither kind, a tokenizer.json without EOS, or a tokenizer with
        more ids than `model_vocab_size`.
    """
    data = _read_bytes(path)
    if data.lstrip()[:1] == b"{":
        tokenizer = HuggingFaceTokenizer(data, _config_beside(path), str(path))
    else:
        try:
            tokenizer = SentencePieceTokenizer(data)
        except RuntimeError as err:
            raise ValueError(f"{path} is neither a sentencepiece model nor a Hugging Face "
                             f"tokenizer.json (sentencepiece: {err})") from None
    if model_vocab_size is not None:
        check_fits(tokenizer, model_vocab_size, str(path))
    return tokenizer


def tokenizer_from_files(contents: Mapping[str, bytes]) -> Tokenizer:
    """The tokenizer whose `files()` are `contents` (a tokenization worker's copy)."""
    if FILE_NAMES["huggingface"] in contents:
        return HuggingFaceTokenizer(contents[FILE_NAMES["huggingface"]],
                                    json.loads(contents.get(CONFIG_FILE, b"{}")))
    return SentencePieceTokenizer(contents[FILE_NAMES["sentencepiece"]])


def _read_bytes(path: str | Path) -> bytes:
    """The content of file `path` (local or a URL, `cem_jax.data.files`). Raises
    FileNotFoundError when there is no file there."""
    if not files.is_file(str(path)):
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    return files.read_bytes(str(path))


def _config_beside(path: str | Path) -> dict:
    """The special tokens named by the tokenizer_config.json beside `path`: {key: value} of
    those of SPECIAL_KEYS it has ({} without such a file). Raises ValueError when it is not a
    JSON object."""
    config = posixpath.join(posixpath.dirname(str(path)), CONFIG_FILE)
    try:
        value = json.loads(_read_bytes(config))
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config} is not valid JSON ({err}): fix it or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{config} holds a JSON {type(value).__name__}, not an object")
    return {key: value[key] for key in SPECIAL_KEYS if key in value}
