"""The `hf-llama` export (baseline models → `transformers.LlamaForCausalLM`) and its inverse, the
tensors of a Hugging Face Llama → a baseline model's parameters (used by `cem-import`).

Only the baseline is a Llama (DESIGN.md §1): free Wq, Wk, Wv, Wo and gate/up/down, P = I, one
step, gradient taken in the normalized variable, RoPE. A tied CEM model is not one even without
RoPE in the general case (a Hugging Face Llama always rotates; with RoPE, CEM values carry the
relative rotation R_{s-t}); use the `hf` format for it.

Layout: ours query [D,H,K] ↔ q_proj.weight [H·K, D] (Linear weights are [out, in]); out
[H,K,D] ↔ o_proj.weight [D, H·K]; gate/up [D,F] ↔ [F,D]; down [F,D] ↔ [D,F]; lm_head [D,V] ↔
[V,D]. Both sides use the half-split `rotate_half` RoPE, so no permutation of heads is needed.

RoPE: θ and the scaling types default, linear and llama3 (Llama 3.x) travel both ways as
`rope_parameters` (`ModelConfig.rope_*`); a Llama with another type (yarn, dynamic, longrope,
...) is refused on import, naming it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from cem_jax.config import BUILT_IN_KINDS, ROPE_TYPES, ModelConfig
from cem_jax.config_files import ConfigFieldError
from cem_jax.data import Tokenizer
from cem_jax.export.hf_tokenizer import suppress_padded, tokenizer_files, write_tokenizer
from cem_jax.export.output import ExportError, file_in, staged_dir, write_safetensors
from cem_jax.export.safetensors_io import flat_params

ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "relu": "relu"}  # ours → transformers ACT2FN


def files(tokenizer_file: str) -> tuple[str, ...]:
    """What the export of a run whose tokenizer is `tokenizer_file` writes."""
    return (*tokenizer_files(tokenizer_file), "config.json", "generation_config.json",
            "model.safetensors")


def llama_incompatibility(cfg: ModelConfig) -> str | None:
    """Why `cfg` is not a Llama (the features, named), or None if it is one."""
    own = [f"{role}_kind={kind!r} (a sub-layer kind of your own)"
           for role, kind in zip(BUILT_IN_KINDS, cfg.kinds, strict=True)
           if kind not in BUILT_IN_KINDS[role]]
    reasons = list(own)
    attention, mlp = cfg.kinds
    if attention in ("cem_attention", "cem_dplr_attention"):
        reasons.append("tie_attention=true (CEM attention: value tied to key, output to query; "
                       "with RoPE its values carry relative rotations)")
    if mlp == "cem_mlp":
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
            + "; ".join(reasons) + (". Export it with --format safetensors" if own else
                                    ". Export it with --format hf (its own modeling code) or "
                                    "safetensors"))


def llama_config(cfg: ModelConfig, tokenizer_ids: dict[str, int]) -> dict:
    """The `LlamaConfig` fields (config.json) of a baseline `cfg`."""
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    max_positions = 8192  # not a limit of the model; transformers reads it for llama3 only
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        original = cfg.rope_original_max_position
        rope |= {"low_freq_factor": cfg.rope_low_freq_factor,
                 "high_freq_factor": cfg.rope_high_freq_factor,
                 "original_max_position_embeddings": original}
        # the context the scaling stretches to; transformers wants it above the original one
        max_positions = max(max_positions, original + 1, math.ceil(original * cfg.rope_factor))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_width, "hidden_act": ACTIVATIONS[cfg.activation],
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": max_positions,
        "rope_parameters": rope,
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


def llama_rope(config: dict) -> dict:
    """The `ModelConfig` RoPE fields of a Llama config.json, read as transformers (v5) reads
    them: `rope_scaling` (the old name) if set, replaces `rope_parameters`; the type is its
    "rope_type" (old: "type"), default "default"; θ its "rope_theta", else the top-level
    `rope_theta`, else 10000; llama3's pretraining context the top-level
    `original_max_position_embeddings`, else the dict's, else `max_position_embeddings` (2048).
    Raises ExportError naming a type cem_jax does not implement or a missing field."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ExportError(f"rope_parameters = {rope!r} in config.json is not a JSON object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ExportError(f"RoPE scaling rope_type={kind!r} is not supported: cem_jax "
                          f"implements {', '.join(ROPE_TYPES)}")
    fields = {"rope_type": kind, "rope_theta": rope.get("rope_theta",
                                                        config.get("rope_theta", 10000.0))}
    if kind == "default":  # transformers' default RoPE ignores every other key
        return fields
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ExportError(f"partial_rotary_factor={partial} with rope_type={kind!r} is not "
                          f"supported (RoPE rotates every feature here)")
    needed = {"factor": "rope_factor"}
    if kind == "llama3":
        needed |= {"low_freq_factor": "rope_low_freq_factor",
                   "high_freq_factor": "rope_high_freq_factor"}
        rope = {"original_max_position_embeddings": config.get("max_position_embeddings", 2048),
                **rope}
        if "original_max_position_embeddings" in config:
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        fields["rope_original_max_position"] = rope["original_max_position_embeddings"]
    if missing := [k for k in needed if k not in rope]:
        raise ExportError(f"rope_parameters of rope_type={kind!r} lacks {', '.join(missing)}")
    return fields | {ours: rope[theirs] for theirs, ours in needed.items()}


def from_llama(config: dict, tensors: dict[str, np.ndarray]
               ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A Hugging Face Llama (config.json dict, state dict as numpy) → (baseline ModelConfig,
    fp32 tensors under our names: `unflat_params` makes them a model's parameters), the
    function `transformers.LlamaForCausalLM.from_pretrained` computes: RoPE as `llama_rope`;
    the output head `lm_head.weight` unless it is absent (then the embedding; refused when
    `tie_word_embeddings` is false, where transformers would draw a random head) or the
    embedding's equal with `tie_word_embeddings` true (a different one is kept, as
    transformers does).
    Raises ExportError naming a feature we cannot express (biases, a RoPE scaling type,
    another activation), a missing or invalid config key or a missing tensor."""
    problems = [f"{k}=true" for k in ("attention_bias", "mlp_bias") if config.get(k)]
    if config.get("hidden_act", "silu") not in ACTIVATIONS:
        problems.append(f"hidden_act={config.get('hidden_act')!r}")
    if problems:
        raise ExportError("cannot import this Llama as a cem_jax baseline: "
                          + ", ".join(problems) + " not supported")
    required = ("num_attention_heads", "hidden_size", "vocab_size", "num_hidden_layers",
                "intermediate_size")
    if missing := [k for k in required if k not in config]:
        raise ExportError(f"the Llama's config.json lacks {', '.join(missing)}")
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ExportError(f"tie_word_embeddings = {tie!r} in config.json is not true or false")
    head = tensors.get("lm_head.weight")
    if head is None and not tie:
        raise ExportError("the Llama has no lm_head.weight and tie_word_embeddings is false "
                          "(the default): transformers would draw its output head at random; "
                          "set \"tie_word_embeddings\": true in config.json if the head is the "
                          "embedding")
    H, D = config["num_attention_heads"], config["hidden_size"]
    tied = head is None or (tie and np.array_equal(head, tensors.get("model.embed_tokens.weight")))
    try:
        cfg = ModelConfig(
            vocab_size=config["vocab_size"], d_model=D, num_layers=config["num_hidden_layers"],
            num_heads=H, num_kv_heads=config.get("num_key_value_heads") or H,
            head_dim=config.get("head_dim") or D // H, mlp_dim=config["intermediate_size"],
            activation=config.get("hidden_act", "silu"), tie_attention=False, tie_mlp=False,
            preconditioner="none", steps=1, position="rope",
            norm_eps=config.get("rms_norm_eps", 1e-6), tie_embeddings=tied,
            **llama_rope(config))
    except ConfigFieldError as err:
        raise ExportError(f"cannot import this Llama's config.json: {err}") from None
    return cfg, _llama_tensors(cfg, tensors, tied)


def _llama_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], tied: bool
                   ) -> dict[str, np.ndarray]:
    """A Llama state dict under our flat names, fp32 and laid out as our parameters (the
    output head only when it is not the embedding); ExportError for a missing tensor."""
    D, H, G, K = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_width

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
    return {k: np.ascontiguousarray(v) for k, v in flat.items()}


def export_hf_llama(params: dict, cfg: ModelConfig, tokenizer: Tokenizer, out: str | Path,
                    overwrite: bool = False) -> Path:
    """Write a `LlamaForCausalLM.from_pretrained`-loadable directory (config.json, its
    vocab_size the model's, which may be padded past the tokenizer's; model.safetensors,
    generation_config.json, the tokenizer's files: `hf_tokenizer`) to `out`, atomically.

    Raises ExportError (naming the features) when `cfg` is not the Llama baseline;
    FileExistsError for an `out` it may not replace (`output.check_destination`).
    """
    reason = llama_incompatibility(cfg)
    if reason:
        raise ExportError(reason)
    with staged_dir(out, overwrite, files(tokenizer.file_name)) as stage:
        ids = write_tokenizer(stage, tokenizer)
        file_in(stage, "config.json").write_text(json.dumps(llama_config(cfg, ids), indent=2))
        file_in(stage, "generation_config.json").write_text(json.dumps(
            {**ids, **suppress_padded(tokenizer, cfg.vocab_size)}, indent=2))
        write_safetensors(stage, "model.safetensors", to_llama_tensors(params, cfg),
                          {"format": "pt"})
    return Path(out)
