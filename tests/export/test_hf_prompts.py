"""A text prompt through an exported tokenizer and `model.generate()` continues as `cem-sample`
does (the document-start EOS included), for the `hf` and `hf-llama` formats and both tokenizer
kinds (a tokenizer.json run's model padded to 448 ids, whose padded rows would win), with the
special ids of config.json equal to the tokenizer's; and docs/export.md's loading code runs as
written: no "run the custom code?" question, no warning about the model type."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from cem_jax.cli import export as cli
from cem_jax.sample import SamplingConfig, generate

DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"
MODELS = {"hf": dict(),  # the default tied CEM model
          "hf-llama": dict(tie_attention=False, tie_mlp=False, preconditioner="none")}
PADDED = 448  # a tokenizer.json run's model vocabulary: 400 ids of the tokenizer, 48 padding


def _padded_rows_win(params: dict) -> None:
    """Embedding rows 400..447 (the tied output head's columns) := 5 × rows 0..47."""
    params["embed"][400:] = 5 * params["embed"][:PADDED - 400]


RUNS = {  # format, tokenizer kind, make_run's model fields
    "hf-sentencepiece": ("hf", "sentencepiece", {}),
    "hf-llama-sentencepiece": ("hf-llama", "sentencepiece", {}),
    "hf-tokenizer.json-padded": ("hf", "huggingface", {"vocab_size": PADDED}),
    "hf-llama-tokenizer.json-padded": ("hf-llama", "huggingface", {"vocab_size": PADDED}),
}


def _export(make_run, tmp_path, name: str):
    """(export directory, the run's tokenizer, TrainConfig, params) of run RUNS[name]."""
    from cem_jax.rundir import load_run

    fmt, kind, model = RUNS[name]
    edit = _padded_rows_win if model else None
    run_dir, cfg, params = make_run(tokenizer=kind, edit=edit, **MODELS[fmt], **model)
    out = tmp_path / "out"
    assert cli.main(["--run", str(run_dir), "--format", fmt, "--out", str(out)]) == 0
    return out, load_run(run_dir).tokenizer, cfg, params


def _cem_sample_ids(tok, cfg, params, prompt: str, max_new_tokens: int) -> list[int]:
    """The tokens behind `cem-sample --temperature 0`'s text for `prompt`: EOS (the document
    start), the prompt's tokens, and the greedy continuation up to its EOS. (Tokens, not text:
    a random model emits byte pieces, whose invalid UTF-8 the two tokenizers replace
    differently.)"""
    ids = [tok.eos_id] + tok.encode(prompt)
    out = generate(params, cfg.model, [ids], SamplingConfig(
        max_new_tokens=max_new_tokens, temperature=0.0, eos_id=tok.eos_id,
        vocab_size=tok.vocab_size))
    return ids + out.tokens[0][:out.lengths[0]].tolist()


@pytest.mark.parametrize("name", list(RUNS))
def test_a_text_prompt_continues_as_cem_sample(make_run, tmp_path, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, tokenizer, cfg, params = _export(make_run, tmp_path, name)
    hf_tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    ids = [getattr(hf_tokenizer, k) for k in special]
    assert ids == [tokenizer.eos_id, tokenizer.eos_id, tokenizer.pad_id]
    for config in (model.config, model.generation_config):
        assert [getattr(config, k) for k in special] == ids
    text = "The king doth"
    inputs = hf_tokenizer(text, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == [tokenizer.eos_id] + tokenizer.encode(text)
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    want = _cem_sample_ids(tokenizer, cfg, params, text, 8)
    assert output[0].tolist() == want
    if cfg.model.vocab_size == PADDED:  # the padded rows win unless masked, here and there
        assert json.loads((out / "config.json").read_text())["vocab_size"] == PADDED
        assert max(want) < 400
        unmasked = generate(params, cfg.model, [want[:len(inputs["input_ids"][0])]],
                            SamplingConfig(max_new_tokens=8, temperature=0.0))
        assert np.max(unmasked.tokens) >= 400


SPECIAL_TEXT = {  # the tokenizer's special pieces, and texts made of them
    "sentencepiece": (["</s>", "<s>", "<pad>", "<unk>"],
                      ["<s>Thou art</s>", "a <pad> b<unk>c </s></s>", "<<s>>"]),
    "huggingface": (["<|endoftext|>", "<|pad|>"],
                    ["a <|pad|> b<|endoftext|>c <|endoftext|><|endoftext|>", "<<|pad|>>",
                     "<|endoftext"]),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_literal_special_pieces_are_text_as_in_cem_sample(make_run, tmp_path, name):
    """"</s>" or "<|endoftext|>" typed in a prompt is characters for cem-sample and for the
    exported tokenizer alike (not EOS, a document start mid-prompt), and survives
    skip_special_tokens; a sampled special id (unk, pad) decodes to nothing in both."""
    from transformers import AutoTokenizer

    out, tokenizer, _, _ = _export(make_run, tmp_path, name)
    hf_tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    specials = [i for i in (tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id,
                            tokenizer.unk_id) if i is not None]
    pieces, more = SPECIAL_TEXT[tokenizer.kind]
    assert sorted({tokenizer.id_to_piece(i) for i in specials}) == sorted(pieces)
    texts = [f"the king{piece}queen" for piece in pieces] + more + ["The king doth speak.\n"]
    for text in texts:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == [tokenizer.eos_id] + tokenizer.encode(text), text
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    king = tokenizer.encode("the king")
    dropped = tokenizer.unk_id if tokenizer.unk_id is not None else tokenizer.pad_id
    sampled = [tokenizer.eos_id, *king, dropped, *tokenizer.encode(" queen")]
    assert (tokenizer.decode(sampled) == hf_tokenizer.decode(sampled, skip_special_tokens=True)
            == "the king queen")


def test_the_docs_loading_code_runs_without_prompt_or_warning(make_run, tokenizer, tmp_path,
                                                               monkeypatch, caplog, capsys):
    """docs/export.md's Python block, run as written on an `hf` export in ./exported: it prints
    the text of cem-sample's greedy tokens, never asks whether to run the custom code (`input`
    records any question) and logs no warning about the model type (without
    trust_remote_code for the tokenizer, transformers asks and warns)."""
    from transformers import AutoTokenizer

    code = next(block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(),
                                              re.DOTALL) if "AutoTokenizer" in block)
    run_dir, cfg, params = make_run(**MODELS["hf"])
    out = tmp_path / "exported"
    assert cli.main(["--run", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    want = AutoTokenizer.from_pretrained(out, trust_remote_code=True).decode(
        _cem_sample_ids(tokenizer, cfg, params, "ROMEO:", 40), skip_special_tokens=True)
    capsys.readouterr()
    asked = []
    monkeypatch.setattr("builtins.input", lambda question="": asked.append(question) or "n")
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # to caplog
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        exec(compile(code, str(DOC), "exec"), {})
    assert asked == []
    assert not [r for r in caplog.records if "You are using a model of type" in r.getMessage()]
    assert capsys.readouterr().out == want + "\n"
