"""The `hf` export under Hugging Face fine-tuning: LoRA (peft) trained, merged, saved and
reloaded; tokens added with resize_token_embeddings; inputs_embeds; gradient checkpointing; the
KV cache of generate against recomputing; an export in the layout written before the
projections were modules; and the same LoRA round trip on an `hf-llama` export."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
from export_helpers import torch_logits
from helpers import random_params

from cem_jax.config import ModelConfig
from cem_jax.export.hf import export_hf
from cem_jax.export.hf_llama import export_hf_llama
from cem_jax.export.safetensors_io import write_weights
from cem_jax.model import model_from_params

TINY = dict(vocab_size=400, d_model=16, num_layers=2, num_heads=2, mlp_dim=32)
IDS = np.array([[3, 17, 250, 399, 4, 61, 8, 120, 77, 5, 260, 300]])
BASELINE = dict(tie_attention=False, tie_mlp=False, preconditioner="none")
# What each block's cache layer holds after 9 tokens: keys [B,C,G,S,K] and the value slot:
# nothing of tied attention ([B,C,S,0], keys only), DPLR's contexts [B,C,S,D], the baseline's
# values [B,C,G,S,K] (C = 2 contexts with recompute_context and 2 steps).
CACHES = {
    "tied": (dict(), (1, 1, 2, 9, 8), (1, 1, 9, 0)),
    "tied-gqa-dplr-recompute-steps2": (dict(num_heads=4, num_kv_heads=2, interaction="dplr",
                                            steps=2, recompute_context=True),
                                       (1, 2, 2, 9, 4), (1, 2, 9, 16)),
    "baseline-gqa": (dict(**BASELINE, num_heads=4, num_kv_heads=2), (1, 1, 2, 9, 4),
                     (1, 1, 2, 9, 4)),
}

def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)  # we wrote it


@pytest.fixture(scope="module")
def tied_export(tmp_path_factory, tokenizer):
    """(directory, ModelConfig, params) of an `hf` export of the default tied CEM model."""
    cfg = ModelConfig(**TINY)
    params = random_params(cfg)
    return export_hf(params, cfg, tokenizer, tmp_path_factory.mktemp("tied") / "hf"), cfg, params


@pytest.mark.parametrize("name", list(CACHES))
def test_cached_decoding_equals_recomputing(tmp_path, tokenizer, name):
    import torch

    fields, keys, values = CACHES[name]
    cfg = ModelConfig(**{**TINY, **fields})
    model = _load(export_hf(random_params(cfg), cfg, tokenizer, tmp_path / "hf"))
    ids = torch.tensor(IDS)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        prefill = model(ids[:, :9])
        layer = prefill.cache.layers[0]
        assert (layer.keys.shape, layer.values.shape) == (keys, values)
        steps = [model(ids[:, t:t + 1], cache=prefill.cache).logits for t in range(9, 12)]
    np.testing.assert_allclose(torch.cat(steps, 1), full[:, 9:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(prefill.logits, full[:, :9], atol=1e-5, rtol=0)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True)
    cached = model.generate(ids[:, :5], **kwargs)  # the export's default: the cache
    recomputed = model.generate(ids[:, :5], use_cache=False, **kwargs)
    assert cached.cache.get_seq_length() == 5 + 12 - 1 and recomputed.cache is None
    assert cached.sequences.tolist() == recomputed.sequences.tolist()


def test_inputs_embeds_and_the_tied_head(tied_export):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tied_export[0], trust_remote_code=True,
                                                       output_loading_info=True)
    assert all(not keys for keys in info.values()), info  # the file holds the module's names
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embed, torch.nn.Embedding) and isinstance(head, torch.nn.Linear)
    assert head.weight is embed.weight  # the run ties them
    ids = torch.tensor(IDS)
    with torch.no_grad():
        np.testing.assert_array_equal(model(inputs_embeds=embed(ids)).logits,
                                      model(input_ids=ids).logits)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(input_ids=ids, inputs_embeds=embed(ids))


def test_added_tokens_get_embedding_rows_and_generate(tied_export):
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tied_export[0], trust_remote_code=True)
    model = _load(tied_export[0])
    old = model.get_input_embeddings().weight.detach().clone()
    assert len(tokenizer) == 400 and tokenizer.add_tokens(["<ghost>", "<wraith>", "<shade>"]) == 3
    model.resize_token_embeddings(len(tokenizer))
    embed = model.get_input_embeddings().weight
    assert embed.shape == (403, 16) and model.config.vocab_size == 403
    assert torch.equal(embed[:400], old) and torch.isfinite(embed[400:]).all()
    assert model.get_output_embeddings().weight is embed  # still tied
    inputs = tokenizer("The king <wraith>", return_tensors="pt")
    assert inputs["input_ids"][0, -1].item() == tokenizer.convert_tokens_to_ids("<wraith>") == 401
    with torch.no_grad():
        assert model(**inputs).logits.shape[-1] == 403
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 6)


def test_gradient_checkpointing_gives_the_same_gradients(tied_export):
    import torch

    model = _load(tied_export[0]).train()
    ids = torch.tensor(IDS)
    calls = []
    model.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))

    def gradients():
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = gradients()
    assert len(calls) == 1
    model.activation_checkpointing_enable()
    assert all(block.gradient_checkpointing for block in model.layers)
    checkpointed = gradients()
    assert len(calls) == 3  # the block ran again in the backward pass
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-7, rtol=1e-6)


def _lora_round_trip(model, lora, out):
    """Train `lora` (a peft LoraConfig) on `model` for 5 AdamW steps on IDS, merge it, save the
    merged model to `out` and reload it; returns the merged model."""
    import torch
    from peft import get_peft_model

    ids = torch.tensor(IDS)
    with torch.no_grad():
        base = model(ids).logits
    torch.manual_seed(0)
    adapted = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = adapted(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    adapted.eval()
    with torch.no_grad():
        trained = adapted(ids).logits
        assert (trained - base).abs().max() > 0.1
        merged = adapted.merge_and_unload()
        np.testing.assert_allclose(merged(ids).logits, trained, atol=1e-5, rtol=0)
        merged.save_pretrained(out)
        np.testing.assert_array_equal(_load(out)(ids).logits, merged(ids).logits)
    return merged


def test_lora_on_the_cem_model_trains_merges_and_reloads(tmp_path, tied_export):
    """Single-use projections by module name, the tied query and gate by target_parameters:
    the merged model computes what the adapted one did, so the adapter changed both uses."""
    from peft import LoraConfig

    model = _load(tied_export[0])
    query = model.layers[0].attention.mixer.query.weight.detach().clone()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["key", "up"],
                      target_parameters=["query.weight", "gate.weight"])
    merged = _lora_round_trip(model, lora, tmp_path / "merged")
    assert (merged.layers[0].attention.mixer.query.weight - query).abs().max() > 1e-3


def test_lora_on_an_hf_llama_export_trains_merges_and_reloads(tmp_path, tokenizer):
    from peft import LoraConfig

    cfg = ModelConfig(**TINY, **BASELINE, tie_embeddings=False)
    model = _load(export_hf_llama(random_params(cfg), cfg, tokenizer, tmp_path / "llama"))
    assert type(model).__name__ == "LlamaForCausalLM"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"])
    _lora_round_trip(model, lora, tmp_path / "merged")


@pytest.mark.parametrize("fields", [pytest.param(dict(), id="tied"), pytest.param(
    dict(**BASELINE, num_heads=4, num_kv_heads=2, tie_embeddings=False),
    id="baseline-gqa-untied-head")])
def test_an_export_in_the_earlier_layout_loads(tmp_path, tokenizer, fields):
    """Exports written before the projections were modules hold the safetensors export's names
    and layouts (`embed`, query [D,H,K], ...) and config.json's use_cache false."""
    cfg = ModelConfig(**{**TINY, **fields})
    params = random_params(cfg)
    out = export_hf(params, cfg, tokenizer, tmp_path / "hf")
    write_weights(out, params, cfg, {"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    assert "embed" in safetensors.numpy.load_file(str(out / "model.safetensors"))
    model = _load(out)
    ours = np.asarray(model_from_params(cfg, params)(IDS).logits)
    np.testing.assert_allclose(torch_logits(model, IDS), ours, atol=1e-4, rtol=0)
    assert model.generation_config.eos_token_id == tokenizer.eos_id
