"""The reader of ArrayRecord corpus files (`cem_jax.data.formats`), local or on gs://: each
record the UTF-8 bytes of one document, read in batches of ARRAYRECORD_BATCH records; a file is
read whole (no `Part`s).
"""

from __future__ import annotations

from collections.abc import Iterator

from cem_jax.data import files
from cem_jax.data.formats.common import Document, Part, check_head, damaged, decode

ARRAYRECORD_BATCH = 256  # records read at once from an ArrayRecord file


def arrayrecord_documents(path: str, text_column: str, allow_invalid_utf8: bool,
                          part: Part | None) -> Iterator[Document]:
    """The documents of ArrayRecord file `path`, one per record (see
    `cem_jax.data.formats.documents`; `text_column` and `part` are not used: a record is the
    text, and the file is read whole)."""
    _check_arrayrecord(path)
    reader = _arrayrecord_reader(path)
    try:
        count = reader.num_records()
        for begin in range(0, count, ARRAYRECORD_BATCH):
            try:
                records = reader.read(begin, min(begin + ARRAYRECORD_BATCH, count))
            except RuntimeError as err:
                raise damaged(path, "array_record", err) from None
            for i, record in enumerate(records, begin):
                yield Document(f"{path}[{i}]", decode(record, f"{path} record {i}",
                                                      allow_invalid_utf8))
    finally:
        reader.close()


def _check_arrayrecord(path: str) -> None:
    """Raises ValueError unless `path` is an uncompressed ArrayRecord file, local or on gs://."""
    if files.is_url(path) and not path.startswith("gs://"):
        raise ValueError(f"{path}: ArrayRecord files are read from local paths and gs:// only: "
                         f"copy it locally or convert it to Parquet or JSONL")
    with files.open_file(path) as f:
        check_head(f, path, {"arrayrecord"}, "arrayrecord")


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
    raise damaged(path, "array_record", reason)
