"""Readers of corpus files (the cem_jax.data.formats package): text, JSONL (plain, gzip, zstd),
Parquet and ArrayRecord, local and on gs:// (a local emulator); and the one-line errors of bad
files."""

import gzip
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from array_record.python.array_record_module import ArrayRecordWriter

from cem_jax.data import files
from cem_jax.data.formats import Document, Part, documents, format_of
from cem_jax.data.formats.common import compression_of
from cem_jax.data.formats.parquet import row_groups


def read(path, fmt=None, **kwargs) -> list[tuple[str, str]]:
    return [(d.name, d.text) for d in documents(str(path), fmt or format_of(str(path)), **kwargs)]


def jsonl_bytes(texts, field="text") -> bytes:
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def zst(data: bytes, frames: int = 1) -> bytes:
    """zstd of `data` as `frames` concatenated frames (as `zstd` of split files makes)."""
    cut = len(data) // frames
    pieces = [data[i * cut:(i + 1) * cut if i < frames - 1 else None] for i in range(frames)]
    return b"".join(zstandard.ZstdCompressor().compress(p) for p in pieces)


def write_parquet(path, texts, row_group_size=3, **columns) -> None:
    table = pa.table({"text": pa.array(texts, pa.string()), **columns})
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")


def write_arrayrecord(path, records) -> None:
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()


TEXTS = ["first doc\r\nline two", "", "zweites Dokument ü", "third", "fourth\n", "fifth", "6"]


@pytest.mark.parametrize("name, fmt, compression", [
    ("a.txt", "text", None), ("a.txt.gz", "text", "gzip"), ("a.txt.zst", "text", "zstd"),
    ("README", "text", None), ("a.md", "text", None), ("a.jsonl", "jsonl", None),
    ("a.jsonl.gz", "jsonl", "gzip"), ("A.JSONL.ZST", "jsonl", "zstd"),
    ("a.jsonl.zstd", "jsonl", "zstd"), ("a.json.gz", "jsonl", "gzip"), ("a.ndjson", "jsonl", None),
    ("a.parquet", "parquet", None), ("a.parquet.gz", "parquet", "gzip"),
    ("a.array_record", "arrayrecord", None), ("a.arrayrecord", "arrayrecord", None),
    ("gs://b/x.jsonl/part-0.txt", "text", None), ("gs://b/data/x.gz.parquet", "parquet", None),
])
def test_format_and_compression_are_read_from_the_name(name, fmt, compression):
    assert (format_of(name), compression_of(name)) == (fmt, compression)


def test_text_is_one_normalized_document_plain_or_compressed(tmp_path):
    data = b"\xef\xbb\xbfline one\r\nline two\r\n"
    for name, blob in (("w.txt", data), ("w.txt.gz", gzip.compress(data)),
                       ("w.txt.zst", zst(data))):
        (tmp_path / name).write_bytes(blob)
        assert read(tmp_path / name) == [(str(tmp_path / name), "line one\nline two\n")]
    (tmp_path / "empty.txt").write_bytes(b"")
    assert read(tmp_path / "empty.txt") == [(str(tmp_path / "empty.txt"), "")]


def test_jsonl_yields_the_text_column_of_each_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"content": "\ufeffone", "text": 5}), "", "  ",
             json.dumps({"content": "two\r\nlines"}), json.dumps({"content": ""})]
    path.write_text("\n".join(lines) + "\n")
    assert read(path, text_column="content") == [
        (f"{path}:1", "one"), (f"{path}:4", "two\nlines"), (f"{path}:5", "")]


def test_compressed_jsonl_equals_plain_jsonl(tmp_path):
    data = jsonl_bytes(TEXTS * 50)
    (tmp_path / "d.jsonl").write_bytes(data)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(data[:999]) + gzip.compress(data[999:]))
    (tmp_path / "d.jsonl.zst").write_bytes(zst(data, frames=3))
    plain = read(tmp_path / "d.jsonl")
    assert len(plain) == 350 and plain[2] == (f"{tmp_path / 'd.jsonl'}:3", "zweites Dokument ü")
    for name in ("d.jsonl.gz", "d.jsonl.zst"):
        assert [(n.replace(name, "d.jsonl"), t) for n, t in read(tmp_path / name)] == plain


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".zst", zst)])
def test_compressed_jsonl_is_streamed(tmp_path, suffix, compress):
    texts = [f"document {i} " * 40 for i in range(12_000)]  # 6 MB: several read chunks
    path = tmp_path / f"big.jsonl{suffix}"
    path.write_bytes(compress(jsonl_bytes(texts))[:-2000])  # truncated near its end
    docs = documents(str(path), "jsonl")
    assert next(docs).text == texts[0]  # yielded before the stream's end is read
    count = 1
    with pytest.raises(ValueError, match=rf"^{path} is truncated or damaged \((gzip|zstd): "):
        for _ in docs:
            count += 1
    assert 1000 < count < len(texts)


@pytest.mark.parametrize("line, message", [
    ('{"txt": "x"}', r':2: expected a JSON object with a string "body" field \(its fields: '
                     r"'txt'\); data.text_column names the field that holds the text"),
    ('{"body": 5}', r':2: expected a JSON object with a string "body" field \(its fields: '
                    r"'body'\)"),
    ('[1, 2]', r':2: expected a JSON object with a string "body" field \(a JSON list\)'),
    ("[1, 2", r":2: not valid JSON"),
    ('{"body": "\\ud800"}', r":2: the text holds a lone surrogate at character 0"),
    (b'{"body": "b\xc3("}', r":2: invalid UTF-8 at byte offset 28 .*allow_invalid_utf8"),
])
def test_jsonl_bad_lines_are_located(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    line = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(b'{"body": "fine"}\n' + line + b"\n")  # the first line: 17 bytes
    with pytest.raises(ValueError, match=f"^{path}{message}") as err:
        read(path, text_column="body")
    assert "\n" not in str(err.value)


def test_parquet_parts_are_row_groups_sized_by_the_text_column(tmp_path):
    path = str(tmp_path / "d.parquet")
    write_parquet(path, [t * 20 for t in TEXTS], row_group_size=3, id=list(range(7)))
    metadata = pq.ParquetFile(path).metadata
    expected = [metadata.row_group(i).column(0).total_uncompressed_size for i in range(3)]
    assert row_groups(path) == [Part(0, 1, expected[0]), Part(1, 2, expected[1]),
                                Part(2, 3, expected[2])]
    assert expected[0] > expected[2] > 0  # 3 long rows against 1 short one


def test_parquet_rows_are_documents_named_by_their_row_in_the_file(tmp_path):
    path = str(tmp_path / "d.parquet")
    texts = ["\ufeffa\r\nb", None, "", "c", "d", "e", "f"]
    write_parquet(path, texts, row_group_size=3, n=list(range(7)))
    whole = read(path)
    assert whole == [(f"{path}[0]", "a\nb"), (f"{path}[1]", ""), (f"{path}[2]", ""),
                     (f"{path}[3]", "c"), (f"{path}[4]", "d"), (f"{path}[5]", "e"),
                     (f"{path}[6]", "f")]
    by_part = [read(path, part=p) for p in row_groups(path)]
    assert by_part[1] == whole[3:6] and sum(by_part, []) == whole
    assert read(path, part=Part(1, 3, 0)) == whole[3:]


def test_parquet_text_column_and_large_strings(tmp_path):
    path = str(tmp_path / "d.parquet")
    table = pa.table({"id": [1, 2], "body": pa.array(["x", "yz"], pa.large_string())})
    pq.write_table(table, path)
    assert read(path, text_column="body") == [(f"{path}[0]", "x"), (f"{path}[1]", "yz")]


def test_parquet_invalid_utf8_names_the_row(tmp_path):
    path = str(tmp_path / "d.parquet")
    strings = pa.array([b"good", b"ok", b"ba\xffd"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": strings}), path)
    with pytest.raises(ValueError, match=rf"^{path} row 2: invalid UTF-8 at byte offset 2"):
        read(path)
    assert read(path, allow_invalid_utf8=True)[2] == (f"{path}[2]", "ba\ufffdd")


def test_arrayrecord_records_are_documents(tmp_path):
    path = tmp_path / "d.array_record"
    write_arrayrecord(path, [b"first doc", b"", "zweites Dokument \u00fc\r\n".encode()])
    assert read(path) == [(f"{path}[0]", "first doc"), (f"{path}[1]", ""),
                          (f"{path}[2]", "zweites Dokument \u00fc\n")]


def test_arrayrecord_invalid_utf8_names_the_record(tmp_path):
    path = tmp_path / "d.arrayrecord"
    write_arrayrecord(path, [b"good", b"ba\x80d"])
    with pytest.raises(ValueError, match=rf"^{path} record 1: invalid UTF-8 at byte offset 2"):
        read(path)


# -- files that are not what their names say: one line naming the file --------------------------

def _parquet_bytes(tmp_path) -> bytes:
    write_parquet(tmp_path / "src.parquet", [f"row {i} " * 30 for i in range(40)],
                  row_group_size=10)
    return (tmp_path / "src.parquet").read_bytes()


def _arrayrecord_bytes(tmp_path) -> bytes:
    write_arrayrecord(tmp_path / "src.array_record", [b"a record"] * 3)
    return (tmp_path / "src.array_record").read_bytes()


def _damaged_page_header(tmp_path) -> bytes:
    data = bytearray(_parquet_bytes(tmp_path))
    offset = pq.ParquetFile(tmp_path / "src.parquet").metadata.row_group(2).column(0)
    start = offset.dictionary_page_offset or offset.data_page_offset
    data[start + 20:start + 30] = bytes(b ^ 0x55 for b in data[start + 20:start + 30])
    return bytes(data)


def _bad_crc_gzip(_) -> bytes:
    data = bytearray(gzip.compress(jsonl_bytes(TEXTS)))
    data[-8] ^= 0xFF  # the CRC-32 of the member's data
    return bytes(data)


def _bad_zstd(_) -> bytes:
    data = bytearray(zst(jsonl_bytes(["some text"] * 200)))
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


JSONL = jsonl_bytes(TEXTS)
BINARY = bytes(range(256)) * 64  # 16 KiB, 26 of each 256 bytes are control bytes
# (name, content from tmp_path, format, the error's message after the path, also from
# row_groups() for a Parquet file)
BAD_FILES = [
    ("x.txt", _parquet_bytes, "text",
     r" is a Parquet file, not text: give it a \.parquet name or the prefix parquet:$", True),
    ("x.jsonl", _parquet_bytes, "jsonl", r" is a Parquet file, not JSONL: give it a \.parquet",
     True),
    ("x.txt", _arrayrecord_bytes, "text",
     r" is an ArrayRecord file, not text: give it an \.array_record name or the prefix "
     r"arrayrecord:$", True),
    ("x.jsonl", lambda _: gzip.compress(JSONL), "jsonl",
     r" is gzip-compressed, not JSONL: if it holds text or JSONL, name it so \(\.txt\.gz, "
     r"\.jsonl\.gz\)", True),
    ("x.txt", lambda _: zst(JSONL), "text", r" is zstd-compressed, not text: .*\.jsonl\.zst", True),
    ("x.txt", lambda _: BINARY, "text",
     r" is binary data \(1664 of its first 16384 bytes are control bytes such as NUL\), not "
     r"text: check that it is the file you meant \(text in UTF-16 or UTF-32: convert", True),
    ("x.jsonl", lambda _: "a line\n".encode("utf-16"), "jsonl", r" is binary data \(7 of", True),
    ("x.txt", lambda _: "caf\u00e9 au lait\n".encode("latin-1") * 50, "text",
     r": invalid UTF-8 at byte offset 3 .*set data\.allow_invalid_utf8=true", False),
    ("x.jsonl.gz", lambda _: JSONL, "jsonl",
     r" is text, not gzip-compressed as its name says: remove the compression suffix", True),
    ("x.jsonl.gz", lambda _: zst(JSONL), "jsonl",
     r" is zstd-compressed, not gzip-compressed as its name says", True),
    ("x.jsonl.zst", lambda _: b"", "jsonl",
     r" is empty, not zstd-compressed as its name says: download it again$", True),
    ("x.jsonl.gz", lambda t: gzip.compress(_parquet_bytes(t)), "jsonl",
     r" decompressed \(gzip\) is a Parquet file, not JSONL: decompress it, then give it a "
     r"\.parquet name", True),
    ("x.txt.zst", lambda _: zst(BINARY), "text",
     r" decompressed \(zstd\) is binary data \(1664 of its first 16384 bytes", True),
    ("x.jsonl.gz", lambda _: gzip.compress(JSONL)[:-30], "jsonl",
     r" is truncated or damaged \(gzip: Compressed file ended before the end-of-stream marker "
     r"was reached\): download it again$", True),
    ("x.jsonl.gz", _bad_crc_gzip, "jsonl",
     r" is truncated or damaged \(gzip: CRC check failed .*\): download it again$", True),
    ("x.txt.zst", lambda _: zst(JSONL)[:-3], "text",
     r" is truncated or damaged \(zstd: the data ends inside a frame\): download it again$", True),
    ("x.jsonl.zst", _bad_zstd, "jsonl",
     r" is truncated or damaged \(zstd: zstd decompressor error: .*\): download it again$", True),
    ("x.parquet", lambda _: JSONL, "parquet",
     r" is text, not a Parquet file: give it a name for what it holds \(\.txt, \.jsonl, or "
     r"\.gz/\.zst when compressed\) or the prefix text: or jsonl:$", True),
    ("x.parquet", lambda _: gzip.compress(JSONL), "parquet",
     r" is gzip-compressed, not a Parquet file: if it holds text or JSONL, name it so", True),
    ("x.parquet", lambda _: b"", "parquet", r" is empty, not a Parquet file: download it", True),
    ("x.parquet", lambda _: BINARY, "parquet", r" is binary data \(.*\), not a Parquet file", True),
    ("x.parquet", lambda t: _parquet_bytes(t)[:3000], "parquet",
     r" is truncated or damaged \(parquet: Parquet magic bytes not found in footer\. .*\): "
     r"download it again$", True),
    ("x.parquet", _damaged_page_header, "parquet",
     r" is truncated or damaged \(parquet: .*\): download it again$", False),
    ("x.parquet.gz", _parquet_bytes, "parquet",
     r": a Parquet file is not compressed as a whole \(its pages are\): decompress it", True),
    ("x.array_record", lambda _: JSONL, "arrayrecord",
     r" is text, not an ArrayRecord file: give it a name for what it holds", True),
    ("x.array_record", lambda t: _parquet_bytes(t), "arrayrecord",
     r" is a Parquet file, not an ArrayRecord file: give it a \.parquet name", True),
    ("x.array_record", lambda t: _arrayrecord_bytes(t)[:-40], "arrayrecord",
     r" is truncated or damaged \(array_record: .*\): download it again$", False),
]


@pytest.mark.parametrize("name, content, fmt, message, at_parts", BAD_FILES,
                         ids=[f"{c[0]}-{c[3][:40]}" for c in BAD_FILES])
def test_a_bad_file_is_one_line_naming_it(tmp_path, name, content, fmt, message, at_parts):
    path = tmp_path / name
    path.write_bytes(content(tmp_path))
    with pytest.raises(ValueError, match=f"^{path}{message}") as err:
        read(path, fmt)
    assert "\n" not in str(err.value)
    if at_parts and fmt == "parquet":
        with pytest.raises(ValueError, match=f"^{path}{message}"):
            row_groups(str(path))


def test_text_with_a_few_bad_bytes_is_read_under_the_flag(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes("caf\u00e9\n".encode("latin-1"))
    assert read(path, allow_invalid_utf8=True) == [(str(path), "caf\ufffd\n")]


@pytest.mark.parametrize("column, message", [
    ("body", r" has no column 'body' \(its columns: 'text' \(string\), 'n' \(int64\)\): set "
             r"data\.text_column to the column that holds the text$"),
    ("n", r": column 'n' holds int64, not strings \(its string columns: 'text'\): set "
          r"data\.text_column"),
])
def test_a_parquet_file_without_the_text_column_names_its_columns(tmp_path, column, message):
    path = str(tmp_path / "d.parquet")
    write_parquet(path, ["a", "b"], n=[1, 2])
    for call in (lambda: row_groups(path, text_column=column),
                 lambda: read(path, text_column=column)):
        with pytest.raises(ValueError, match=f"^{path}{message}"):
            call()


def test_parts_of_a_file_must_be_its_own(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(JSONL)
    with pytest.raises(ValueError, match=r"d\.jsonl: a part of row groups 0\.\.1 is only for "
                                         r"Parquet files, and this one is read as jsonl$"):
        read(tmp_path / "d.jsonl", part=Part(0, 1, 10))
    path = str(tmp_path / "d.parquet")
    write_parquet(path, TEXTS, row_group_size=3)
    with pytest.raises(ValueError, match=rf"^{path} has 3 row groups: a part of row groups 2\.\.4 "
                                         r"is not of this file$"):
        read(path, part=Part(2, 4, 10))


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"unknown format 'csv' of a\.csv: expected one of text, "
                                         r"jsonl, parquet, arrayrecord$"):
        documents("a.csv", "csv")
    missing = tmp_path / "nope.jsonl.gz"
    with pytest.raises(FileNotFoundError, match=f"{missing} does not exist"):
        read(missing)
    with pytest.raises(FileNotFoundError, match=f"{missing}.parquet does not exist"):
        row_groups(f"{missing}.parquet")


def test_arrayrecord_from_another_protocol_is_refused():
    with pytest.raises(ValueError, match=r"^s3://b/d\.array_record: ArrayRecord files are read "
                                         r"from local paths and gs:// only: copy it locally or "
                                         r"convert it to Parquet or JSONL$"):
        read("s3://b/d.array_record")


# -- gs:// through the emulator -----------------------------------------------------------------

def test_documents_and_row_groups_on_gs_equal_the_local_ones(tmp_path, gcs_bucket):
    data = jsonl_bytes(TEXTS * 30)
    (tmp_path / "t.txt").write_bytes("\ufeffPlain text\r\n".encode() * 100)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "d.jsonl.zst").write_bytes(zst(data, frames=2))
    (tmp_path / "t.txt.zst").write_bytes(zst(b"compressed text\n" * 100))
    write_parquet(tmp_path / "d.parquet", [t or None for t in TEXTS * 30], row_group_size=50)
    write_arrayrecord(tmp_path / "d.array_record", [t.encode() for t in TEXTS])
    for name in ("t.txt", "d.jsonl.gz", "d.jsonl.zst", "t.txt.zst", "d.parquet",
                 "d.array_record"):
        local, url = str(tmp_path / name), f"{gcs_bucket}/corpus/{name}"
        files.write_bytes(url, (tmp_path / name).read_bytes())
        fmt = format_of(name)
        expected = [Document(d.name.replace(local, url), d.text) for d in documents(local, fmt)]
        assert len(expected) > 1 or fmt == "text"
        assert list(documents(url, fmt)) == expected
    url = f"{gcs_bucket}/corpus/d.parquet"
    assert row_groups(url) == row_groups(str(tmp_path / "d.parquet"))
    assert len(row_groups(url)) == 5
    assert read(url, part=Part(2, 3, 0))[0] == (f"{url}[100]", TEXTS[100 % 7])


def test_bad_files_on_gs_are_named_by_their_url(tmp_path, gcs_bucket):
    url = f"{gcs_bucket}/x.txt"
    files.write_bytes(url, _parquet_bytes(tmp_path))
    with pytest.raises(ValueError, match=rf"^{url} is a Parquet file, not text: "):
        read(url)
    with pytest.raises(FileNotFoundError, match=f"{gcs_bucket}/missing.jsonl does not exist"):
        read(f"{gcs_bucket}/missing.jsonl")


@pytest.mark.parametrize("round_", [1, 2])
def test_each_test_gets_an_empty_bucket_and_a_working_gcsfs(gcs_bucket, round_):
    assert files.glob(f"{gcs_bucket}/**") == {}
    files.write_bytes(f"{gcs_bucket}/a/b.txt", b"round %d" % round_)
    assert list(files.glob(f"{gcs_bucket}/**")) == [f"{gcs_bucket}/a/b.txt"]
    assert files.read_bytes(f"{gcs_bucket}/a/b.txt") == b"round %d" % round_


def test_a_subprocess_reaches_the_emulator_through_the_environment(tmp_path, gcs_bucket):
    files.write_bytes(f"{gcs_bucket}/t.txt", b"from the bucket")
    write_arrayrecord(tmp_path / "d.array_record", [b"record zero", b"record one"])
    files.write_bytes(f"{gcs_bucket}/d.array_record", (tmp_path / "d.array_record").read_bytes())
    script = ("import sys, fsspec\n"
              "from array_record.python.array_record_module import ArrayRecordReader\n"
              "print(fsspec.open(sys.argv[1] + '/t.txt').open().read().decode())\n"
              "print(ArrayRecordReader(sys.argv[1] + '/d.array_record').read([1])[0].decode())\n")
    out = subprocess.run([sys.executable, "-c", script, gcs_bucket], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.splitlines() == ["from the bucket", "record one"]

