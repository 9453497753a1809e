"""Tokenized datasets (`cem_jax.data.tokenize`, `cem_jax.data.shards`): the stream a dataset holds
is the documents packed as the pipeline defines it, whatever the workers or parts; held-out
documents are chosen alike everywhere; an interrupted tokenization resumes without redoing a
finished unit; a damaged shard is named; `cem-data verify` checks every checksum."""

from __future__ import annotations

import dataclasses
import gzip
import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cem_jax.cli.data import main as data_main
from cem_jax.data import (
    DataConfig,
    build_tokenizer,
    files,
    load_tokenizer,
    load_tokens,
    make_train_iterator,
    shards,
    sources,
    tokenize,
)
from cem_jax.data.formats.parquet import row_groups
from cem_jax.data.shards import DatasetError, TokenStream
from cem_jax.data.tokenize import tokenize_dataset

WORDS = "the king queen lord lady sword crown night day love death honour fool wit".split()


def make_documents(count: int, seed: int) -> list[str]:
    """`count` documents of 200 to 600 words."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(200, 600))) + "\n" for _ in range(count)]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """Six text files of 1 to 4 kB, each a unit (units of at least 1 byte)."""
    monkeypatch.setattr(sources, "UNIT_BYTES", 1)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, doc in enumerate(make_documents(6, 3)):
        (folder / f"d{i}.txt").write_text(doc)
    return folder


def expected_stream(source, tokenizer) -> list[int]:
    """EOS d1 EOS d2 ... EOS dn EOS, tokenized document by document."""
    stream = []
    for doc in source.documents():
        stream += [tokenizer.eos_id, *tokenizer.encode(doc.text)]
    return [*stream, tokenizer.eos_id]


def test_a_dataset_holds_the_packed_documents_whatever_the_workers(corpus, tmp_path,
                                                                   small_tokenizer_path):
    tokenizer = load_tokenizer(small_tokenizer_path)
    source = sources.user_source(str(corpus / "*.txt"))
    assert [(u.first, u.last) for u in source.units()] == [(i, i) for i in range(6)]
    one = tokenize_dataset(source, tokenizer, str(tmp_path / "one"), workers=1)
    two = tokenize_dataset(source, tokenizer, str(tmp_path / "two"), workers=2)
    stream = TokenStream(one, "documents", tokenizer.vocab_size)
    want = expected_stream(source, tokenizer)
    assert len(stream) == len(want) and list(stream.read(0, len(want))) == want
    assert list(stream.read(5, len(want) - 5)) == want[5:-5]  # across shard boundaries
    with pytest.raises(IndexError):
        stream.read(0, len(want) + 1)
    assert one.splits == two.splits and one.identity == two.identity
    for unit in range(6):
        name = shards.shard_name("documents", unit)
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    sizes = list(stream.document_sizes())
    assert len(sizes) == 6 and sum(t for t, _ in sizes) == len(want) - 1
    assert sum(b for _, b in sizes) == sum(len(d.text.encode()) for d in source.documents())


def test_held_out_documents_are_the_same_in_every_run_and_part(corpus, tmp_path,
                                                               small_tokenizer_path):
    tokenizer = load_tokenizer(small_tokenizer_path)
    source = sources.user_source(str(corpus / "*.txt"))
    whole = tokenize_dataset(source, tokenizer, str(tmp_path / "whole"), held_out_fraction=0.3)
    shown = []
    first = tokenize_dataset(source, tokenizer, str(tmp_path / "parts"), held_out_fraction=0.3,
                             part=(0, 2), progress=lambda *p: shown.append(p))
    assert first is None  # units 1, 3 and 5 are the other part's
    assert sorted(os.listdir(tmp_path / "parts" / "units")) == [
        "00000.json", "00002.json", "00004.json"]
    sizes = [u.size for u in source.units()]
    part = sum(sizes[0::2])  # the progress shown is of this part's units: it ends at its total
    assert len(shown) == 4 and shown[0] == (0, part) and shown[-1] == (part, part)
    shown.clear()
    joined = tokenize_dataset(source, tokenizer, str(tmp_path / "parts"), held_out_fraction=0.3,
                              part=(1, 2), progress=lambda *p: shown.append(p))
    assert shown[0] == (0, sum(sizes[1::2])) and shown[-1] == (sum(sizes[1::2]),) * 2
    assert joined.splits == whole.splits
    held = [s.documents for s in whole.splits["held_out"]]
    kept = [s.documents for s in whole.splits["documents"]]
    assert sum(held) + sum(kept) == 6 and 0 < sum(held) < 6


def test_an_interrupted_tokenization_resumes_at_its_first_unfinished_unit(
        corpus, tmp_path, small_tokenizer_path, monkeypatch):
    """Interrupted (Ctrl-C) in the middle of unit 1 (its first document written): unit 0 is
    kept, nothing of unit 1 is left, and the next call tokenizes units 1 to 5 only."""
    tokenizer = load_tokenizer(small_tokenizer_path)
    (corpus / "d1.txt").unlink()
    (corpus / "d1.jsonl").write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(3)))
    monkeypatch.setattr(tokenize, "ENCODE_BATCH_CHARS", 1)  # each document written at once
    source = sources.user_source(str(corpus / "d*"))
    root = tmp_path / "ds"
    read = sources.Source.documents
    calls = []

    def interrupted(self, unit=None):
        calls.append(unit.index)
        for i, doc in enumerate(read(self, unit)):
            if unit.index == 1 and i == 1 and len(calls) == 2:
                raise KeyboardInterrupt
            yield doc

    monkeypatch.setattr(sources.Source, "documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenize_dataset(source, tokenizer, str(root), workers=1)
    assert sorted(os.listdir(root / "units")) == ["00000.json"]
    assert sorted(os.listdir(root / "documents")) == ["00000.bin", "00000.docs"]
    kept = (root / "units" / "00000.json").stat().st_mtime_ns
    manifest = tokenize_dataset(source, tokenizer, str(root), workers=1)
    assert calls == [0, 1, 1, 2, 3, 4, 5] and manifest is not None
    assert (root / "units" / "00000.json").stat().st_mtime_ns == kept
    stream = TokenStream(manifest, "documents", tokenizer.vocab_size)
    monkeypatch.undo()
    assert list(stream.read(0, len(stream))) == expected_stream(source, tokenizer)


def test_a_damaged_shard_is_named(corpus, tmp_path, small_tokenizer_path, capsys):
    tokenizer = load_tokenizer(small_tokenizer_path)
    source = sources.user_source(str(corpus / "*.txt"))
    root = tmp_path / "ds"
    manifest = tokenize_dataset(source, tokenizer, str(root), workers=1)
    assert data_main(["verify", str(root)]) == 0
    shard = root / shards.shard_name("documents", 1)
    data = bytearray(shard.read_bytes())
    data[10:12] = b"\xff\xff"  # id 65535, past the vocabulary
    shard.write_bytes(bytes(data))
    stream = TokenStream(manifest, "documents", tokenizer.vocab_size)
    with pytest.raises(DatasetError, match=f"shard {shard} is damaged: it holds token id 65535"):
        stream.read(0, len(stream))
    assert data_main(["verify", str(root)]) == 2
    assert f"damaged: {shard}: SHA-256 differs" in capsys.readouterr().err
    shard.write_bytes(bytes(data[:-6]))  # truncated
    with pytest.raises(DatasetError, match=f"shard {shard} is damaged: {len(data) - 6:,} bytes"):
        TokenStream(manifest, "documents", tokenizer.vocab_size).read(0, len(stream))
    other = sources.user_source(str(corpus / "d1.txt"))
    with pytest.raises(DatasetError, match=f"{root} holds another tokenized dataset"):
        tokenize_dataset(other, tokenizer, str(root))


def test_units_gather_files_up_to_a_size_and_cut_a_large_parquet_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "UNIT_BYTES", 10)
    source = sources.Source("x", "text", tuple("abcdefg"), (5, 4, 1, 20, 3, 3, 2),
                            ("",) * 7)
    assert [(u.first, u.last, u.size) for u in source.units()] == [
        (0, 2, 10), (3, 3, 20), (4, 6, 8)]
    source = sources.Source("x", "text", tuple("abc"), (5, 20, 3), ("",) * 3)
    assert [(u.first, u.last, u.size) for u in source.units()] == [  # the large file is alone
        (0, 0, 5), (1, 1, 20), (2, 2, 3)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": ["x" * 40] * 10}), path, row_group_size=2)
    group = row_groups(str(path))[0].size  # each of the 5 row groups alike
    assert 0 < 2 * group < path.stat().st_size
    monkeypatch.setattr(sources, "UNIT_BYTES", 2 * group)
    source = sources.user_source(str(path))
    units = source.units()
    assert [(u.part.start, u.part.stop) for u in units] == [(0, 2), (2, 4), (4, 5)]
    assert [d.name for d in source.documents(units[2])] == [f"{path}[8]", f"{path}[9]"]
    (tmp_path / "a.txt").write_text("small")
    source = sources.user_source(str(tmp_path / "*"))  # a.txt, then big.parquet
    assert [(u.first, u.part and (u.part.start, u.part.stop)) for u in source.units()] == [
        (0, None), (1, (0, 2)), (1, (2, 4)), (1, (4, 5))]


def test_a_stream_limited_to_whole_documents_ends_with_eos(corpus, tmp_path,
                                                          small_tokenizer_path):
    tokenizer = load_tokenizer(small_tokenizer_path)
    source = sources.user_source(str(corpus / "*.txt"))
    manifest = tokenize_dataset(source, tokenizer, str(tmp_path / "ds"), workers=1)
    sizes = list(TokenStream(manifest, "documents", 400).document_sizes())
    limit = sizes[0][0] + sizes[1][0]
    stream = TokenStream(manifest, "documents", 400, limit=limit)
    want = expected_stream(source, tokenizer)[:limit] + [tokenizer.eos_id]
    assert list(stream.read(0, len(stream))) == want
    assert np.count_nonzero(stream.read(0, len(stream)) == tokenizer.eos_id) == 3


def test_a_corpus_and_a_cache_on_gs_give_the_local_batches(tmp_path, gcs_bucket,
                                                          small_tokenizer_path, monkeypatch):
    """A .jsonl.gz corpus and the tokenizer read from gs://, tokenized into a cache on gs://:
    the same batches as the same files on the local disk."""
    lines = "".join(f'{{"text": "{doc.strip()}"}}\n' for doc in make_documents(8, 5))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    files.write_bytes(f"{gcs_bucket}/corpus/c.jsonl.gz", (tmp_path / "c.jsonl.gz").read_bytes())
    files.write_bytes(f"{gcs_bucket}/tok/tokenizer.model", small_tokenizer_path.read_bytes())
    common = dict(seq_len=16, batch_size=4, val_fraction=0.25)
    remote = DataConfig(corpus=f"{gcs_bucket}/corpus/*.jsonl.gz", cache_dir=f"{gcs_bucket}/cache",
                        tokenizer=f"{gcs_bucket}/tok/tokenizer.model", **common)
    local = DataConfig(corpus=str(tmp_path / "c.jsonl.gz"), cache_dir=str(tmp_path / "cache"),
                       tokenizer=str(small_tokenizer_path), **common)
    tokenizer = load_tokenizer(remote.tokenizer)
    assert tokenizer.sha256 == load_tokenizer(local.tokenizer).sha256

    def first_batches(cfg):
        batches = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
        return [next(batches)["inputs"] for _ in range(3)]

    for got, want in zip(first_batches(remote), first_batches(local), strict=True):
        np.testing.assert_array_equal(got, want)
    assert len(files.glob(f"{gcs_bucket}/cache/tokens/*/manifest.json")) == 1
    monkeypatch.chdir(tmp_path)  # a tokenizer trained for a cache on gs:// goes there, not to ./gs:
    trained = build_tokenizer(dataclasses.replace(remote, tokenizer=None, vocab_size=290))
    [cached] = files.glob(f"{gcs_bucket}/cache/tokenizers/*.model")
    assert load_tokenizer(cached).sha256 == trained.sha256 and not (tmp_path / "gs:").exists()


@pytest.mark.parametrize("documents, fraction, said", [
    (1, 0.49, "data.val_fraction = 0.49 held out every one of the 1 documents"),
    (2, 0.0001, "data.val_fraction = 0.0001 held out none of the 2 documents")])
def test_a_fraction_that_holds_out_all_or_nothing_is_said(tmp_path, small_tokenizer_path,
                                                          documents, fraction, said):
    """The hash of (unit 0, document i) holds out document 0 at 0.49, and neither of 2 at
    0.0001: the split that is then empty is one line saying which setting to change."""
    (tmp_path / "c.jsonl").write_text("".join(f'{{"text": "document {i}"}}\n'
                                              for i in range(documents)))
    cfg = DataConfig(corpus=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "cache"),
                     tokenizer=str(small_tokenizer_path), val_fraction=fraction)
    tokenizer = load_tokenizer(cfg.tokenizer)
    with pytest.raises(DatasetError, match=said):
        load_tokens(cfg, tokenizer, "train" if documents == 1 else "validation")


def test_sigterm_stops_cem_data_tokenize_as_ctrl_c_does(corpus, tmp_path, small_tokenizer_path,
                                                       monkeypatch, capsys):
    """One worker (the whole work in this process): a SIGTERM in the middle of unit 1 stops the
    command at the next document (status 128 + 15), unit 0 kept; a rerun finishes it."""
    read = sources.Source.documents

    def signalled(self, unit=None):
        for i, doc in enumerate(read(self, unit)):
            if unit is not None and unit.index == 1 and i == 0 and not stopped:
                stopped.append(os.kill(os.getpid(), signal.SIGTERM))
            yield doc

    stopped: list = []
    monkeypatch.setattr(sources.Source, "documents", signalled)
    root = tmp_path / "ds"
    args = ["tokenize", "--workers", "1", "--out", str(root), f"data.corpus={corpus}/*.txt",
            f"data.tokenizer={small_tokenizer_path}"]
    assert data_main(args) == 128 + signal.SIGTERM
    assert "interrupted; finished units are kept" in capsys.readouterr().err
    assert sorted(os.listdir(root / "units")) == ["00000.json"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    with pytest.raises(FileNotFoundError, match="is a tokenized dataset whose tokenization has "
                       "not finished"):
        sources.user_source(str(root))
    assert data_main(args) == 0 and (root / "manifest.json").is_file()
