"""The sentencepiece tokenizer: exact vocab, fixed ids, lossless round trip, vocab checks."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cem_jax.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    DataConfig,
    build_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

SMALL_VOCAB = 400  # conftest.SMALL_VOCAB: the vocab of the `small_tokenizer_path` fixture


@pytest.fixture(scope="module")
def tokenizer(small_tokenizer_path):
    return load_tokenizer(small_tokenizer_path, expected_vocab_size=SMALL_VOCAB)


def test_vocab_size_and_special_ids_are_fixed(tokenizer):
    assert tokenizer.vocab_size == SMALL_VOCAB
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (
        PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert [tokenizer.id_to_piece(i) for i in (0, 1, 2, 3, 4, 259)] == [
        "<pad>", "<unk>", "<s>", "</s>", "<0x00>", "<0xFF>"]


def test_merges_are_learned_from_the_text(tokenizer):
    assert len(tokenizer.encode("the king")) < len("the king") / 2
    assert "\n" in "".join(tokenizer.id_to_piece(i) for i in range(260, SMALL_VOCAB))


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_decode_inverts_encode_for_any_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert UNK_ID not in ids  # byte fallback: nothing is unknown
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", ["  leading spaces", "tab\there", "\n\nnewlines\n", "▁", "a▁ b",
                                  "naïve café 東京 🎭", "\x00\x01", "</s> <pad> <0x41>"])
def test_round_trip_of_tricky_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_batch([text, "x"]) == [tokenizer.encode(text), tokenizer.encode("x")]


def test_special_ids_decode_to_nothing(tokenizer):
    """pad, unk, bos and eos, as a model may sample them: no " ⁇ " for unk (sentencepiece's)."""
    king, queen = tokenizer.encode("the king"), tokenizer.encode(" queen")
    for special in (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        assert tokenizer.decode([special]) == ""
        assert tokenizer.decode([*king, special, *queen]) == "the king queen"
    assert tokenizer.decode([UNK_ID, UNK_ID, *king]) == "the king"


def test_training_is_deterministic(small_corpus, tmp_path):
    texts = [p.read_text() for p in sorted(small_corpus["train"].glob("*.txt"))]
    first = train_tokenizer(texts, 350, tmp_path / "a.model")
    second = train_tokenizer(texts, 350)
    assert first.vocab_size == 350 and first.model_proto == second.model_proto
    assert (tmp_path / "a.model").read_bytes() == first.model_proto


def test_a_vocabulary_the_text_cannot_fill_gets_sizes_that_work():
    """sentencepiece's limits as settings that work: the most pieces a small text yields (which
    the vocab_size floor admits: it once was 320, above what such a text yields), and the least
    that its characters need (it once said to lower the size)."""
    with pytest.raises(ValueError) as raised:
        train_tokenizer(["ab ab"], 320)
    most = int(re.search(r"set data.vocab_size and model.vocab_size to at most (\d+) \(the "
                         r"least is 261\), or give a trained tokenizer", str(raised.value))[1])
    assert 261 <= most < 320 and train_tokenizer(["ab ab"], most).vocab_size == most
    wide = "".join(chr(0x4E00 + i) for i in range(400)) * 3  # 400 distinct characters
    with pytest.raises(ValueError, match="more distinct characters than that many pieces hold; "
                       "raise data.vocab_size and model.vocab_size to at least 660"):
        train_tokenizer([wide], 320)
    assert train_tokenizer([wide], 660).vocab_size == 660


def test_an_error_reading_the_text_is_raised_as_itself():
    """Not wrapped in sentencepiece's error, nor blamed on the vocabulary size."""
    def texts():
        yield "some text " * 100
        raise ValueError("corpus.jsonl:2: expected a JSON object with a string \"text\" field")

    with pytest.raises(ValueError, match=r"^corpus.jsonl:2: expected a JSON object"):
        train_tokenizer(texts(), 300)


def test_vocab_disagreeing_with_the_config_is_rejected(small_tokenizer_path):
    with pytest.raises(ValueError, match=f"has vocab_size {SMALL_VOCAB}, but the config expects "
                                         "vocab_size 2048"):
        load_tokenizer(small_tokenizer_path, expected_vocab_size=2048)
    with pytest.raises(ValueError, match=f"has vocab_size {SMALL_VOCAB}, but the config"):
        build_tokenizer(DataConfig(tokenizer=str(small_tokenizer_path), vocab_size=2048))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "absent.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a sentencepiece model"):
        load_tokenizer(tmp_path / "junk.model")


def test_build_tokenizer_trains_on_the_training_split_once(small_cfg, monkeypatch):
    cfg = small_cfg(tokenizer=None, vocab_size=320)
    first = build_tokenizer(cfg)
    assert first.vocab_size == 320

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer must be reused")

    monkeypatch.setattr("cem_jax.data.pipeline.train_tokenizer", no_training)
    assert build_tokenizer(cfg).sha256 == first.sha256


def test_save_writes_a_loadable_model(tokenizer, tmp_path):
    path = tokenizer.save(tmp_path / "run" / "tokenizer.model")
    assert load_tokenizer(path).sha256 == tokenizer.sha256
