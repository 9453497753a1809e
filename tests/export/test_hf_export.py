"""The `hf` export: its own PyTorch modeling code, loaded with trust_remote_code, against our
logits and our cached greedy decoding, for every CEM variant."""

from __future__ import annotations

import json

import numpy as np
import pytest
from export_helpers import torch_logits
from helpers import random_params

from cem_jax.config import ModelConfig
from cem_jax.export.hf import export_hf
from cem_jax.model import model_from_params
from cem_jax.sample import SamplingConfig, generate

TINY = dict(vocab_size=400, d_model=16, num_layers=2, num_heads=2, mlp_dim=32)
IDS = np.array([[3, 17, 250, 399, 4, 61, 8, 120, 77, 5, 260, 300]])
VARIANTS = {  # each feature once; the default run covers all of them in three models
    "tied-llama3rope-gqa-dplr-steps2": dict(num_heads=4, num_kv_heads=2, interaction="dplr",
                                            preconditioner="dplr", steps=2, rope_type="llama3",
                                            rope_factor=8.0, rope_original_max_position=16,
                                            rope_theta=100.0),
    "nope-shared-dplr-diag-recompute-residual": dict(
        position="none", interaction="dplr", diagonal="shared", preconditioner="diag",
        steps=2, recompute_context=True, gradient_wrt="residual", tie_embeddings=False),
    "tied-scalar-relu-unscanned": dict(activation="relu", scan_layers=False),
}
SLOW_VARIANTS = {
    "tied": dict(), "nope": dict(position="none"), "gqa": dict(num_heads=4, num_kv_heads=1),
    "linear-rope": dict(rope_type="linear", rope_factor=4.0),
    "dplr": dict(interaction="dplr"), "precond-none": dict(preconditioner="none"),
    "precond-diag": dict(preconditioner="diag"), "precond-dplr": dict(preconditioner="dplr"),
    "steps2": dict(steps=2), "gelu": dict(activation="gelu"),
    "tied-attention-only": dict(tie_mlp=False), "tied-mlp-only": dict(tie_attention=False),
    "baseline": dict(tie_attention=False, tie_mlp=False, preconditioner="none"),
}


@pytest.mark.parametrize("name", list(VARIANTS) + [
    pytest.param(n, marks=pytest.mark.slow) for n in SLOW_VARIANTS])
def test_hf_logits_and_greedy_generation_equal_ours(tmp_path, tokenizer, name):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(**{**TINY, **{**VARIANTS, **SLOW_VARIANTS}[name]})
    params = random_params(cfg)
    out = export_hf(params, cfg, tokenizer, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] \
        == "modeling_cem.CEMForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)  # we wrote it
    ours = np.asarray(model_from_params(cfg, params)(IDS).logits)
    assert np.abs(ours).max() > 1.0
    np.testing.assert_allclose(torch_logits(model, IDS), ours, atol=1e-4, rtol=0)
    prompt = IDS[:, :5]
    hf_tokens = model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 5:].numpy()
    sampled = generate(params, cfg, [list(prompt[0])],
                       SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert list(hf_tokens) == list(sampled.tokens[0])


def test_left_padded_batch_generation_matches_single_rows(tmp_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(**{**TINY, **VARIANTS["tied-llama3rope-gqa-dplr-steps2"]})
    params = random_params(cfg, seed=3)
    model = AutoModelForCausalLM.from_pretrained(
        export_hf(params, cfg, tokenizer, tmp_path / "hf"), trust_remote_code=True)
    prompts = [[3, 17, 250, 399, 4], [3, 61, 8]]
    batch = torch.tensor([prompts[0], [0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    hf = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[:, 5:].numpy()
    ours = generate(params, cfg, prompts, SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert np.array_equal(hf, ours.tokens)
