"""The safetensors export: documented names, exact reload, safe output directories."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from helpers import random_params

from cem_jax.config import ModelConfig
from cem_jax.export.output import MARKER, ExportError, file_in, staged_dir
from cem_jax.export.safetensors_io import export_safetensors, load_safetensors
from cem_jax.model import model_from_params

CFG = ModelConfig(vocab_size=400, d_model=16, num_layers=2, num_heads=2, mlp_dim=32,
                  interaction="dplr", preconditioner="dplr", preconditioner_rank=3,
                  tie_embeddings=False)


def test_names_shapes_and_exact_reload(tmp_path, tokenizer):
    params = random_params(CFG)
    out = export_safetensors(params, CFG, tokenizer, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json", "model.safetensors",
                                                      "tokenizer.model"]
    tensors = safetensors.numpy.load_file(str(out / "model.safetensors"))
    layer = {k.removeprefix("layers.1."): v.shape for k, v in tensors.items()
             if k.startswith("layers.1.")}
    assert layer == {
        "attention.norm.scale": (16,), "attention.mixer.query": (16, 2, 8),
        "attention.mixer.key": (16, 2, 8), "attention.mixer.diag": (2, 16),
        "attention.precond.rho": (16,), "attention.precond.U": (16, 3),
        "mlp.norm.scale": (16,), "mlp.mixer.gate": (16, 32), "mlp.mixer.up": (16, 32),
        "mlp.precond.rho": (16,), "mlp.precond.U": (16, 3)}
    assert {k for k in tensors if not k.startswith("layers.")} == {"embed", "lm_head",
                                                                   "final_norm.scale"}
    assert np.array_equal(tensors["layers.1.attention.mixer.diag"],
                          params["blocks"]["attention"]["mixer"]["diag"][1])
    assert json.loads((out / "config.json").read_text())["model"]["interaction"] == "dplr"
    cfg, loaded, tok = load_safetensors(out)
    assert cfg == CFG and (tok.kind, tok.sha256) == ("sentencepiece", tokenizer.sha256)
    tokens = jnp.array([[3, 7, 1, 60, 9, 2]])
    np.testing.assert_array_equal(model_from_params(cfg, loaded)(tokens).logits,
                                  model_from_params(CFG, params)(tokens).logits)


def test_scalar_preconditioner_and_unscanned_layers_keep_their_shapes(tmp_path, tokenizer):
    cfg = ModelConfig(vocab_size=400, d_model=16, num_layers=2, num_heads=2, mlp_dim=32,
                      scan_layers=False)
    params = random_params(cfg)
    out = export_safetensors(params, cfg, tokenizer, tmp_path / "out")
    tensors = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert tensors["layers.0.mlp.precond.rho"].shape == ()
    assert float(tensors["layers.1.mlp.precond.rho"]) == float(
        params["blocks"][1]["mlp"]["precond"]["rho"])
    _, loaded, _ = load_safetensors(out)
    assert np.array_equal(loaded["blocks"][1]["attention"]["mixer"]["query"],
                          params["blocks"][1]["attention"]["mixer"]["query"])


def test_a_tensor_that_does_not_fit_is_named(tmp_path, tokenizer):
    out = export_safetensors(random_params(CFG), CFG, tokenizer, tmp_path / "out")
    tensors = safetensors.numpy.load_file(str(out / "model.safetensors"))
    tensors["layers.0.mlp.mixer.up"] = tensors["layers.0.mlp.mixer.up"][:, :5]
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=r"layers\.1\.mlp\.mixer\.up has shape \(16, 32\)"):
        load_safetensors(out)
    del tensors["layers.0.mlp.mixer.up"], tensors["layers.1.mlp.mixer.up"]
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=r"\['blocks'\]\['mlp'\]\['mixer'\]\['up'\]"):
        load_safetensors(out)


def test_output_directory_is_never_half_written_nor_silently_replaced(tmp_path, tokenizer):
    params = random_params(CFG)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="never replaced: choose another --out$"):
        export_safetensors(params, CFG, tokenizer, out)  # no hint of --overwrite (it refuses)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(RuntimeError, match="boom"), staged_dir(tmp_path / "new") as stage:
        (stage / "config.json").write_text("{}")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial directory left
    with pytest.raises(FileExistsError, match="not written by cem-export"):
        export_safetensors(params, CFG, tokenizer, out, overwrite=True)  # a folder we did not write
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    ours = export_safetensors(params, CFG, tokenizer, tmp_path / "ours")
    with pytest.raises(FileExistsError, match="holds an earlier .* output.*pass --overwrite"):
        export_safetensors(params, CFG, tokenizer, ours)
    (ours / "config.json").write_text("stale")
    export_safetensors(params, CFG, tokenizer, ours, overwrite=True)
    assert sorted(p.name for p in ours.iterdir()) == [MARKER, "config.json", "model.safetensors",
                                                       "tokenizer.model"]
    assert (ours / "config.json").read_text() != "stale"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours", "out"]
    for name in ("../escape", "sub/file", ".hidden"):
        with pytest.raises(ExportError, match="refusing"):
            file_in(out, name)


@pytest.mark.parametrize("fmt", ["safetensors", "hf", "hf-llama"])
def test_every_exported_file_gets_the_umask_mode(tmp_path, tokenizer, fmt):
    """model.safetensors as readable as the other files (safetensors creates files 0600)."""
    from cem_jax.export.hf import export_hf
    from cem_jax.export.hf_llama import export_hf_llama

    cfg = ModelConfig(vocab_size=400, d_model=16, num_layers=1, num_heads=2, mlp_dim=32,
                      tie_attention=False, tie_mlp=False, preconditioner="none")
    writer = {"safetensors": export_safetensors, "hf": export_hf, "hf-llama": export_hf_llama}
    old = os.umask(0o022)
    try:
        out = writer[fmt](random_params(cfg), cfg, tokenizer, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
