"""Users' corpora: text files and globs, JSONL, ArrayRecord; and what bad input gets."""

import json
import os

import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from cem_jax.data import DataConfig, resolve_split


def docs(spec: str, **cfg) -> list[tuple[str, str]]:
    split = resolve_split(DataConfig(corpus=spec, **cfg), "train")
    return [(d.name, d.text) for d in split.documents()]


def test_glob_yields_each_file_as_a_document_in_sorted_order(tmp_path):
    for name, text in (("b.txt", "second"), ("a.txt", "first"), ("c.md", "skipped")):
        (tmp_path / name).write_text(text)
    assert docs(str(tmp_path / "*.txt")) == [(str(tmp_path / "a.txt"), "first"),
                                             (str(tmp_path / "b.txt"), "second")]


def test_recursive_glob_and_text_prefix(tmp_path):
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "deep.jsonl").write_text("not json, read as text")
    assert docs("text:" + str(tmp_path / "**" / "*.jsonl")) == [
        (str(tmp_path / "x" / "y" / "deep.jsonl"), "not json, read as text")]


def test_an_existing_file_is_itself_whatever_its_path_holds(tmp_path):
    folder = tmp_path / "corpus[v2]"  # a glob would read [v2] as one of 'v' or '2'
    folder.mkdir()
    (folder / "a.txt").write_text("one")
    assert docs(str(folder / "a.txt")) == [(str(folder / "a.txt"), "one")]


def test_a_tilde_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "a.txt").write_text("home text")
    assert docs("~/a.txt")[0][1] == "home text"
    assert DataConfig(tokenizer="~/t.model").tokenizer == str(tmp_path / "t.model")


def test_bom_and_crlf_are_normalized(tmp_path):
    (tmp_path / "w.txt").write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    assert docs(str(tmp_path / "w.txt"))[0][1] == "line one\nline two\n"


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=f"corpus file '{missing}' does not exist"):
        docs(str(missing))


def test_glob_matching_nothing_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matched no files"):
        docs(str(tmp_path / "*.txt"))


def test_directory_asks_for_a_glob(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is a directory: give a file or a glob"):
        docs(str(tmp_path))


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(ValueError, match=r"'.*\*\.txt' \(2 files\) is empty"):
        docs(str(tmp_path / "*.txt"))


def test_empty_documents_are_skipped(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("text")
    assert [t for _, t in docs(str(tmp_path / "*.txt"))] == ["text"]


def test_invalid_utf8_names_file_and_byte_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes("héllo ".encode() + b"\xff world")  # é is 2 bytes: \xff is at offset 7
    with pytest.raises(ValueError, match=rf"{path}: invalid UTF-8 at byte offset 7 .*"
                                         r"allow_invalid_utf8"):
        docs(str(path))


def test_invalid_utf8_is_replaced_under_the_flag(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ab\xffcd")
    assert docs(str(tmp_path / "bad.txt"), allow_invalid_utf8=True)[0][1] == "ab\ufffdcd"


def test_jsonl_reads_the_text_field_of_each_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": "one", "id": 1}), "", json.dumps({"text": "two\r\nlines"})]
    path.write_text("\n".join(lines) + "\n")
    assert docs(str(path)) == [(f"{path}:1", "one"), (f"{path}:3", "two\nlines")]


@pytest.mark.parametrize("line, message", [
    ('{"txt": "x"}', r':2: expected a JSON object with a string "text" field'),
    ('{"text": 5}', r':2: expected a JSON object with a string "text" field'),
    ("[1, 2", r":2: not valid JSON"),
    ('{"text": "\\ud800"}', r":2: the text holds a lone surrogate at character 0"),
])
def test_jsonl_bad_lines_are_located(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}{message}"):
        docs(str(path))


def test_jsonl_invalid_utf8_offset_counts_from_file_start(tmp_path):
    path = tmp_path / "d.jsonl"
    first = b'{"text": "ok"}\n'
    path.write_bytes(first + b'{"text": "b\xc3("}\n')  # \xc3 starts a 2-byte char: ( is not one
    offset = len(first) + len(b'{"text": "b')
    with pytest.raises(ValueError, match=rf"{path}:2: invalid UTF-8 at byte offset {offset} "):
        docs(str(path))


def test_arrayrecord_records_are_documents(tmp_path):
    path = tmp_path / "d.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in (b"first doc", b"", "zweites Dokument ü".encode()):
        writer.write(record)
    writer.close()
    assert docs(str(path)) == [(f"{path}[0]", "first doc"), (f"{path}[2]", "zweites Dokument ü")]


def test_arrayrecord_invalid_utf8_names_record(tmp_path):
    path = tmp_path / "d.arrayrecord"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    writer.write(b"good")
    writer.write(b"ba\x80d")
    writer.close()
    with pytest.raises(ValueError, match=rf"{path} record 1: invalid UTF-8 at byte offset 2"):
        docs(str(path))


def test_a_text_file_given_as_arrayrecord_is_named(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("plain text, not ArrayRecord\n")
    with pytest.raises(ValueError, match=rf"{path} is not an ArrayRecord file \(.*\): name a "
                                         r"text or JSONL file as text:PATH"):
        docs(f"arrayrecord:{path}")


def test_fingerprint_follows_the_files(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    split = resolve_split(DataConfig(corpus=str(path)), "train")
    before = split.fingerprint()
    assert split.fingerprint() == before
    path.write_text("one, changed")
    os.utime(path, ns=(1, 1))
    assert split.fingerprint() != before


def test_user_corpus_without_val_corpus_has_no_validation_split(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="has no validation split: set data.val_corpus"):
        resolve_split(DataConfig(corpus=str(tmp_path / "a.txt")), "validation")


def test_unknown_split(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'test'"):
        resolve_split(DataConfig(), "test")
