"""Readers of corpus files: text, JSONL, Parquet and ArrayRecord, local or on `gs://`.

    fmt = format_of(path)                       # by the name: "text", "jsonl", "parquet", ...
    for doc in documents(path, fmt):            # doc.name, doc.text (possibly empty)
        ...
    groups = parquet.row_groups(path)           # a large Parquet file's pieces (Part)
    documents(path, "parquet", part=groups[3])  # read alone, by another worker

This module holds `TABLE`, one `Format` row per format: its name, the name suffixes it claims,
its magic bytes, its reader and how a file of it splits into parts. `format_of` and `documents`
read it, and so do the checks of a file's first bytes. A new format is a reader module and a
row. The readers: `text` (text and JSONL), `parquet` (Parquet; `row_groups`), `arrayrecord`
(ArrayRecord). What they share (`Document`, `Part`, `decode`, the checks of a file's first bytes
and their errors) is in `common`.

Text and JSONL may be gzip- (`.gz`) or zstd-compressed (`.zst`, `.zstd`), decompressed as a
stream. Every text is strict UTF-8 (an error names the file and the byte offset of the first
invalid byte, of the decompressed data for a compressed file, unless `allow_invalid_utf8` asks
for U+FFFD replacement), then normalized: a leading byte-order mark is dropped and CRLF line ends
become LF.

A file that is not what its name or format says is refused with one line naming the file, what
it is, and what to do, never with advice that leads to training on its bytes: the first bytes
of each file are checked for the magic bytes of Parquet, ArrayRecord (riegeli), gzip and zstd,
and for binary data (control bytes such as NUL), before and after decompression.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

from cem_jax.data.formats.arrayrecord import arrayrecord_documents
from cem_jax.data.formats.common import Document, Part, compression_of
from cem_jax.data.formats.parquet import parquet_documents, row_groups
from cem_jax.data.formats.text import jsonl_documents, text_documents

__all__ = ["BY_NAME", "FORMATS", "TABLE", "Document", "Format", "Part", "documents",
           "format_of"]

# (path, text_column, allow_invalid_utf8, part: None for the whole file) -> its documents
Reader = Callable[[str, str, bool, Part | None], Iterator[Document]]


@dataclasses.dataclass(frozen=True)
class Format:
    """A corpus format: its `name` (a corpus spec's FORMAT: prefix), the `suffixes` of file
    names that claim it (before a compression suffix), the `magic` bytes its files start with
    (None: no fixed start; a format with them claims a suffix, which the refusal of such a file
    read as another format names), its `label` in messages ("a Parquet file"), its reader
    (`read`) and, for a format whose file can be cut into pieces read alone,
    `parts(path, text_column=...)`, a file's `Part`s (None: a file is read whole)."""

    name: str
    suffixes: tuple[str, ...]
    magic: bytes | None
    label: str
    read: Reader
    parts: Callable[..., list[Part]] | None = None


# Format(name, suffixes, magic, label, read, parts). A name that no suffix claims is text (.txt,
# .md, no extension); ArrayRecord's magic bytes are riegeli's.
TABLE = (
    Format("text", (), None, "text", text_documents),
    Format("jsonl", (".jsonl", ".ndjson", ".json"), None, "JSONL", jsonl_documents),
    Format("parquet", (".parquet",), b"PAR1", "a Parquet file", parquet_documents,
           parts=row_groups),
    Format("arrayrecord", (".array_record", ".arrayrecord"), bytes.fromhex("83af70d10d884a3f"),
           "an ArrayRecord file", arrayrecord_documents),
)
BY_NAME = {f.name: f for f in TABLE}
FORMATS = tuple(BY_NAME)


def format_of(path: str) -> str:
    """The format `path`'s name says: .jsonl, .ndjson and .json (also .gz/.zst/.zstd-compressed:
    Dolma names its JSONL files .json.gz) -> "jsonl"; .parquet -> "parquet"; .array_record and
    .arrayrecord -> "arrayrecord"; anything else (.txt, .txt.gz, no extension) -> "text"."""
    name = path.lower()
    if compression_of(name):
        name = os.path.splitext(name)[0]
    return next((f.name for f in TABLE if f.suffixes and name.endswith(f.suffixes)), "text")


def documents(path: str, fmt: str, *, text_column: str = "text", allow_invalid_utf8: bool = False,
              part: Part | None = None) -> Iterator[Document]:
    """The documents of file `path` in format `fmt` (of `FORMATS`), or of `part` of it (Parquet
    row groups, from `row_groups`; None: the whole file), in file order, empty ones included.

    text: the whole file is one document. jsonl: one JSON object per line (blank lines skipped),
    its string field `text_column`, streamed. parquet: one row per document, its string column
    `text_column` (null rows: empty documents), read by row group through `files.open_file`.
    arrayrecord: each record the UTF-8 bytes of a document (local or gs://).
    Errors are raised while iterating (but for an unknown `fmt` or a `part` of row groups of a
    file read as another format); those of data further in a file (a damaged stream, a bad JSONL
    line) once the documents before it have been yielded.
    Raises:
      ValueError: (one line, naming the file) `fmt` is unknown; the file is not what `fmt` and
        its name say (Parquet, ArrayRecord, gzip/zstd or binary data read as text or JSONL; text
        or other data read as Parquet, ArrayRecord or gzip/zstd); a truncated or damaged
        gzip/zstd stream or Parquet file; a Parquet file without a string column `text_column`;
        a JSONL line that is not a JSON object with a string field `text_column`; invalid UTF-8
        (unless `allow_invalid_utf8`); a `part` with row groups of a file that is not Parquet,
        or outside the file's.
      FileNotFoundError: `path` does not exist.
    """
    if fmt not in BY_NAME:
        raise ValueError(f"unknown format {fmt!r} of {path}: expected one of {', '.join(FORMATS)}")
    row = BY_NAME[fmt]
    if row.parts is None and part is not None and part.start is not None:
        raise ValueError(f"{path}: a part of row groups {part.start}..{part.stop} is only for "
                         f"Parquet files, and this one is read as {fmt}")
    return row.read(path, text_column, allow_invalid_utf8, part)
