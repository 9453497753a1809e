"""Corpus specs as sources (`cem_jax.data.sources`, `pipeline.source_of`): files and globs, format
prefixes, a fingerprint that follows the files, and what bad specs get. (How each format is read:
tests/data/test_formats.py.)"""

import os

import pytest

from cem_jax.data import DataConfig, source_of
from cem_jax.data.sources import user_source


def docs(spec: str, **cfg) -> list[tuple[str, str]]:
    source = source_of(DataConfig(corpus=spec, **cfg), "train")
    return [(d.name, d.text) for d in source.documents()]


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


def test_each_file_is_read_as_its_name_says(tmp_path):
    (tmp_path / "a.txt").write_text("plain")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    source = user_source(str(tmp_path / "*"))
    assert source.kind == "auto" and source.description.startswith("corpus ")
    assert [d.text for d in source.documents()] == ["plain", "one", "two"]
    assert user_source(str(tmp_path / "*.jsonl")).description.startswith("jsonl corpus ")


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


def test_an_unknown_format_prefix_names_the_formats(tmp_path):
    with pytest.raises(ValueError, match=r"corpus 'csv:data/x' names the unknown format 'csv': "
                                         r"the formats are text, jsonl, parquet, arrayrecord"):
        docs("csv:data/x")
    (tmp_path / "a.parquet.txt").write_text("text named oddly")
    assert docs(f"text:{tmp_path / 'a.parquet.txt'}")[0][1] == "text named oddly"


def test_fingerprint_follows_the_files(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    before = user_source(str(path)).fingerprint()
    assert user_source(str(path)).fingerprint() == before
    path.write_text("one, changed")
    os.utime(path, ns=(1, 1))
    assert user_source(str(path)).fingerprint() != before
    assert user_source(str(path), text_column="body").fingerprint() != \
        user_source(str(path)).fingerprint()


def test_user_corpus_without_validation_says_how_to_give_it_one(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="has no validation split: set data.val_corpus .* or "
                                         "data.val_fraction"):
        source_of(DataConfig(corpus=str(tmp_path / "a.txt")), "validation")


def test_unknown_split(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'test'"):
        source_of(DataConfig(), "test")
