"""The reader of Parquet corpus files (`cem_jax.data.formats`): one row per document, its string
column `text_column` (null rows: empty documents), read by row group through
`files.open_file` (local or a URL); and a file's row groups as `Part`s, the pieces a large
file's tokenization is cut into (`row_groups`), each read alone by `parquet_documents`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq

from cem_jax.data import files
from cem_jax.data.formats.common import (
    Document,
    Part,
    check_head,
    compression_of,
    damaged,
    decode,
)

PARQUET_BATCH = 1024  # rows read at once from a Parquet file


def row_groups(path: str, *, text_column: str = "text") -> list[Part]:
    """The row groups of Parquet file `path`, one Part each in file order, sized by the
    uncompressed bytes of `text_column` in the file's metadata (no data read; a file without
    row groups has none): the pieces a large file's tokenization is cut into.
    Raises:
      ValueError: (one line) the file is not a Parquet file (see
        `cem_jax.data.formats.documents`), or it lacks a string column `text_column`.
      FileNotFoundError: `path` does not exist.
    """
    with _parquet(path) as pf:
        column = _text_column_index(pf, path, text_column)
        metadata = pf.metadata
        return [Part(i, i + 1, metadata.row_group(i).column(column).total_uncompressed_size)
                for i in range(metadata.num_row_groups)]


def parquet_documents(path: str, text_column: str, allow_invalid_utf8: bool,
                      part: Part | None) -> Iterator[Document]:
    """The documents of Parquet file `path`, or of its row groups `part` (None: all), one per
    row (see `cem_jax.data.formats.documents`)."""
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


@contextmanager
def _parquet(path: str) -> Iterator[pq.ParquetFile]:
    """Parquet file `path` opened (its footer read). Raises ValueError for a file that is not
    Parquet, is compressed as a whole, or is truncated or damaged."""
    if compression_of(path):
        raise ValueError(f"{path}: a Parquet file is not compressed as a whole (its pages are): "
                         f"decompress it and give it a .parquet name")
    with files.open_file(path) as f:
        check_head(f, path, {"parquet"}, "parquet")
        try:
            parquet_file = pq.ParquetFile(f)
        except Exception as err:
            raise damaged(path, "parquet", err) if _of_arrow(err) else err from None
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


def _arrow_errors(batches: Iterator[pa.RecordBatch], path: str) -> Iterator[pa.RecordBatch]:
    """`batches`, with pyarrow's errors of a damaged file as one-line ValueErrors."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:
            raise damaged(path, "parquet", err) if _of_arrow(err) else err from None
        yield batch


def _of_arrow(err: Exception) -> bool:
    """Whether `err` is pyarrow's of a damaged file: an ArrowException or a plain OSError (the
    file system's errors, passed through pyarrow, are OSError's subclasses or others)."""
    return isinstance(err, pa.ArrowException) or type(err) is OSError
