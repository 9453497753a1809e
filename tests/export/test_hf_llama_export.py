"""`hf-llama` export against `transformers.LlamaForCausalLM`, its tokenizer, the error for a
model that is no Llama, the import → export round trip, the config.json forms transformers reads
(RoPE θ placements and scaling types, tied and untied heads) imported to the same function or
refused in one line, and damaged files named on import."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import safetensors.numpy
from export_helpers import torch_logits
from helpers import random_params

from cem_jax.cli import export as cli
from cem_jax.config import ModelConfig
from cem_jax.export.hf_llama import export_hf_llama, from_llama
from cem_jax.export.importer import import_llama, read_llama_dir
from cem_jax.export.output import ExportError
from cem_jax.export.safetensors_io import unflat_params
from cem_jax.model import model_from_params
from cem_jax.rundir import load_run

BASELINE = dict(vocab_size=400, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                mlp_dim=48, tie_attention=False, tie_mlp=False, preconditioner="none",
                rope_theta=500.0)
IDS = np.array([[3, 17, 250, 399, 4, 61, 8, 120, 77, 5, 260, 300]])
# llama3 scaling over a pretraining context of 64 positions: with K = 8 and θ = 10⁴ the four
# feature pairs (wavelengths 6, 63, 628, 6283) are kept, blended, divided, divided.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SCALED = {
    "default": {},
    "linear": dict(rope_type="linear", rope_factor=4.0),
    "llama3": dict(rope_type="llama3", rope_factor=8.0, rope_theta=10000.0,
                   rope_original_max_position=64),
}


@pytest.mark.parametrize(("tie_embeddings", "rope"), [(False, "default"), (True, "default"),
                                                      (False, "llama3"), (True, "linear")])
def test_llama_logits_equal_ours_and_import_back(tmp_path, tokenizer, tie_embeddings, rope):
    from transformers import LlamaForCausalLM

    cfg = ModelConfig(**{**BASELINE, **SCALED[rope]}, tie_embeddings=tie_embeddings)
    params = random_params(cfg)
    out = export_hf_llama(params, cfg, tokenizer, tmp_path / "llama")
    llama = LlamaForCausalLM.from_pretrained(out)
    assert llama.config.num_key_value_heads == 2
    assert llama.config.rope_parameters["rope_type"] == cfg.rope_type
    ours = np.asarray(model_from_params(cfg, params)(IDS).logits)
    assert np.abs(ours).max() > 1.0
    np.testing.assert_allclose(torch_logits(llama, IDS), ours, atol=1e-4, rtol=0)
    assert from_llama(*read_llama_dir(out))[0] == cfg


LLAMA = dict(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)  # GQA, K = 8


def _llama_dir(path, config: dict, lm_head: bool = True, dtype: str = "float32"):
    """A Llama directory of random weights (norms away from 1, stored in `dtype`) with
    `config` as its config.json, written as is (save_pretrained would rewrite it in its own
    form; the keys of LLAMA in `config` size the weights too); without `lm_head`, no
    lm_head.weight tensor."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = {**LLAMA, **{k: v for k, v in config.items() if k in LLAMA}}
    llama = LlamaForCausalLM(LlamaConfig(**sizes, initializer_range=0.3))
    tensors = {k: v.detach().to(getattr(torch, dtype)).contiguous()
               for k, v in llama.state_dict().items() if lm_head or k != "lm_head.weight"}
    for name, value in tensors.items():
        if "norm" in name:
            value.add_(0.1 * torch.randn_like(value))
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **LLAMA, **config}))
    return path


FORMS = {  # config.json keys (beside LLAMA), lm_head in the file → our RoPE fields, tied head
    "theta-top-level-beside-default-type": (
        {"rope_parameters": {"rope_type": "default"}, "rope_theta": 500000}, True,
        dict(rope_theta=500000), False),
    "theta-in-rope-parameters-wins": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, "rope_theta": 500000,
         "tie_word_embeddings": False}, True, dict(rope_theta=1000.0), False),
    "no-rope-keys-tied-without-head": (
        {"tie_word_embeddings": True}, False, dict(rope_theta=10000.0), True),
    "tie-flag-with-its-own-head": (  # transformers keeps the file's head: untied
        {"tie_word_embeddings": True, "rope_theta": 300.0}, True, dict(rope_theta=300.0), False),
    "legacy-rope-scaling-linear": (
        {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 300.0}, True,
        dict(rope_theta=300.0, rope_type="linear", rope_factor=4.0), False),
    "llama3": (
        {"rope_parameters": {**LLAMA3, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 64}}, True,
        dict(rope_theta=10000.0, rope_type="llama3", rope_factor=8.0,
             rope_original_max_position=64), False),
    "llama3-context-at-top-level-wins": (
        {"rope_parameters": {**LLAMA3, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 4096},
         "original_max_position_embeddings": 64, "max_position_embeddings": 8192}, True,
        dict(rope_theta=10000.0, rope_type="llama3", rope_factor=8.0,
             rope_original_max_position=64), False),
    "llama3-legacy-context-from-max-positions-theta-top-level": (
        {"rope_scaling": LLAMA3, "rope_theta": 10000, "max_position_embeddings": 64,
         "tie_word_embeddings": True}, False,
        dict(rope_theta=10000.0, rope_type="llama3", rope_factor=8.0,
             rope_original_max_position=64), True),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_llama_config_form_imports_to_the_function_transformers_computes(tmp_path, form):
    from transformers import LlamaForCausalLM

    config, lm_head, rope, tied = FORMS[form]
    directory = _llama_dir(tmp_path / "hf", config, lm_head)
    cfg, flat = from_llama(*read_llama_dir(directory))
    assert {k: getattr(cfg, k) for k in rope} == rope and cfg.tie_embeddings == tied
    assert cfg.kv_heads == 2 and cfg.head_width == 8
    ours = np.asarray(model_from_params(cfg, unflat_params(flat, cfg))(IDS).logits)
    theirs = torch_logits(LlamaForCausalLM.from_pretrained(directory), IDS)
    assert np.abs(ours).max() > 1.0
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_a_bfloat16_llama_imports(tmp_path):
    """Llama 3 checkpoints ship bfloat16 tensors (numpy has no such dtype): imported exactly,
    the function transformers computes from them in float32."""
    import torch
    from transformers import LlamaForCausalLM

    directory = _llama_dir(tmp_path / "hf", {"dtype": "bfloat16"}, dtype="bfloat16")
    cfg, flat = from_llama(*read_llama_dir(directory))
    ours = np.asarray(model_from_params(cfg, unflat_params(flat, cfg))(IDS).logits)
    theirs = torch_logits(LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32), IDS)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("config", "lm_head", "message"), [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64}}, True,
     "RoPE scaling rope_type='yarn' is not supported: cem_jax implements default, linear, "
     "llama3"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, True, "rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, True,
     "rope_parameters of rope_type='llama3' lacks low_freq_factor, high_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     True, "partial_rotary_factor=0.5 with rope_type='linear' is not supported"),
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": 4.0}}, True,
     "'rope_high_freq_factor' = 4.0 is invalid: it must be > rope_low_freq_factor = 4.0"),
    ({}, False, "no lm_head.weight and tie_word_embeddings is false (the default): "
                "transformers would draw its output head at random"),
    ({"tie_word_embeddings": "yes"}, True, "tie_word_embeddings = 'yes' in config.json"),
])
def test_a_llama_config_we_cannot_reproduce_is_refused_in_one_line(tmp_path, config, lm_head,
                                                                    message):
    directory = _llama_dir(tmp_path / "hf", config, lm_head)
    with pytest.raises(ExportError) as err:
        from_llama(*read_llama_dir(directory))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cem_import_of_a_llama3_config_writes_its_scaling(tmp_path, corpus, capsys):
    """The issue's case through the command: θ at the top level beside a typed rope_parameters
    (it was a KeyError traceback), and a refused type as one line of stderr."""
    hf = _llama_dir(tmp_path / "hf", {"rope_parameters": {**LLAMA3, "rope_theta": 500000},
                                      "max_position_embeddings": 64})
    (hf / "tokenizer.model").write_bytes((corpus / "tokenizer.model").read_bytes())
    assert cli.import_main(["--hf", str(hf), "--out", str(tmp_path / "run")]) == 0
    model = load_run(tmp_path / "run").config.model
    assert (model.rope_type, model.rope_theta, model.rope_original_max_position) == \
        ("llama3", 500000.0, 64)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "rope_parameters": {
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}))
    capsys.readouterr()
    assert cli.import_main(["--hf", str(hf), "--out", str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err == ("cem-import: error: RoPE scaling rope_type='longrope' is "
                                       "not supported: cem_jax implements default, linear, "
                                       "llama3\n")


def test_a_llama_whose_embedding_is_padded_past_its_tokenizer_imports(tmp_path, corpus,
                                                                      capsys):
    """The issue's case: 448 embedding rows, a 400-piece tokenizer (transformers loads such a
    model). cem-import advised vocab_size=400, then refused that override; now the run's
    model has the 448 rows and its tokenizer its 400 pieces, one setting each."""
    from transformers import LlamaForCausalLM

    hf = _llama_dir(tmp_path / "hf", {"vocab_size": 448, "tie_word_embeddings": False})
    (hf / "tokenizer.model").write_bytes((corpus / "tokenizer.model").read_bytes())
    assert cli.import_main(["--hf", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().err == ""
    run = load_run(tmp_path / "run")
    assert (run.config.model.vocab_size, run.tokenizer.vocab_size) == (448, 400)
    assert (run.config.data.vocab_size, run.config.data.tokenizer) == (
        None, str(tmp_path / "run" / "tokenizer.model"))
    np.testing.assert_allclose(np.asarray(run.model()(IDS).logits),
                               torch_logits(LlamaForCausalLM.from_pretrained(hf), IDS),
                               atol=1e-4, rtol=0)
    assert run.model()(IDS).logits.shape == (1, IDS.shape[1], 448)


def test_a_llama_with_a_tokenizer_json_imports(tmp_path, corpus, json_tokenizer):
    """A Llama directory with tokenizer.json (and the tokenizer_config.json naming its special
    tokens, as Llama 3's has) instead of tokenizer.model: the run holds both files, its
    tokenizer gives the same ids and the special tokens the config names."""
    hf = _llama_dir(tmp_path / "hf", {})
    (hf / "tokenizer.json").write_bytes((corpus / "hf" / "tokenizer.json").read_bytes())
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
         "eos_token": {"content": "<|endoftext|>", "special": True}, "pad_token": None,
         "chat_template": "{{ messages }}"}))
    assert cli.import_main(["--hf", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ".cem_jax_output", "checkpoints", "config.yaml", "tokenizer.json",
        "tokenizer_config.json"]
    run = load_run(tmp_path / "run")
    tok = run.tokenizer
    assert (tok.kind, tok.eos_id, tok.bos_id, tok.pad_id) == ("huggingface", 0, 0, 0)
    text = "The king doth speak <|endoftext|> again.\n"
    assert tok.encode(text) == json_tokenizer.encode(text)
    assert run.config.data.tokenizer == str(tmp_path / "run" / "tokenizer.json")


def test_tokenizer_loads_in_transformers_and_round_trips(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    cfg = ModelConfig(**BASELINE)
    out = export_hf_llama(random_params(cfg), cfg, tokenizer, tmp_path / "llama")
    hf = AutoTokenizer.from_pretrained(out)
    text = "The king speaks.\n  Two  spaces, ünïcode and 123 digits\n\nthe end"
    ids = hf.encode(text, add_special_tokens=False)
    assert ids == tokenizer.encode(text)  # exact, but for a literal "▁" (see hf_tokenizer)
    assert hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (3, 0, 3)  # bos: doc start


def test_a_cem_model_is_not_a_llama(tmp_path, tokenizer):
    cfg = ModelConfig(vocab_size=400, d_model=16, num_layers=1, num_heads=2, mlp_dim=32,
                      position="none", steps=2)
    with pytest.raises(ExportError, match="tie_attention=true") as err:
        export_hf_llama(random_params(cfg), cfg, tokenizer, tmp_path / "llama")
    for feature in ("tie_mlp=true", "preconditioner='scalar'", "steps=2", "position='none'",
                    "--format hf"):
        assert feature in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_import_then_export_is_exact(tmp_path, corpus):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.3,
        bos_token_id=2, eos_token_id=3, pad_token_id=0))
    with torch.no_grad():  # norms away from 1, so that a mix-up of them would show
        for name, p in llama.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    llama.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.model").write_bytes((corpus / "tokenizer.model").read_bytes())
    import_llama(tmp_path / "hf", tmp_path / "run", overrides=["run.steps=5"])
    run = load_run(tmp_path / "run")
    assert run.step == 0 and run.config.model.rope_theta == 1000.0
    assert run.config.model.kv_heads == 2 and not run.config.model.tie_attention
    np.testing.assert_allclose(np.asarray(run.model()(IDS).logits), torch_logits(llama, IDS),
                               atol=1e-4, rtol=0)
    export_hf_llama(run.params, run.config.model, run.tokenizer, tmp_path / "out")
    original = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert original.keys() == exported.keys()
    for name, value in original.items():
        assert np.array_equal(value, exported[name]), name


@pytest.mark.parametrize(("name", "damage", "message"), [
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{", "is not a readable safetensors"),
    ("config.json", b'{"model_type": "llama",', "is not valid JSON"),
    ("config.json", b"[]", "holds a JSON list, not an object"),
])
def test_a_damaged_llama_file_is_named(tmp_path, tokenizer, name, damage, message):
    cfg = ModelConfig(**BASELINE)
    out = export_hf_llama(random_params(cfg), cfg, tokenizer, tmp_path / "llama")
    assert read_llama_dir(out)[0]["model_type"] == "llama"  # readable before the damage
    (out / name).write_bytes(damage)
    with pytest.raises(ExportError, match=f"{out / name} {message}"):
        read_llama_dir(out)


def test_a_llama_config_without_its_sizes_is_named(tmp_path, tokenizer):
    cfg = ModelConfig(**BASELINE)
    out = export_hf_llama(random_params(cfg), cfg, tokenizer, tmp_path / "llama")
    config, tensors = read_llama_dir(out)
    del config["hidden_size"], config["intermediate_size"]
    with pytest.raises(ExportError, match="config.json lacks hidden_size, intermediate_size"):
        from_llama(config, tensors)


@pytest.mark.slow  # ~10 s: compiles a train step; the import is covered by the tests above
def test_an_imported_llama3_trains_on(tmp_path, corpus, caplog):
    """A small Llama 3 (llama3 RoPE scaling, GQA, tied head) imported by cem-import starts as
    a run from its checkpoint 0 (said as such, not as a resume), on a data section of its own
    (no token was read at step 0), and takes optimizer steps, keeping its scaling."""
    from cem_jax.train import load_config, train

    hf = _llama_dir(tmp_path / "hf", {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0},
                                      "max_position_embeddings": 64,
                                      "tie_word_embeddings": True}, lm_head=False)
    (hf / "tokenizer.model").write_bytes((corpus / "tokenizer.model").read_bytes())
    run = tmp_path / "run"
    import_llama(hf, run, overrides=[
        f"data.corpus={corpus / 'train'}/*.txt", f"data.val_corpus={corpus / 'val'}/*.txt",
        "data.seq_len=16", "data.batch_size=4", f"data.cache_dir={corpus / 'cache'}",
        "run.steps=2", "run.log_every=1", "run.eval_every=2", "run.eval_batches=1",
        "run.sample_tokens=0", "run.progress=false"])
    with caplog.at_level(logging.INFO, logger="cem_jax"):  # on another batch: no token read
        summary = train(load_config(run / "config.yaml", ["data.batch_size=2"]))
    assert summary["step"] == 2 and np.isfinite(summary["eval"]["loss"])
    assert f"starting {run} from its imported parameters (checkpoint 0)" in caplog.text
    assert "resumed" not in caplog.text
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    norms = [r["param_norm"] for r in records if r["kind"] == "train"]
    assert len(norms) == 2 and norms[0] != norms[1]  # the second step moved the weights
    trained = load_run(run)
    assert trained.step == 2 and trained.config.data.batch_size == 2
    assert (trained.config.model.rope_type, trained.config.model.rope_original_max_position,
            trained.config.model.rope_theta) == ("llama3", 64, 500000.0)
