"""The `hf-llama` export (baseline models → `transformers.LlamaForCausalLM`) and its inverse, the
tensors of a Hugging Face Llama → a baseline model's parameters (used by `cem-import`).

Only the baseline is a Llama (DESIGN.md §1): free Wq, Wk, Wv, Wo and gate/up/down, P = I, one
step, gradient taken in the normalized variable, RoPE. A tied CEM model is not one even without
RoPE in the general case (a Hugging Face Llama always rotates; with RoPE, CEM values carry the
relative rotation R_{s-t}); use the `hf` format for it.

Layout: ours query [D,H,K] ↔ q_proj.weight [H·K, D] (Linear weights are [out, in]); out
[H,K,D] ↔ o_proj.weight [D, H·K]; gate/up [D,F] ↔ [F,D]; down [F,D] ↔ [D,F]; lm_head [D,V] ↔
[V,D]. Both sides use the half-split `rotate_half` RoPE, so no permutation of heads is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cem_jax.config import ModelConfig
from cem_jax.export.hf_tokenizer import write_tokenizer
from cem_jax.export.output import ExportError, file_in, staged_dir
from cem_jax.export.safetensors_io import flat_params

ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "relu": "relu"}  # ours → transformers ACT2FN


def llama_incompatibility(cfg: ModelConfig) -> str | None:
    """Why `cfg` is not a Llama (the features, named), or None if it is one."""
    reasons = []
    if cfg.tie_attention:
        reasons.append("tie_attention=true (CEM attention: value tied to key, output to query; "
                       "with RoPE its values carry relative rotations)")
    if cfg.tie_mlp:
        reasons.append("tie_mlp=true (CEM MLP: down projection tied to gateᵀ)")
    if cfg.preconditioner != "none":
        reasons.append(f"preconditioner={cfg.preconditioner!r} (a Llama block has P = I)")
    if cfg.steps != 1:
        reasons.append(f"steps={cfg.steps} (a Llama block takes one step)")
    if cfg.gradient_wrt != "normalized":
        reasons.append("gradient_wrt='residual' (the update goes through the RMSNorm VJP)")
    if cfg.position != "rope":
        reasons.append("position='none' (a Hugging Face Llama always applies RoPE)")
    if cfg.activation not in ACTIVATIONS:
        reasons.append(f"activation={cfg.activation!r} (registered in this process; "
                       "transformers has no such activation)")
    if not reasons:
        return None
    return ("the hf-llama format expresses only the Llama baseline; this model has "
            + "; ".join(reasons) + ". Export it with --format hf (its own modeling code) or "
            "safetensors")


def llama_config(cfg: ModelConfig, tokenizer_ids: dict[str, int]) -> dict:
    """The `LlamaConfig` fields (config.json) of a baseline `cfg`."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_width, "hidden_act": ACTIVATIONS[cfg.activation],
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": cfg.param_dtype, **tokenizer_ids,
    }


def to_llama_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters → the state dict names and layouts of `LlamaForCausalLM`."""
    flat = flat_params(params, cfg)
    D, H, G, K = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_width
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight":
           flat["final_norm.scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = flat["lm_head"].T
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        a, m = f"{ours}.attention.mixer", f"{ours}.mlp.mixer"
        out |= {
            f"{theirs}.input_layernorm.weight": flat[f"{ours}.attention.norm.scale"],
            f"{theirs}.post_attention_layernorm.weight": flat[f"{ours}.mlp.norm.scale"],
            f"{theirs}.self_attn.q_proj.weight": flat[f"{a}.query"].reshape(D, H * K).T,
            f"{theirs}.self_attn.k_proj.weight": flat[f"{a}.key"].reshape(D, G * K).T,
            f"{theirs}.self_attn.v_proj.weight": flat[f"{a}.value"].reshape(D, G * K).T,
            f"{theirs}.self_attn.o_proj.weight": flat[f"{a}.out"].reshape(H * K, D).T,
            f"{theirs}.mlp.gate_proj.weight": flat[f"{m}.gate"].T,
            f"{theirs}.mlp.up_proj.weight": flat[f"{m}.up"].T,
            f"{theirs}.mlp.down_proj.weight": flat[f"{m}.down"].T,
        }
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_llama(config: dict, tensors: dict[str, np.ndarray]
               ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A Hugging Face Llama (config.json dict, state dict as numpy) → (baseline ModelConfig,
    fp32 tensors under our names: `unflat_params` makes them a model's parameters).
    Raises ExportError naming a feature we cannot express (biases, rope scaling, another
    activation), a missing config key or a missing tensor."""
    rope = config.get("rope_parameters") or {"rope_type": "default",
                                             "rope_theta": config.get("rope_theta", 10000.0)}
    problems = [f"{k}=true" for k in ("attention_bias", "mlp_bias") if config.get(k)]
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        problems.append(f"rope scaling {rope.get('rope_type')!r}")
    if config.get("hidden_act", "silu") not in ACTIVATIONS:
        problems.append(f"hidden_act={config.get('hidden_act')!r}")
    if problems:
        raise ExportError("cannot import this Llama as a cem_jax baseline: "
                          + ", ".join(problems) + " not supported")
    required = ("num_attention_heads", "hidden_size", "vocab_size", "num_hidden_layers",
                "intermediate_size")
    if missing := [k for k in required if k not in config]:
        raise ExportError(f"the Llama's config.json lacks {', '.join(missing)}")
    H = config["num_attention_heads"]
    D = config["hidden_size"]
    tied = bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors
    cfg = ModelConfig(
        vocab_size=config["vocab_size"], d_model=D, num_layers=config["num_hidden_layers"],
        num_heads=H, num_kv_heads=config.get("num_key_value_heads") or H,
        head_dim=config.get("head_dim") or D // H, mlp_dim=config["intermediate_size"],
        activation=config.get("hidden_act", "silu"), tie_attention=False, tie_mlp=False,
        preconditioner="none", steps=1, position="rope", rope_theta=float(rope["rope_theta"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), tie_embeddings=tied)
    G, K = cfg.kv_heads, cfg.head_width

    def get(name):
        if name not in tensors:
            raise ExportError(f"the Llama checkpoint has no tensor {name!r}")
        return np.asarray(tensors[name], np.float32)

    flat = {"embed": get("model.embed_tokens.weight"), "final_norm.scale":
            get("model.norm.weight")}
    if not tied:
        flat["lm_head"] = get("lm_head.weight").T
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        a, m = f"{ours}.attention.mixer", f"{ours}.mlp.mixer"
        flat |= {
            f"{ours}.attention.norm.scale": get(f"{theirs}.input_layernorm.weight"),
            f"{ours}.mlp.norm.scale": get(f"{theirs}.post_attention_layernorm.weight"),
            f"{a}.query": get(f"{theirs}.self_attn.q_proj.weight").T.reshape(D, H, K),
            f"{a}.key": get(f"{theirs}.self_attn.k_proj.weight").T.reshape(D, G, K),
            f"{a}.value": get(f"{theirs}.self_attn.v_proj.weight").T.reshape(D, G, K),
            f"{a}.out": get(f"{theirs}.self_attn.o_proj.weight").T.reshape(H, K, D),
            f"{m}.gate": get(f"{theirs}.mlp.gate_proj.weight").T,
            f"{m}.up": get(f"{theirs}.mlp.up_proj.weight").T,
            f"{m}.down": get(f"{theirs}.mlp.down_proj.weight").T,
        }
    return cfg, {k: np.ascontiguousarray(v) for k, v in flat.items()}


def export_hf_llama(params: dict, cfg: ModelConfig, tokenizer_model: bytes, out: str | Path,
                    overwrite: bool = False) -> Path:
    """Write a `LlamaForCausalLM.from_pretrained`-loadable directory (config.json,
    model.safetensors, generation_config.json, tokenizer files) to `out`, atomically.

    Raises ExportError (naming the features) when `cfg` is not the Llama baseline;
    FileExistsError for a non-empty `out`.
    """
    reason = llama_incompatibility(cfg)
    if reason:
        raise ExportError(reason)
    import safetensors.numpy

    with staged_dir(out, overwrite) as stage:
        ids = write_tokenizer(stage, tokenizer_model)
        file_in(stage, "config.json").write_text(json.dumps(llama_config(cfg, ids), indent=2))
        file_in(stage, "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
             "pad_token_id": ids["pad_token_id"]}, indent=2))
        safetensors.numpy.save_file(to_llama_tensors(params, cfg),
                                    str(file_in(stage, "model.safetensors")),
                                    metadata={"format": "pt"})
    return Path(out)
