"""`hf-llama` export against `transformers.LlamaForCausalLM`, its tokenizer, the error for a
model that is no Llama, the import → export round trip and damaged files named on import."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy
from export_helpers import torch_logits
from helpers import random_params

from cem_jax.config import ModelConfig
from cem_jax.export.hf_llama import export_hf_llama, from_llama
from cem_jax.export.importer import import_llama, read_llama_dir
from cem_jax.export.output import ExportError
from cem_jax.rundir import load_run, model_from_params

BASELINE = dict(vocab_size=400, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                mlp_dim=48, tie_attention=False, tie_mlp=False, preconditioner="none",
                rope_theta=500.0)
IDS = np.array([[3, 17, 250, 399, 4, 61, 8, 120, 77, 5, 260, 300]])


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_llama_logits_equal_ours(tmp_path, tokenizer, tie_embeddings):
    from transformers import LlamaForCausalLM

    cfg = ModelConfig(**BASELINE, tie_embeddings=tie_embeddings)
    params = random_params(cfg)
    out = export_hf_llama(params, cfg, tokenizer.model_proto, tmp_path / "llama")
    llama = LlamaForCausalLM.from_pretrained(out)
    assert llama.config.num_key_value_heads == 2
    ours = np.asarray(model_from_params(cfg, params)(IDS))
    assert np.abs(ours).max() > 1.0
    np.testing.assert_allclose(torch_logits(llama, IDS), ours, atol=1e-4, rtol=0)


def test_tokenizer_loads_in_transformers_and_round_trips(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    cfg = ModelConfig(**BASELINE)
    out = export_hf_llama(random_params(cfg), cfg, tokenizer.model_proto, tmp_path / "llama")
    hf = AutoTokenizer.from_pretrained(out)
    text = "The king speaks.\n  Two  spaces, ünïcode and 123 digits\n\nthe end"
    ids = hf.encode(text, add_special_tokens=False)
    assert ids == tokenizer.encode(text)  # exact, but for a literal "▁" (see hf_tokenizer)
    assert hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (3, 0, 2)


def test_a_cem_model_is_not_a_llama(tmp_path, tokenizer):
    cfg = ModelConfig(vocab_size=400, d_model=16, num_layers=1, num_heads=2, mlp_dim=32,
                      position="none", steps=2)
    with pytest.raises(ExportError, match="tie_attention=true") as err:
        export_hf_llama(random_params(cfg), cfg, tokenizer.model_proto, tmp_path / "llama")
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
    np.testing.assert_allclose(np.asarray(run.model()(IDS)), torch_logits(llama, IDS),
                               atol=1e-4, rtol=0)
    export_hf_llama(run.params, run.config.model, run.tokenizer.model_proto, tmp_path / "out")
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
    out = export_hf_llama(random_params(cfg), cfg, tokenizer.model_proto, tmp_path / "llama")
    assert read_llama_dir(out)[0]["model_type"] == "llama"  # readable before the damage
    (out / name).write_bytes(damage)
    with pytest.raises(ExportError, match=f"{out / name} {message}"):
        read_llama_dir(out)


def test_a_llama_config_without_its_sizes_is_named(tmp_path, tokenizer):
    cfg = ModelConfig(**BASELINE)
    out = export_hf_llama(random_params(cfg), cfg, tokenizer.model_proto, tmp_path / "llama")
    config, tensors = read_llama_dir(out)
    del config["hidden_size"], config["intermediate_size"]
    with pytest.raises(ExportError, match="config.json lacks hidden_size, intermediate_size"):
        from_llama(config, tensors)
