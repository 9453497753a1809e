"""Readers of corpus files: text, JSONL, Parquet and ArrayRecord, local or on `gs://`.

    fmt = format_of(path)                       # by the name: "text", "jsonl", "parquet", ...
    for doc in documents(path, fmt):            # doc.name, doc.text (possibly empty)
        ...
    groups = formats_parquet.row_groups(path)   # a large Parquet file's pieces (Part)
    documents(path, "parquet", part=groups[3])  # read alone, by another worker

This module holds the formats, what a file's name says it is (`format_of`) and `documents`,
which hands a file to the reader of its format: `formats_text` (text and JSONL),
`formats_parquet` (Parquet; `row_groups` and `Part`), `formats_arrayrecord` (ArrayRecord). What
they share (`Document`, `decode`, the checks of a file's first bytes and their errors) is in
`formats_common`.

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

import os
from collections.abc import Iterator

from cem_jax.data.formats_arrayrecord import arrayrecord_documents
from cem_jax.data.formats_common import Document, compression_of
from cem_jax.data.formats_parquet import Part, parquet_documents
from cem_jax.data.formats_text import jsonl_documents, text_documents

FORMATS = ("text", "jsonl", "parquet", "arrayrecord")

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def format_of(path: str) -> str:
    """The format `path`'s name says: .jsonl, .ndjson and .json (also .gz/.zst/.zstd-compressed:
    Dolma names its JSONL files .json.gz) -> "jsonl"; .parquet -> "parquet"; .array_record and
    .arrayrecord -> "arrayrecord"; anything else (.txt, .txt.gz, no extension) -> "text"."""
    name = path.lower()
    if compression_of(name):
        name = os.path.splitext(name)[0]
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".array_record", ".arrayrecord")):
        return "arrayrecord"
    return "text"


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
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} of {path}: expected one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        return parquet_documents(path, text_column, allow_invalid_utf8, part)
    if part is not None and part.start is not None:
        raise ValueError(f"{path}: a part of row groups {part.start}..{part.stop} is only for "
                         f"Parquet files, and this one is read as {fmt}")
    if fmt == "text":
        return text_documents(path, allow_invalid_utf8)
    if fmt == "jsonl":
        return jsonl_documents(path, text_column, allow_invalid_utf8)
    return arrayrecord_documents(path, allow_invalid_utf8)
