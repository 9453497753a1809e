"""Readers of text and JSONL corpus files (`cem_jax.data.formats`), plain or gzip- (`.gz`) or
zstd-compressed (`.zst`, `.zstd`), decompressed as a stream: a text file is one document, a
JSONL file one per line (its string field `text_column`). A file's start is checked before and
after decompression (`common.check_head`, `sniff`); the byte offset of invalid UTF-8 is that of
the decompressed data. Both are read whole (no `Part`s).
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import zstandard

from cem_jax.data import files
from cem_jax.data.formats.common import (
    ALLOW_INVALID_UTF8_HINT,
    SNIFF_BYTES,
    Document,
    Part,
    check_head,
    compression_of,
    damaged,
    decode,
    refusal,
    sniff,
)

CHUNK_BYTES = 1 << 20  # read size of streams


def text_documents(path: str, text_column: str, allow_invalid_utf8: bool,
                   part: Part | None) -> Iterator[Document]:
    """The one document of text file `path` (see `cem_jax.data.formats.documents`;
    `text_column` and `part` are not used: the whole file is the text)."""
    with _decompressed(path, "text") as stream:
        data = stream.read()
    yield Document(path, decode(data, path, allow_invalid_utf8))


def jsonl_documents(path: str, text_column: str, allow_invalid_utf8: bool,
                    part: Part | None) -> Iterator[Document]:
    """The documents of JSONL file `path`, one per non-blank line, streamed (see
    `cem_jax.data.formats.documents`; `part` is not used: the file is read whole)."""
    with _decompressed(path, "jsonl") as stream:
        offset = 0
        for number, raw in enumerate(stream, 1):
            where = f"{path}:{number}"
            line = decode(raw, where, allow_invalid_utf8, offset)
            offset += len(raw)
            if line.strip():
                yield Document(where, _json_field(line, where, text_column, allow_invalid_utf8))


@contextmanager
def _decompressed(path: str, fmt: str) -> Iterator[io.BufferedReader]:
    """File `path` of format `fmt` ("text" or "jsonl") as a stream of its decompressed bytes,
    after checking that its start is what its name says. Raises ValueError."""
    compression = compression_of(path)
    with files.open_file(path) as raw:
        check_head(raw, path, {compression} if compression else {"text", "empty"},
                   compression or fmt)
        chunks = (_gzip_chunks(raw, path) if compression == "gzip" else
                  _zstd_chunks(raw, path) if compression == "zstd" else
                  iter(functools.partial(raw.read, CHUNK_BYTES), b""))
        stream = io.BufferedReader(_ChunkReader(chunks), CHUNK_BYTES)
        if compression:
            inner = stream.peek(SNIFF_BYTES)[:SNIFF_BYTES]
            if sniff(inner) not in ("text", "empty"):
                raise refusal(path, inner, fmt, decompressed=compression)
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
        raise damaged(path, "gzip", err) from None


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
        raise damaged(path, "zstd", err) from None
    if inside_frame:
        raise damaged(path, "zstd", "the data ends inside a frame")


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
