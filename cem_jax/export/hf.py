"""The `hf` export: any CEM variant as a Hugging Face directory with its own PyTorch modeling
code, the ecosystem's way of shipping a new architecture:

    config.json              model_type "cem", auto_map → the two files below, the model fields
    configuration_cem.py     `CEMConfig` (hf_template/, package data)
    modeling_cem.py          `CEMForCausalLM`: an independent PyTorch implementation of
                             DESIGN.md §1 (full score matrices, a transformers DynamicCache
                             for generate), fine-tunable as a transformers model (LoRA,
                             resize_token_embeddings, gradient checkpointing)
    model.safetensors        its state dict (`hf_tensors`): the safetensors export's names,
                             each projection an nn.Linear-style `.weight` [out, in]
    generation_config.json   the special ids (bos = eos = the document start, pad), the ids of
                             a padded vocabulary as suppress_tokens
    tokenizer.model or tokenizer.json, tokenizer_config.json   (`hf_tokenizer`: the run's
                             tokenizer; prompts start with EOS, as in training and cem-sample)

Load both with `trust_remote_code=True` (only for directories you trust: it runs the shipped
Python): `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` and
`AutoTokenizer.from_pretrained(dir, trust_remote_code=True)` (the tokenizer is a plain
`LlamaTokenizer` or `PreTrainedTokenizerFast`, but transformers reads config.json and its
`auto_map` first: without the flag it asks whether to run the code and warns that a `cem`
config was read as another type).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import numpy as np

from cem_jax.config import BUILT_IN_KINDS, ModelConfig
from cem_jax.data import Tokenizer
from cem_jax.export.hf_tokenizer import suppress_padded, tokenizer_files, write_tokenizer
from cem_jax.export.output import ExportError, file_in, staged_dir, write_safetensors
from cem_jax.export.safetensors_io import WEIGHTS, flat_params

TEMPLATE_FILES = ("configuration_cem.py", "modeling_cem.py")
# ModelConfig fields that choose an implementation or a layout, not the function computed.
IMPLEMENTATION_FIELDS = ("impl", "attention_block", "dtype", "param_dtype", "scan_layers",
                         "remat", "loss_chunks")


def files(tokenizer_file: str) -> tuple[str, ...]:
    """What the export of a run whose tokenizer is `tokenizer_file` writes."""
    return (*tokenizer_files(tokenizer_file), "config.json", "generation_config.json",
            *TEMPLATE_FILES, WEIGHTS)


# The built-in sub-layer kinds as the flags of the shipped modeling code's config.
KIND_FLAGS = {name: flags for kinds in BUILT_IN_KINDS.values() for name, flags in kinds.items()}


def hf_config(cfg: ModelConfig, ids: dict) -> dict:
    """config.json of the `hf` export (the sub-layer kinds as KIND_FLAGS)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in (*IMPLEMENTATION_FIELDS, "attention_kind", "mlp_kind")}
    for kind in cfg.kinds:
        fields |= KIND_FLAGS[kind]
    fields["num_kv_heads"], fields["head_dim"] = cfg.kv_heads, cfg.head_width
    return {"architectures": ["CEMForCausalLM"], "model_type": "cem",
            "auto_map": {"AutoConfig": "configuration_cem.CEMConfig",
                         "AutoModelForCausalLM": "modeling_cem.CEMForCausalLM"},
            "dtype": cfg.param_dtype, **fields, **ids}


# The projections among the safetensors export's names, by where their model axis D is: first
# (query [D,H,K], key and value [D,G,K], gate and up [D,F], lm_head [D,V]) or last (out [H,K,D],
# down [F,D]). The shipped code's `from_cem_layout` reads this layout in PyTorch.
D_FIRST = ("lm_head", "query", "key", "value", "gate", "up")
D_LAST = ("out", "down")


def hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters → the state dict of the shipped `CEMForCausalLM`: the safetensors
    export's names (`safetensors_io`), `embed` as `embed.weight` [V,D] and each projection as
    `<name>.weight` [out, in] (query [D,H,K] → [H·K, D], out [H,K,D] → [D, H·K], ...); norms,
    preconditioners and DPLR diagonals as they are."""
    out = {}
    for name, value in flat_params(params, cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed":
            out["embed.weight"] = value
        elif leaf in D_FIRST:
            out[f"{name}.weight"] = np.ascontiguousarray(value.reshape(cfg.d_model, -1).T)
        elif leaf in D_LAST:
            out[f"{name}.weight"] = np.ascontiguousarray(value.reshape(-1, cfg.d_model).T)
        else:
            out[name] = value  # C-ordered (flat_params), 0-d kept 0-d
    return out


def export_hf(params: dict, cfg: ModelConfig, tokenizer: Tokenizer, out: str | Path,
              overwrite: bool = False) -> Path:
    """Write the `hf` export of a model and its tokenizer to directory `out`, atomically;
    config.json's vocab_size is the model's (which may be padded past the tokenizer's, see
    `hf_tokenizer`). Raises ExportError for
    a model the shipped modeling code cannot run (a sub-layer kind of a user's, an activation
    registered in this process) (bfloat16 parameters are exported as they
    are; the code computes in the parameters' dtype); FileExistsError for an `out` it may not
    replace (`output.check_destination`)."""
    for kind in cfg.kinds:
        if kind not in KIND_FLAGS:
            raise ExportError(f"sub-layer kind {kind!r} is not built in: the hf format's "
                              f"modeling code runs {', '.join(KIND_FLAGS)} only; export with "
                              f"--format safetensors")
    if cfg.activation not in ("silu", "gelu", "relu"):
        raise ExportError(f"activation {cfg.activation!r} has no PyTorch counterpart here")
    template = resources.files("cem_jax.export") / "hf_template"
    with staged_dir(out, overwrite, files(tokenizer.file_name)) as stage:
        ids = write_tokenizer(stage, tokenizer)
        file_in(stage, "config.json").write_text(json.dumps(hf_config(cfg, ids), indent=2))
        file_in(stage, "generation_config.json").write_text(json.dumps(
            {**ids, **suppress_padded(tokenizer, cfg.vocab_size)}, indent=2))
        for name in TEMPLATE_FILES:
            file_in(stage, name).write_text((template / name).read_text())
        write_safetensors(stage, WEIGHTS, hf_tensors(params, cfg), {"format": "pt"})
    return Path(out)
