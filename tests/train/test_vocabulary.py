"""One vocabulary setting: `model.vocab_size` is the model's (it may be padded past the
tokenizer's), a given tokenizer brings its own size, and `data.vocab_size` sizes only a
tokenizer trained here. A 32,000-piece Llama 2 / Mistral tokenizer goes into the 100M configs
with `data.tokenizer=PATH` alone; a tiny model of 448 ids trains, samples and resumes on a
400-id tokenizer.json; a tokenizer larger than the model is refused with both numbers."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import train_byte_level_bpe
from tokenizers import Tokenizer as Backend
from tokenizers import models
from train_helpers import REPO

from cem_jax.data import build_tokenizer
from cem_jax.rundir import load_run
from cem_jax.sample import SamplingConfig, generate
from cem_jax.train import load_config, train
from cem_jax.train.sizing import check_expected_params

FULL = REPO / "configs" / "cem_full_100m.yaml"


def _llama2_like_tokenizer_json(path, size: int) -> None:
    """A tokenizer.json of `size` ids laid out as Llama 2's: <unk> 0, <s> 1, </s> 2 (special),
    then plain pieces (a word-level model: the ids are what matters here)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size)}}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(path))


def test_a_32000_piece_tokenizer_goes_into_the_100m_config_with_one_setting(tmp_path):
    _llama2_like_tokenizer_json(tmp_path / "tokenizer.json", 32000)
    cfg = load_config(FULL, [f"data.tokenizer={tmp_path / 'tokenizer.json'}"])
    assert (cfg.model.vocab_size, cfg.data.vocab_size) == (32768, None)
    check_expected_params(cfg)  # the model (and expected_params) untouched
    tokenizer = build_tokenizer(cfg.data, cfg.model.vocab_size)  # what cem-train loads
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id, tokenizer.unk_id) == (
        32000, 2, 1, 0)

    _llama2_like_tokenizer_json(tmp_path / "big.json", 32769)
    cfg = load_config(FULL, [f"data.tokenizer={tmp_path / 'big.json'}"])
    with pytest.raises(ValueError) as raised:
        build_tokenizer(cfg.data, cfg.model.vocab_size)
    assert str(raised.value) == (
        f"tokenizer {tmp_path / 'big.json'} has 32769 ids, more than the model's vocabulary "
        f"(model.vocab_size = 32768): set model.vocab_size to at least 32769 (e.g. 32896, a "
        f"multiple of 128), or use a tokenizer of at most 32768 ids")


def test_a_trained_tokenizer_larger_than_the_model_is_refused():
    with pytest.raises(ValueError, match="data.vocab_size = 4096 is larger than "
                                         "model.vocab_size = 2048: the model must hold"):
        load_config(None, ["data.vocab_size=4096"])
    assert load_config(None, ["data.vocab_size=1024"]).data.vocab_size == 1024  # padded
    assert load_config(None, ["model.vocab_size=512"]).data.vocab_size == 512  # the model's


@pytest.mark.slow
def test_a_padded_model_trains_samples_and_resumes_on_a_tokenizer_json(tiny_overrides,
                                                                      tmp_path):
    corpus = next(o for o in tiny_overrides if o.startswith("data.corpus=")).split("=", 1)[1]
    texts = [Path(p).read_text() for p in sorted(glob.glob(corpus))]
    train_byte_level_bpe(texts, 400, tmp_path / "tokenizer.json")
    args = [o for o in tiny_overrides if not o.startswith(("data.vocab_size=", "data.tokenizer=",
                                                           "model.vocab_size="))]
    args += [f"data.tokenizer={tmp_path / 'tokenizer.json'}", "model.vocab_size=448",
             f"run.dir={tmp_path / 'run'}", "run.steps=2", "run.eval_batches=1"]
    summary = train(load_config(None, args))
    assert summary["step"] == 2 and np.isfinite(summary["eval"]["loss"])
    run = load_run(tmp_path / "run")
    assert (run.tokenizer.kind, run.tokenizer.vocab_size, run.params["embed"].shape[0]) == (
        "huggingface", 400, 448)
    assert json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())[
        "eos_token"] == "<|endoftext|>"
    tok = run.tokenizer
    out = generate(run.params, run.config.model, [[tok.eos_id]], SamplingConfig(
        max_new_tokens=32, temperature=1.0, eos_id=tok.eos_id, stop_at_eos=False,
        vocab_size=tok.vocab_size))
    assert out.tokens.max() < 400
    # started again: a vocab field beside a given tokenizer does not change the tokens
    again = train(load_config(None, [*args, "data.vocab_size=448", "run.sample_tokens=0"]))
    assert again["step"] == 2 and again["eval"]["loss"] == summary["eval"]["loss"]
