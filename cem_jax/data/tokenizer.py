"""Tokenizers of two kinds behind one API (`Tokenizer`): sentencepiece models (`.model`, trained
here by `train_tokenizer` or given) and Hugging Face `tokenizer.json` files (the `tokenizers`
library: byte-level BPE of the GPT-2 / Llama 3 kind, converted sentencepiece models, ...).
`load_tokenizer` tells them apart by content (a JSON object is a tokenizer.json).

Ids of a sentencepiece model trained here (`train_tokenizer`):
  0 `<pad>` (PAD_ID), 1 `<unk>` (UNK_ID), 2 `<s>` (BOS_ID), 3 `</s>` (EOS_ID),
  4..259 the byte pieces `<0x00>`..`<0xFF>` (byte fallback: any text is encodable, never unk),
  260..V-1 BPE merges, learned from the training split only. V is exactly the configured size.
Text is kept verbatim (identity normalization, no dummy prefix, whitespace kept, newlines are
ordinary characters that merges may contain), so `decode(encode(text)) == text` for all text,
a literal "▁" included (see `SentencePieceTokenizer.encode_batch`).

Special tokens. The packed pipeline separates documents with EOS (and cem-sample starts a
prompt with it); BOS is reserved (unused by the pipeline); PAD fills evaluation rows (EOS when
the tokenizer has none). A sentencepiece model's are its own control pieces. A tokenizer.json's
are named by a `tokenizer_config.json` beside it when present (`eos_token`, `bos_token`,
`pad_token`: strings or {"content": ...} objects, as transformers writes them; a key given as
null means none), otherwise found among its special added tokens by the names models use
(`EOS_TOKENS`, `BOS_TOKENS`, `PAD_TOKENS`); EOS is required. Text is never read as a special
token: a literal "</s>" or "<|endoftext|>" in a document or prompt is encoded as its characters
(sentencepiece never matches control pieces in text; for a tokenizer.json the `tokenizers`
library is told not to, `encode_special_tokens`), and special ids decode to nothing.

Vocabulary sizes. `Tokenizer.vocab_size` is the tokenizer's own (its largest id + 1); a model's
vocabulary (`model.vocab_size`) may be larger (padded, e.g. to a multiple of 128) and must not
be smaller (`check_fits`).
"""

from __future__ import annotations

import abc
import hashlib
import io
import json
import math
import os
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm
import tokenizers

from cem_jax.data import files
from cem_jax.data.config import MIN_VOCAB_SIZE
from cem_jax.fileio import atomic_file

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPACE_SYMBOL = "\u2581"  # "▁", sentencepiece's marker for a space
TRAINER_VERSION = 1  # bump when the training settings change: it invalidates cached tokenizers
CHARACTER_COVERAGE = 0.9995  # rarer characters get no piece of their own: bytes encode them
MAX_CHUNK_CHARS = 4096  # training text is fed to sentencepiece in paragraphs of at most this
MAX_TRAINING_CHUNKS = 2_000_000  # sentencepiece samples this many chunks from a larger corpus
# The file a run directory (or a Hugging Face model directory) holds its tokenizer in, by kind,
# in the order `find_tokenizer` looks for them.
FILE_NAMES = {"sentencepiece": "tokenizer.model", "huggingface": "tokenizer.json"}
CONFIG_FILE = "tokenizer_config.json"  # beside a tokenizer.json: its special tokens
SPECIAL_KEYS = ("eos_token", "bos_token", "pad_token")  # the ones read from CONFIG_FILE
# Special added tokens of a tokenizer.json taken as EOS / BOS / PAD when no CONFIG_FILE names
# them (the first one it has): GPT-2, GPT-NeoX, Qwen; Llama 3; Llama 2, Mistral, T5; Gemma.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
PAD_TOKENS = ("<pad>", "<|pad|>", "<|padding|>", "[PAD]")
FALLBACK_NAMES = dict(zip(SPECIAL_KEYS, (EOS_TOKENS, BOS_TOKENS, PAD_TOKENS), strict=True))


class Tokenizer(abc.ABC):
    """A tokenizer as the pipeline, sampling and export use it. Ids are int; `encode` gives a
    list, `decode` takes any int sequence of ids in [0, vocab_size).

    Attributes:
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

    def saved_paths(self, path: str | Path) -> list[Path]:
        """Where `save(path)` writes `files()`, in their order: `path`, and the others beside
        it under their names."""
        path = Path(path)
        return [path if name == self.file_name else path.with_name(name) for name in self.files()]

    def save(self, path: str | Path) -> Path:
        """Write `data` to `path` (e.g. `run_dir / tokenizer.file_name`) and the other
        `files()` beside it, each atomically; `load_tokenizer(path)` gives back this tokenizer
        (same ids, same sha256). Returns `path`."""
        for target, content in zip(self.saved_paths(path), self.files().values(), strict=True):
            with atomic_file(target) as f:
                f.write(content)
        return Path(path)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (`model_proto`: its serialized bytes); its own special ids, and it
    must have an EOS (ValueError otherwise)."""

    kind = "sentencepiece"
    file_name = FILE_NAMES["sentencepiece"]

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
    file_name = FILE_NAMES["huggingface"]

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


def load_tokenizer(path: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
    """Load a tokenizer file: a Hugging Face tokenizer.json (a JSON object; its special tokens
    from a tokenizer_config.json beside it, see the module docstring) or a sentencepiece model.

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


def find_tokenizer(directory: str | Path) -> Path:
    """The tokenizer file of `directory` (a run directory, or a Hugging Face model directory):
    its tokenizer.model, else its tokenizer.json. Raises FileNotFoundError when it has
    neither, or is no directory."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    for name in FILE_NAMES.values():
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    raise FileNotFoundError(f"{directory} has no tokenizer file ({' or '.join(FILE_NAMES.values())}"
                            f"): it needs the tokenizer its model was trained with")


def saved_names(file_name: str) -> tuple[str, ...]:
    """The names of the files a tokenizer whose `file_name` is this writes (`Tokenizer.files`):
    a tokenizer.json's tokenizer_config.json too."""
    return (file_name, CONFIG_FILE) if file_name == FILE_NAMES["huggingface"] else (file_name,)


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
