"""Token files: tokenized once, reused, rebuilt when the corpus or tokenizer changes, and never
used when truncated or corrupted."""

import os
import stat

import numpy as np
import pytest

from cem_jax.data import load_tokenizer, load_tokens, pipeline, train_tokenizer
from cem_jax.data.cache import HEADER_BYTES, CacheError, read_tokens
from cem_jax.export.output import staged_dir
from cem_jax.fileio import atomic_file


def expected_stream(tokenizer, texts):
    stream = [tokenizer.eos_id]
    for text in texts:
        stream += tokenizer.encode(text) + [tokenizer.eos_id]
    return np.array(stream)


def test_stream_is_documents_separated_by_eos(small_cfg, small_corpus):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    data = load_tokens(cfg, tokenizer, "train")
    texts = [p.read_text() for p in sorted(small_corpus["train"].glob("*.txt"))]
    np.testing.assert_array_equal(data.tokens, expected_stream(tokenizer, texts))
    assert data.tokens.dtype == np.uint16
    assert data.stats.documents == 12 and data.stats.tokens == len(data.tokens) - 1
    assert data.stats.bytes == sum(len(t.encode()) for t in texts)


def test_second_load_reads_the_cache(small_cfg, monkeypatch):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    first = load_tokens(cfg, tokenizer, "train")
    monkeypatch.setattr(type(tokenizer), "encode_batch",
                        lambda *a: pytest.fail("a cached split must not be tokenized again"))
    second = load_tokens(cfg, tokenizer, "train")
    assert second.path == first.path
    np.testing.assert_array_equal(second.tokens, first.tokens)


def test_a_token_file_is_read_and_verified_once_per_process(small_cfg, monkeypatch):
    """Training evaluates every `run.eval_every` steps: the split's file is hashed once."""
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    first = load_tokens(cfg, tokenizer, "validation")
    reads = []
    monkeypatch.setattr(pipeline, "read_tokens", lambda *a: reads.append(a) or read_tokens(*a))
    assert load_tokens(cfg, tokenizer, "validation") is first and reads == []
    os.utime(first.path, ns=(0, 0))  # a file changed on disk is read and verified again
    again = load_tokens(cfg, tokenizer, "validation")
    assert len(reads) == 1 and again is not first
    np.testing.assert_array_equal(again.tokens, first.tokens)


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "empty"])
def test_damaged_cache_is_detected_and_rebuilt(small_cfg, damage):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    good = load_tokens(cfg, tokenizer, "train")
    reference = np.array(good.tokens)
    size = good.path.stat().st_size
    with open(good.path, "r+b") as f:
        if damage == "truncate":  # as a crash in the middle of a non-atomic write would leave it
            f.truncate(size - 7)
        elif damage == "flip_byte":
            f.seek(HEADER_BYTES + 10)
            f.write(bytes([f.read(1)[0] ^ 0xFF]))
        else:
            f.truncate(0)
    with pytest.raises(CacheError):
        read_tokens(good.path, key="any")
    pipeline._LOADED.clear()  # a file verified in this process is trusted: this is a new one
    with pytest.warns(UserWarning, match="token cache unusable, rebuilding it"):
        rebuilt = load_tokens(cfg, tokenizer, "train")
    np.testing.assert_array_equal(rebuilt.tokens, reference)
    assert rebuilt.path.stat().st_size == size


def test_changed_corpus_file_rebuilds(small_cfg, tmp_path):
    doc = tmp_path / "corpus.txt"
    doc.write_text("the king is dead. long live the king.\n" * 20)
    cfg = small_cfg(corpus=str(doc))
    tokenizer = load_tokenizer(cfg.tokenizer)
    before = load_tokens(cfg, tokenizer, "train")
    doc.write_text("the queen speaks.\n" * 20)
    os.utime(doc, ns=(10**18, 10**18))
    after = load_tokens(cfg, tokenizer, "train")
    assert after.path != before.path
    assert tokenizer.decode(after.tokens) == "the queen speaks.\n" * 20


def test_another_tokenizer_gets_its_own_cache(small_cfg, small_corpus, tmp_path):
    cfg = small_cfg()
    texts = [p.read_text() for p in sorted(small_corpus["train"].glob("*.txt"))]
    other = train_tokenizer(texts, 450, tmp_path / "other.model")
    first = load_tokens(cfg, load_tokenizer(cfg.tokenizer), "train")
    second = load_tokens(small_cfg(tokenizer=str(tmp_path / "other.model"), vocab_size=450),
                         other, "train")
    assert first.path != second.path and len(second.tokens) < len(first.tokens)
    np.testing.assert_array_equal(second.tokens, expected_stream(other, texts))


def test_no_temporary_files_are_left(small_cfg):
    cfg = small_cfg()
    data = load_tokens(cfg, load_tokenizer(cfg.tokenizer), "validation")
    assert sorted(p.name for p in data.path.parent.iterdir()) == [data.path.name]


def test_written_files_and_folders_get_the_umask_permissions(tmp_path):
    """Not tempfile's 0600/0700: run directories and exports are shared on clusters."""
    old = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "tokenizer.model") as f:
            f.write(b"x")
        with staged_dir(tmp_path / "export") as stage:
            (stage / "config.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "tokenizer.model").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o755
