"""A Hugging Face tokenizer.json (byte-level BPE of GPT-2's kind, trained offline here): found
by content, its special tokens by name or from a tokenizer_config.json beside it, literal
special-token text kept as text, lossless round trip, saved and reloaded as itself."""

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, processors, trainers

from cem_jax.data import HuggingFaceTokenizer, build_tokenizer, load_tokenizer, load_tokens

SPECIAL_TEXT = ["<|endoftext|>", "<|pad|>", "</s>", "<s>", "<|endoftext", "|>"]


@pytest.fixture(scope="module")
def tokenizer(small_hf_tokenizer_path):
    return load_tokenizer(small_hf_tokenizer_path)


def _copy(path, directory, config: dict | None = None):
    """`path` copied into a new `directory` as tokenizer.json, with `config` as the
    tokenizer_config.json beside it (none when None)."""
    directory.mkdir()
    shutil.copy(path, directory / "tokenizer.json")
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def test_its_kind_and_special_tokens_found_by_name(tokenizer, small_hf_tokenizer_path, tmp_path):
    assert (tokenizer.kind, tokenizer.file_name, tokenizer.vocab_size) == (
        "huggingface", "tokenizer.json", 400)
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id, tokenizer.unk_id) == (
        0, 1, None, None)
    assert [tokenizer.id_to_piece(i) for i in (0, 1)] == ["<|endoftext|>", "<|pad|>"]
    shutil.copy(small_hf_tokenizer_path, tmp_path / "any.model")  # the content decides
    assert load_tokenizer(tmp_path / "any.model").sha256 == tokenizer.sha256


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(), st.sampled_from(SPECIAL_TEXT))).map("".join))
def test_decode_inverts_encode_for_any_text_special_token_text_included(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert {0, 1}.isdisjoint(ids)  # literal "<|endoftext|>" is text, not the EOS id


def test_literal_special_text_is_its_characters(tokenizer):
    text = "the king<|endoftext|>queen <|pad|>"
    ids = tokenizer.encode(text)
    assert ids[:len(tokenizer.encode("the king"))] == tokenizer.encode("the king")
    assert len(ids) > len(tokenizer.encode("the kingqueen ")) + 4  # the markup's own pieces
    assert tokenizer.encode_batch([text, "x"]) == [ids, tokenizer.encode("x")]


def test_special_ids_decode_to_nothing(tokenizer):
    king, queen = tokenizer.encode("the king"), tokenizer.encode(" queen")
    for special in (0, 1):
        assert tokenizer.decode([*king, special, *queen]) == "the king queen"


def test_the_post_processor_adds_nothing(small_hf_tokenizer_path, tmp_path):
    """A tokenizer.json that adds a BOS (as Llama 3's does) encodes text alone: the pipeline
    places EOS itself."""
    backend = Backend.from_file(str(small_hf_tokenizer_path))
    plain = backend.encode("the king", add_special_tokens=False).ids
    backend.post_processor = processors.TemplateProcessing(
        single="<|pad|> $A", special_tokens=[("<|pad|>", 1)])
    assert backend.encode("the king").ids == [1, *plain]
    backend.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("the king") == plain


def test_a_tokenizer_config_beside_it_names_the_special_tokens(small_hf_tokenizer_path,
                                                               tokenizer, tmp_path):
    path = _copy(small_hf_tokenizer_path, tmp_path / "a", {
        "eos_token": {"content": "<|pad|>", "special": True, "__type": "AddedToken"},
        "bos_token": "<|endoftext|>", "pad_token": None, "chat_template": "ignored"})
    chosen = load_tokenizer(path)
    assert (chosen.eos_id, chosen.bos_id, chosen.pad_id) == (1, 0, 1)  # no pad: EOS
    assert chosen.sha256 != tokenizer.sha256  # another choice gives other token streams
    saved = chosen.save(tmp_path / "run" / "tokenizer.json")
    assert json.loads((tmp_path / "run" / "tokenizer_config.json").read_text()) == {
        "eos_token": "<|pad|>", "bos_token": "<|endoftext|>", "pad_token": None}
    reloaded = load_tokenizer(saved)
    assert (reloaded.sha256, reloaded.eos_id, reloaded.bos_id, reloaded.pad_id) == (
        chosen.sha256, 1, 0, 1)
    assert saved.read_bytes() == small_hf_tokenizer_path.read_bytes()  # as itself


def test_a_tokenizer_without_eos_says_how_to_name_it(small_hf_tokenizer_path, tmp_path):
    path = _copy(small_hf_tokenizer_path, tmp_path / "a", {"eos_token": None})
    with pytest.raises(ValueError) as raised:
        load_tokenizer(path)
    assert str(raised.value) == (
        f"{path} has no end-of-document token that cem_jax can find (none of its special "
        "tokens is <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|eos|>, and no "
        "tokenizer_config.json beside it names an eos_token): write {\"eos_token\": \"<its "
        "EOS token>\"} into a tokenizer_config.json beside it")
    path = _copy(small_hf_tokenizer_path, tmp_path / "b", {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match=r"the tokenizer_config.json beside .*b/tokenizer.json "
                       r"names eos_token '<\|im_end\|>', which the tokenizer does not have"):
        load_tokenizer(path)


def test_a_json_file_that_is_no_tokenizer_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "nothing"}}')
    with pytest.raises(ValueError, match=r"tokenizer.json is neither a Hugging Face "
                       r"tokenizer.json that the tokenizers library reads \(.*\) nor a "
                       r"sentencepiece model$"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_a_model_smaller_than_the_tokenizer_is_refused(small_hf_tokenizer_path):
    assert load_tokenizer(small_hf_tokenizer_path, model_vocab_size=448).vocab_size == 400
    with pytest.raises(ValueError, match=r"has 400 ids, more than the model's vocabulary "
                                         r"\(model.vocab_size = 399\)"):
        load_tokenizer(small_hf_tokenizer_path, model_vocab_size=399)


def test_an_unknown_token_is_found_and_decodes_to_nothing(tmp_path):
    """A BPE without byte fallback names its unk token: a character it never saw is unk."""
    backend = Backend(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(["the king and the queen"] * 10, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["[UNK]", "</s>"], show_progress=False))
    tok = HuggingFaceTokenizer(backend.to_str().encode())
    assert (tok.unk_id, tok.eos_id) == (0, 1)
    ids = tok.encode("king ☃")
    assert tok.unk_id in ids and tok.decode(ids) == "king"


def test_documents_are_separated_by_its_eos(small_cfg, small_hf_tokenizer_path):
    cfg = small_cfg(tokenizer=str(small_hf_tokenizer_path))
    tok = build_tokenizer(cfg)
    data = load_tokens(cfg, tok, "validation")
    stream = data.stream.read(0, len(data.stream))
    assert stream[0] == stream[-1] == tok.eos_id == 0
    assert (stream == 0).sum() == data.stats.documents + 1 == 3
