"""The Hugging Face kind of `cem_jax.data.tokenizers.Tokenizer`: a `tokenizer.json` through the
`tokenizers` library, its special tokens (EOS, BOS, PAD) named by the `SPECIAL_KEYS` of a
tokenizer_config.json beside it (`CONFIG_FILE`) or found among its special added tokens by the
names models use (`FALLBACK_NAMES`); special-token text in a document is read as text (see the
docstring of `cem_jax.data.tokenizers.base`).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence

import numpy as np
import tokenizers

from cem_jax.data.tokenizers.base import Tokenizer

CONFIG_FILE = "tokenizer_config.json"  # beside a tokenizer.json: its special tokens
SPECIAL_KEYS = ("eos_token", "bos_token", "pad_token")  # the ones read from CONFIG_FILE
# Special added tokens of a tokenizer.json taken as EOS / BOS / PAD when no CONFIG_FILE names
# them (the first one it has): GPT-2, GPT-NeoX, Qwen; Llama 3; Llama 2, Mistral, T5; Gemma.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
PAD_TOKENS = ("<pad>", "<|pad|>", "<|padding|>", "[PAD]")
FALLBACK_NAMES = dict(zip(SPECIAL_KEYS, (EOS_TOKENS, BOS_TOKENS, PAD_TOKENS), strict=True))


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (`data`: its bytes) through the `tokenizers` library.

    special_tokens: {"eos_token", "bos_token", "pad_token"} → token text or None (none), as a
      tokenizer_config.json gives them (a {"content": ...} object too); a key left out is
      looked up among the special added tokens by `FALLBACK_NAMES`. The choice is the
      attribute `special_tokens` (every key; what `files` saves beside the tokenizer.json).
      `source` names the file in errors. Raises ValueError when `data` is not a tokenizer.json
      the library reads, when a named token is not in it, or when it has no EOS.
    """

    kind = "huggingface"
    file_name = "tokenizer.json"

    def __init__(self, data: bytes, special_tokens: Mapping[str, object] | None = None,
                 source: str = "tokenizer.json"):
        self._tok = _backend(data, source)
        self.data = data
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()
                   if t.special}
        self.special_tokens = _special_tokens(special_tokens or {}, special, vocab, source)
        ids = {key: vocab.get(token) for key, token in self.special_tokens.items()}
        self.eos_id, self.bos_id = ids["eos_token"], ids["bos_token"]
        self.pad_id = self.eos_id if ids["pad_token"] is None else ids["pad_token"]
        self.unk_id = _unknown_id(json.loads(data).get("model") or {}, vocab)
        self.sha256 = hashlib.sha256(data + b"\n" + json.dumps(
            self.special_tokens, sort_keys=True).encode()).hexdigest()
        self._dropped = {i for i in (*ids.values(), self.unk_id) if i is not None} | set(
            special.values())

    @classmethod
    def from_files(cls, contents: Mapping[str, bytes], source: str) -> HuggingFaceTokenizer:
        """The tokenizer.json `contents[file_name]` with the special tokens that
        `contents[CONFIG_FILE]` names, when it is there (see `Tokenizer.from_files`). Raises
        ValueError as the class does, and when the tokenizer_config.json is not a JSON
        object (naming it as a file beside `source`)."""
        config = contents.get(CONFIG_FILE)
        where = posixpath.join(posixpath.dirname(source), CONFIG_FILE)
        return cls(contents[cls.file_name], {} if config is None else _config(config, where),
                   source)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None
                     ) -> list[list[int]]:
        """Several texts → their ids (see `Tokenizer.encode_batch`): with `num_threads` 1 one
        text after another in this thread, otherwise in the `tokenizers` library's thread pool
        (all cores, or `RAYON_NUM_THREADS`). The tokenizer.json's post-processor (a BOS it
        would add, say) is not applied."""
        if num_threads == 1:
            return [self._tok.encode(t, add_special_tokens=False).ids for t in texts]
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Token ids → text (see `Tokenizer.decode`)."""
        return self._tok.decode([int(i) for i in ids if int(i) not in self._dropped],
                                skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, e.g. "Ġthe" (byte-level BPE) or "<|endoftext|>".
        Raises IndexError for an id the tokenizer does not have."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise IndexError(f"id {token_id} is not in the tokenizer (vocab_size "
                             f"{self.vocab_size})")
        return piece

    def files(self) -> dict[str, bytes]:
        """tokenizer.json (`data`) and a tokenizer_config.json naming its special tokens."""
        return {self.file_name: self.data,
                CONFIG_FILE: (json.dumps(self.special_tokens, indent=2) + "\n").encode()}


def _config(data: bytes, where: str) -> dict:
    """The special tokens named by tokenizer_config.json `data` (of file `where`): {key: value}
    of those of SPECIAL_KEYS it has. Raises ValueError when it is not a JSON object."""
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where} is not valid JSON ({err}): fix it or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} holds a JSON {type(value).__name__}, not an object")
    return {key: value[key] for key in SPECIAL_KEYS if key in value}


def _backend(data: bytes, source: str) -> tokenizers.Tokenizer:
    """The `tokenizers` library's tokenizer of tokenizer.json `data`, set to read special-token
    text as text. Raises ValueError naming `source` when the library cannot read it."""
    try:
        backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # the library raises plain Exception
        raise ValueError(f"{source} is neither a Hugging Face tokenizer.json that the "
                         f"tokenizers library reads ({err}) nor a sentencepiece model") from None
    backend.encode_special_tokens = True
    return backend


def _special_tokens(given: Mapping[str, object], special: dict[str, int],
                    vocab: dict[str, int], source: str) -> dict[str, str | None]:
    """{key: text or None} for each of SPECIAL_KEYS: as `given` (a tokenizer_config.json's
    string, {"content": ...} or None), else the first of its `FALLBACK_NAMES` among the
    `special` added tokens, else None. Raises ValueError when a given token is not in `vocab`
    or there is no EOS (the message says how to name it)."""
    chosen = {}
    for key in SPECIAL_KEYS:
        value = given.get(key) if key in given else next(
            (name for name in FALLBACK_NAMES[key] if name in special), None)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{key} = {given[key]!r} in the {CONFIG_FILE} of {source} is not "
                             f"a token's text (a string or {{\"content\": ...}})")
        chosen[key] = value
    if missing := [f"{k} {t!r}" for k, t in chosen.items() if t is not None and t not in vocab]:
        raise ValueError(f"the {CONFIG_FILE} beside {source} names {', '.join(missing)}, which "
                         f"the tokenizer does not have: correct it in {CONFIG_FILE}")
    if chosen["eos_token"] is None:
        raise ValueError(
            f"{source} has no end-of-document token that cem_jax can find (none of its special "
            f"tokens is {', '.join(EOS_TOKENS)}, and no {CONFIG_FILE} beside it names an "
            f"eos_token): write {{\"eos_token\": \"<its EOS token>\"}} into a {CONFIG_FILE} "
            f"beside it")
    return chosen


def _unknown_id(model: dict, vocab: dict[str, int]) -> int | None:
    """The id a tokenizer.json's model gives text it cannot encode (BPE and WordPiece name an
    `unk_token`, Unigram an `unk_id`), or None (byte-level BPE encodes everything)."""
    if model.get("unk_token") is not None:
        return vocab.get(model["unk_token"])
    return model.get("unk_id")
