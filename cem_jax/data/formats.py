"""Readers of corpus files: text, JSONL, Parquet and ArrayRecord, local or on `gs://`.

    fmt = format_of(path)                       # by the name: "text", "jsonl", "parquet", ...
    for doc in documents(path, fmt):            # doc.name, doc.text (possibly empty)
        ...
    groups = row_groups(path)                   # a large Parquet file's pieces (Part)
    documents(path, "parquet", part=groups[3])  # read alone, by another worker

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
import functools
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from cem_jax.data import files

FORMATS = ("text", "jsonl", "parquet", "arrayrecord")
ALLOW_INVALID_UTF8_HINT = ("set data.allow_invalid_utf8=true (--allow-invalid-utf8 of cem-data "
                           "and cem-eval)")
SNIFF_BYTES = 1 << 16  # how much of a file's start is checked for what it is
CHUNK_BYTES = 1 << 20  # read size of streams
PARQUET_BATCH = 1024  # rows read at once from a Parquet file
ARRAYRECORD_BATCH = 256  # records read at once from an ArrayRecord file

_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_MAGIC = ((b"PAR1", "parquet"), (bytes.fromhex("83af70d10d884a3f"), "arrayrecord"),
          (b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"))
_CONTROL = bytes(sorted(set(range(32)) - set(b"\t\n\v\f\r\x1b")))  # never in text (but ESC)
_LABEL = {"text": "text", "jsonl": "JSONL", "parquet": "a Parquet file",
          "arrayrecord": "an ArrayRecord file", "gzip": "gzip-compressed as its name says",
          "zstd": "zstd-compressed as its name says"}
_WHAT = {"parquet": "a Parquet file", "arrayrecord": "an ArrayRecord file",
         "gzip": "gzip-compressed", "zstd": "zstd-compressed", "text": "text", "empty": "empty",
         "binary": "binary data"}
_NAME_IT = {"parquet": "give it a .parquet name or the prefix parquet:",
            "arrayrecord": "give it an .array_record name or the prefix arrayrecord:",
            "gzip": "if it holds text or JSONL, name it so (.txt.gz, .jsonl.gz) or use the "
                    "prefix text: or jsonl:",
            "zstd": "if it holds text or JSONL, name it so (.txt.zst, .jsonl.zst) or use the "
                    "prefix text: or jsonl:",
            "text": "give it a name for what it holds (.txt, .jsonl, or .gz/.zst when "
                    "compressed) or the prefix text: or jsonl:",
            "empty": "download it again",
            "binary": "check that it is the file you meant (text in UTF-16 or UTF-32: convert "
                      "it to UTF-8)"}


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: `name` ("path", "path:LINE" of JSONL, "path[ROW]" of a Parquet row or an
    ArrayRecord record; a built-in work's name) and its normalized `text` (possibly empty)."""

    name: str
    text: str


@dataclasses.dataclass(frozen=True)
class Part:
    """A piece of one file that can be read alone: Parquet row groups [start, stop), or the whole
    file (start = stop = None); `size` in bytes (Parquet: of the text column, uncompressed; else
    the file on disk) for balancing work."""

    start: int | None
    stop: int | None
    size: int


def compression_of(path: str) -> str | None:
    """"gzip" for a name ending in .gz, "zstd" for .zst or .zstd, else None."""
    return _COMPRESSIONS.get(os.path.splitext(path.lower())[1])


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


def row_groups(path: str, *, text_column: str = "text") -> list[Part]:
    """The row groups of Parquet file `path`, one Part each in file order, sized by the
    uncompressed bytes of `text_column` in the file's metadata (no data read; a file without
    row groups has none): the pieces a large file's tokenization is cut into.
    Raises:
      ValueError: (one line) the file is not a Parquet file (see `documents`), or it lacks a
        string column `text_column`.
      FileNotFoundError: `path` does not exist.
    """
    with _parquet(path) as pf:
        column = _text_column_index(pf, path, text_column)
        metadata = pf.metadata
        return [Part(i, i + 1, metadata.row_group(i).column(column).total_uncompressed_size)
                for i in range(metadata.num_row_groups)]


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
        return _parquet_documents(path, text_column, allow_invalid_utf8, part)
    if part is not None and part.start is not None:
        raise ValueError(f"{path}: a part of row groups {part.start}..{part.stop} is only for "
                         f"Parquet files, and this one is read as {fmt}")
    if fmt == "text":
        return _text_documents(path, allow_invalid_utf8)
    if fmt == "jsonl":
        return _jsonl_documents(path, text_column, allow_invalid_utf8)
    return _arrayrecord_documents(path, allow_invalid_utf8)


def decode(data: bytes, where: str, allow_invalid_utf8: bool, offset: int = 0) -> str:
    """UTF-8 bytes -> normalized text (no leading BOM, LF line ends).

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


def sniff(head: bytes) -> str:
    """What a file's first bytes say it is: "empty", "parquet", "arrayrecord", "gzip", "zstd",
    "binary" (over 1% control bytes such as NUL, never in text), else "text"."""
    if not head:
        return "empty"
    kind = next((kind for magic, kind in _MAGIC if head.startswith(magic)), None)
    if kind:
        return kind
    return "binary" if _control_bytes(head) * 100 > len(head) else "text"


def _control_bytes(head: bytes) -> int:
    return len(head) - len(head.translate(None, _CONTROL))


def _refusal(path: str, head: bytes, wanted: str, decompressed: str | None = None) -> ValueError:
    """The one-line error of file `path` starting with `head`, which is not `wanted` (a format
    or a compression); `decompressed`: the compression `head` came out of."""
    found = sniff(head)
    what = _WHAT[found]
    if found == "binary":
        what += (f" ({_control_bytes(head)} of its first {len(head)} bytes are control bytes "
                 "such as NUL)")
    if found == "text" and wanted in _COMPRESSIONS.values():
        return ValueError(f"{path} is text, not {_LABEL[wanted]}: remove the compression "
                          "suffix from its name")
    if decompressed:
        return ValueError(f"{path} decompressed ({decompressed}) is {what}, not {_LABEL[wanted]}:"
                          f" decompress it, then {_NAME_IT[found]}")
    return ValueError(f"{path} is {what}, not {_LABEL[wanted]}: {_NAME_IT[found]}")


def _damaged(path: str, what: str, err: object) -> ValueError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ValueError(f"{path} is truncated or damaged ({what}: {reason}): download it again")


def _check_head(f: IO[bytes], path: str, allowed: set[str], wanted: str) -> None:
    """Raise `_refusal` (not `wanted`) unless the first SNIFF_BYTES of seekable file `f`, of
    `path`, sniff as one of `allowed`; `f` is left at its start."""
    head = f.read(SNIFF_BYTES)
    f.seek(0)
    if sniff(head) not in allowed:
        raise _refusal(path, head, wanted)


# -- text and JSONL: (de)compressed streams ------------------------------------------------------

@contextmanager
def _decompressed(path: str, fmt: str) -> Iterator[io.BufferedReader]:
    """File `path` of format `fmt` ("text" or "jsonl") as a stream of its decompressed bytes,
    after checking that its start is what its name says. Raises ValueError."""
    compression = compression_of(path)
    with files.open_file(path) as raw:
        _check_head(raw, path, {compression} if compression else {"text", "empty"},
                    compression or fmt)
        chunks = (_gzip_chunks(raw, path) if compression == "gzip" else
                  _zstd_chunks(raw, path) if compression == "zstd" else
                  iter(functools.partial(raw.read, CHUNK_BYTES), b""))
        stream = io.BufferedReader(_ChunkReader(chunks), CHUNK_BYTES)
        if compression:
            inner = stream.peek(SNIFF_BYTES)[:SNIFF_BYTES]
            if sniff(inner) not in ("text", "empty"):
                raise _refusal(path, inner, fmt, decompressed=compression)
        yield stream


class _ChunkReader(io.RawIOBase):
    """A readable stream of the bytes of an iterator of non-empty chunks."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self._pending:
            self._pending = memoryview(next(self._chunks, b""))
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _gzip_chunks(raw: IO[bytes], path: str) -> Iterator[bytes]:
    """The decompressed bytes of gzip stream `raw` (all its members). Raises ValueError for a
    truncated or damaged stream."""
    stream = gzip.GzipFile(fileobj=raw, mode="rb")
    try:
        while chunk := stream.read(CHUNK_BYTES):
            yield chunk
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise _damaged(path, "gzip", err) from None


def _zstd_chunks(raw: IO[bytes], path: str) -> Iterator[bytes]:
    """The decompressed bytes of zstd stream `raw` (all its frames). Raises ValueError for a
    truncated or damaged stream (zstandard's own stream reader ends silently at a truncation)."""
    context = zstandard.ZstdDecompressor()
    frame, inside_frame = context.decompressobj(), False
    try:
        while data := raw.read(CHUNK_BYTES):
            while data:
                chunk, inside_frame, data = frame.decompress(data), True, b""
                if frame.eof:  # the next frame starts in what this one left
                    data, frame, inside_frame = frame.unused_data, context.decompressobj(), False
                if chunk:
                    yield chunk
    except zstandard.ZstdError as err:
        raise _damaged(path, "zstd", err) from None
    if inside_frame:
        raise _damaged(path, "zstd", "the data ends inside a frame")


def _text_documents(path: str, allow_invalid_utf8: bool) -> Iterator[Document]:
    with _decompressed(path, "text") as stream:
        data = stream.read()
    yield Document(path, decode(data, path, allow_invalid_utf8))


def _jsonl_documents(path: str, text_column: str,
                     allow_invalid_utf8: bool) -> Iterator[Document]:
    with _decompressed(path, "jsonl") as stream:
        offset = 0
        for number, raw in enumerate(stream, 1):
            where = f"{path}:{number}"
            line = decode(raw, where, allow_invalid_utf8, offset)
            offset += len(raw)
            if line.strip():
                yield Document(where, _json_field(line, where, text_column, allow_invalid_utf8))


def _json_field(line: str, where: str, text_column: str, allow_invalid_utf8: bool) -> str:
    """The normalized string field `text_column` of JSON object `line`. Raises ValueError."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_column), str):
        found = (f"its fields: {', '.join(map(repr, record))}" if isinstance(record, dict)
                 else f"a JSON {type(record).__name__}")
        raise ValueError(f"{where}: expected a JSON object with a string {json.dumps(text_column)}"
                         f" field ({found}); data.text_column names the field that holds the text")
    return _json_text(record[text_column], where, allow_invalid_utf8)


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
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


# -- Parquet --------------------------------------------------------------------------------------

@contextmanager
def _parquet(path: str) -> Iterator[pq.ParquetFile]:
    """Parquet file `path` opened (its footer read). Raises ValueError for a file that is not
    Parquet, is compressed as a whole, or is truncated or damaged."""
    if compression_of(path):
        raise ValueError(f"{path}: a Parquet file is not compressed as a whole (its pages are): "
                         f"decompress it and give it a .parquet name")
    with files.open_file(path) as f:
        _check_head(f, path, {"parquet"}, "parquet")
        try:
            parquet_file = pq.ParquetFile(f)
        except Exception as err:
            raise _damaged(path, "parquet", err) if _of_arrow(err) else err from None
        yield parquet_file


def _text_column_index(pf: pq.ParquetFile, path: str, text_column: str) -> int:
    """The index of string column `text_column` of `pf`. Raises ValueError naming the columns."""
    schema = pf.schema_arrow
    strings = [f.name for f in schema if _is_string(f.type)]
    if text_column not in schema.names:
        columns = ", ".join(f"{f.name!r} ({f.type})" for f in schema)
        raise ValueError(f"{path} has no column {text_column!r} (its columns: {columns}): set "
                         f"data.text_column to the column that holds the text")
    if text_column not in strings:
        have = (f"its string columns: {', '.join(map(repr, strings))}" if strings else
                "it has no string column")
        raise ValueError(f"{path}: column {text_column!r} holds "
                         f"{schema.field(text_column).type}, not strings ({have}): set "
                         f"data.text_column to the column that holds the text")
    leaves = pf.metadata.schema  # the metadata's columns are the schema's leaves
    return next(i for i in range(len(leaves)) if leaves.column(i).path == text_column)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _parquet_documents(path: str, text_column: str, allow_invalid_utf8: bool,
                       part: Part | None) -> Iterator[Document]:
    with _parquet(path) as pf:
        _text_column_index(pf, path, text_column)
        groups = pf.metadata.num_row_groups
        start, stop = (0, groups) if part is None or part.start is None else (part.start,
                                                                              part.stop)
        if not 0 <= start <= stop <= groups:
            raise ValueError(f"{path} has {groups} row groups: a part of row groups "
                             f"{start}..{stop} is not of this file")
        row = sum(pf.metadata.row_group(i).num_rows for i in range(start))
        batches = pf.iter_batches(row_groups=range(start, stop), columns=[text_column],
                                   batch_size=PARQUET_BATCH)
        for batch in _arrow_errors(batches, path):
            for data in batch.column(0).cast(pa.large_binary()).to_pylist():
                text = "" if data is None else decode(data, f"{path} row {row}",
                                                      allow_invalid_utf8)
                yield Document(f"{path}[{row}]", text)
                row += 1


def _arrow_errors(batches: Iterator[pa.RecordBatch], path: str) -> Iterator[pa.RecordBatch]:
    """`batches`, with pyarrow's errors of a damaged file as one-line ValueErrors."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:
            raise _damaged(path, "parquet", err) if _of_arrow(err) else err from None
        yield batch


def _of_arrow(err: Exception) -> bool:
    """Whether `err` is pyarrow's of a damaged file: an ArrowException or a plain OSError (the
    file system's errors, passed through pyarrow, are OSError's subclasses or others)."""
    return isinstance(err, pa.ArrowException) or type(err) is OSError


# -- ArrayRecord ----------------------------------------------------------------------------------

def _check_arrayrecord(path: str) -> None:
    """Raises ValueError unless `path` is an uncompressed ArrayRecord file, local or on gs://."""
    if files.is_url(path) and not path.startswith("gs://"):
        raise ValueError(f"{path}: ArrayRecord files are read from local paths and gs:// only: "
                         f"copy it locally or convert it to Parquet or JSONL")
    with files.open_file(path) as f:
        _check_head(f, path, {"arrayrecord"}, "arrayrecord")


def _arrayrecord_documents(path: str, allow_invalid_utf8: bool) -> Iterator[Document]:
    _check_arrayrecord(path)
    reader = _arrayrecord_reader(path)
    try:
        count = reader.num_records()
        for begin in range(0, count, ARRAYRECORD_BATCH):
            try:
                records = reader.read(begin, min(begin + ARRAYRECORD_BATCH, count))
            except RuntimeError as err:
                raise _damaged(path, "array_record", err) from None
            for i, record in enumerate(records, begin):
                yield Document(f"{path}[{i}]", decode(record, f"{path} record {i}",
                                                      allow_invalid_utf8))
    finally:
        reader.close()


def _arrayrecord_reader(path: str):
    """An open ArrayRecordReader of `path`. Raises ValueError for a damaged file."""
    # imported here: array-record is a dependency only where it is built (not on Windows)
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(files.local(path))
        if reader.ok():
            return reader
        reader.close()  # raises the reason the file could not be read
        reason = "it cannot be read"
    except RuntimeError as err:
        reason = err
    raise _damaged(path, "array_record", reason)
