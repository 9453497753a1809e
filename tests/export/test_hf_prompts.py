"""A text prompt through an exported tokenizer and `model.generate()` continues as `cem-sample`
does (the document-start EOS included), for the `hf` and `hf-llama` formats, with the special
ids of config.json equal to the tokenizer's; and the README's loading code runs as written: no
"run the custom code?" question, no warning about the model type."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from cem_jax.export import cli
from cem_jax.sample import SamplingConfig, generate

README = Path(__file__).resolve().parents[2] / "README.md"
MODELS = {"hf": dict(),  # the default tied CEM model
          "hf-llama": dict(tie_attention=False, tie_mlp=False, preconditioner="none")}


def _cem_sample_ids(tok, cfg, params, prompt: str, max_new_tokens: int) -> list[int]:
    """The tokens behind `cem-sample --temperature 0`'s text for `prompt`: EOS (the document
    start), the prompt's tokens, and the greedy continuation up to its EOS. (Tokens, not text:
    a random model emits byte pieces, whose invalid UTF-8 the two tokenizers replace
    differently.)"""
    ids = [tok.eos_id] + tok.encode(prompt)
    out = generate(params, cfg.model, [ids], SamplingConfig(
        max_new_tokens=max_new_tokens, temperature=0.0, eos_id=tok.eos_id))
    return ids + out.tokens[0][:out.lengths[0]].tolist()


@pytest.mark.parametrize("fmt", list(MODELS))
def test_a_text_prompt_continues_as_cem_sample(make_run, tokenizer, tmp_path, fmt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, cfg, params = make_run(**MODELS[fmt])
    out = tmp_path / "out"
    assert cli.main(["--run", str(run_dir), "--format", fmt, "--out", str(out)]) == 0
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
    assert output[0].tolist() == _cem_sample_ids(tokenizer, cfg, params, text, 8)


@pytest.mark.parametrize("fmt", list(MODELS))
def test_literal_special_pieces_are_text_as_in_cem_sample(make_run, tokenizer, tmp_path, fmt):
    """"</s>" typed in a prompt is four characters for cem-sample and for the exported
    tokenizer alike (not EOS, a document start mid-prompt), and survives skip_special_tokens;
    a sampled unknown id decodes to nothing in both."""
    from transformers import AutoTokenizer

    run_dir, _, _ = make_run(**MODELS[fmt])
    out = tmp_path / "out"
    assert cli.main(["--run", str(run_dir), "--format", fmt, "--out", str(out)]) == 0
    hf_tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    pieces = [tokenizer.id_to_piece(i) for i in (tokenizer.eos_id, tokenizer.bos_id,
                                                  tokenizer.pad_id, tokenizer.unk_id)]
    assert pieces == ["</s>", "<s>", "<pad>", "<unk>"]
    texts = [f"the king{piece}queen" for piece in pieces] + [
        "<s>Thou art</s>", "a <pad> b<unk>c </s></s>", "<<s>>", "The king doth speak.\n"]
    for text in texts:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == [tokenizer.eos_id] + tokenizer.encode(text), text
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    king = tokenizer.encode("the king")
    sampled = [tokenizer.eos_id, *king, tokenizer.unk_id, *tokenizer.encode(" queen")]
    assert (tokenizer.decode(sampled) == hf_tokenizer.decode(sampled, skip_special_tokens=True)
            == "the king queen")


def test_the_readme_loading_code_runs_without_prompt_or_warning(make_run, tokenizer, tmp_path,
                                                                 monkeypatch, caplog, capsys):
    """The README's Python block, run as written on an `hf` export in ./exported: it prints the
    text of cem-sample's greedy tokens, never asks whether to run the custom code (`input`
    records any question) and logs no warning about the model type (without
    trust_remote_code for the tokenizer, transformers asks and warns)."""
    from transformers import AutoTokenizer

    code = next(block for block in re.findall(r"```python\n(.*?)```", README.read_text(),
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
        exec(compile(code, str(README), "exec"), {})
    assert asked == []
    assert not [r for r in caplog.records if "You are using a model of type" in r.getMessage()]
    assert capsys.readouterr().out == want + "\n"
