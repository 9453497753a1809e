"""The sentencepiece tokenizer: exact vocab, fixed ids, lossless round trip, the check against
the model's vocabulary, files of neither kind."""

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
    return load_tokenizer(small_tokenizer_path)


def test_vocab_size_and_special_ids_are_fixed(tokenizer):
    assert (tokenizer.kind, tokenizer.file_name) == ("sentencepiece", "tokenizer.model")
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
    want = [tokenizer.encode(text), tokenizer.encode("x")]
    assert tokenizer.encode_batch([text, "x"]) == tokenizer.encode_batch([text, "x"], 1) == want


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
    assert first.vocab_size == 350 and first.data == second.data
    assert (tmp_path / "a.model").read_bytes() == first.data


def test_a_vocabulary_the_text_cannot_fill_gets_sizes_that_work():
    """sentencepiece's limits as settings that work: the most pieces a small text yields (which
    the vocab_size floor admits: it once was 320, above what such a text yields), and the least
    that its characters need (it once said to lower the size)."""
    with pytest.raises(ValueError) as raised:
        train_tokenizer(["ab ab"], 320)
    most = int(re.search(r"set data.vocab_size to at most (\d+) \(the least is 261; "
                         r"model.vocab_size may stay larger\), or give a trained tokenizer",
                         str(raised.value))[1])
    assert 261 <= most < 320 and train_tokenizer(["ab ab"], most).vocab_size == most
    wide = "".join(chr(0x4E00 + i) for i in range(400)) * 3  # 400 distinct characters
    with pytest.raises(ValueError, match=r"more distinct characters than that many pieces hold; "
                       r"raise data.vocab_size to at least 660 \(and model.vocab_size, which "
                       r"must hold it\)"):
        train_tokenizer([wide], 320)
    assert train_tokenizer([wide], 660).vocab_size == 660


def test_an_error_reading_the_text_is_raised_as_itself():
    """Not wrapped in sentencepiece's error, nor blamed on the vocabulary size."""
    def texts():
        yield "some text " * 100
        raise ValueError("corpus.jsonl:2: expected a JSON object with a string \"text\" field")

    with pytest.raises(ValueError, match=r"^corpus.jsonl:2: expected a JSON object"):
        train_tokenizer(texts(), 300)


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(small_tokenizer_path):
    """The model may be padded past the tokenizer (448 for 400 pieces), not be smaller."""
    assert load_tokenizer(small_tokenizer_path, model_vocab_size=448).vocab_size == SMALL_VOCAB
    assert load_tokenizer(small_tokenizer_path, model_vocab_size=400).vocab_size == SMALL_VOCAB
    with pytest.raises(ValueError) as raised:
        load_tokenizer(small_tokenizer_path, model_vocab_size=300)
    assert str(raised.value) == (
        f"tokenizer {small_tokenizer_path} has 400 ids, more than the model's vocabulary "
        f"(model.vocab_size = 300): set model.vocab_size to at least 400 (e.g. 512, a multiple "
        f"of 128), or use a tokenizer of at most 300 ids")
    with pytest.raises(ValueError, match="has 400 ids, more than the model's vocabulary"):
        build_tokenizer(DataConfig(tokenizer=str(small_tokenizer_path)), model_vocab_size=399)
    # data.vocab_size sizes a tokenizer to train: beside a given one it is not used
    loaded = build_tokenizer(DataConfig(tokenizer=str(small_tokenizer_path), vocab_size=2048))
    assert loaded.vocab_size == SMALL_VOCAB


def test_a_tokenizer_to_train_needs_a_size(small_cfg):
    with pytest.raises(ValueError, match="data.vocab_size is null and data.tokenizer is null"):
        build_tokenizer(small_cfg(tokenizer=None, vocab_size=None))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "absent.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"junk.model is neither a sentencepiece model nor a "
                                         r"Hugging Face tokenizer.json \(sentencepiece: "):
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
    assert sorted(p.name for p in path.parent.iterdir()) == ["tokenizer.model"]
    assert load_tokenizer(path).sha256 == tokenizer.sha256
