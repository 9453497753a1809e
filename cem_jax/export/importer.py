"""`cem-import`: a Hugging Face Llama directory → a baseline run directory, so that training (or
sampling, evaluation, export) can start from existing weights.

The run directory is what `cem-train` writes: config.yaml (the model's architecture,
`LLAMA_FIELDS`, from the Llama's config.json, its vocabulary the embedding's rows, which may be
more than the tokenizer's ids; the other model fields, such as dtype, and the data/optimizer/run
sections from `--config` and overrides, with data.tokenizer set to the run's own tokenizer),
the Llama's tokenizer (its sentencepiece tokenizer.model, else its tokenizer.json, with the
special tokens its tokenizer_config.json names: `cem_jax.data.tokenizers`), and checkpoint 0
(parameters, a fresh optimizer state, step 0, the data iterator at its start). `cem-train` on
that directory resumes from step 0, i.e. fine-tunes the imported weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import safetensors
import safetensors.flax

from cem_jax.config_files import apply_overrides, load_yaml
from cem_jax.data import find_tokenizer, load_tokenizer
from cem_jax.data.tokenizers import saved_names
from cem_jax.export.hf_llama import from_llama
from cem_jax.export.output import ExportError, staged_dir
from cem_jax.export.safetensors_io import unflat_params
from cem_jax.rundir import write_run
from cem_jax.train_config import SECTIONS, config_from_dict

# The model fields set by the Llama's config.json (a config's own values of them are replaced).
LLAMA_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "activation", "tie_attention", "tie_mlp", "preconditioner", "steps",
                "position", "rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position", "norm_eps",
                "tie_embeddings")


def files(tokenizer_file: str) -> tuple[str, ...]:
    """What the import of a Llama whose tokenizer is `tokenizer_file` writes (`write_run`)."""
    return ("config.yaml", *saved_names(tokenizer_file), "checkpoints")


def read_llama_dir(directory: str | Path) -> tuple[dict, dict]:
    """(config.json dict, {name: numpy array}) of a Hugging Face Llama directory (one
    model.safetensors or a sharded one with model.safetensors.index.json; never pickle; in the
    file's dtype, bfloat16 included: read through JAX, numpy has no bfloat16 of its own).
    Raises ExportError when it is not a Llama, has no safetensors weights, or one of its files
    is not valid JSON or safetensors (the message names the file)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ExportError(f"{directory} has no config.json: not a Hugging Face model directory")
    config = _read_json(directory / "config.json")
    if config.get("model_type") != "llama":
        raise ExportError(f"{directory} holds model_type {config.get('model_type')!r}; only "
                          f"'llama' can be imported as a baseline")
    index = directory / "model.safetensors.index.json"
    files = (sorted(set(_read_json(index)["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    tensors: dict = {}
    for name in files:
        path = directory / name
        if not path.is_file() or path.resolve().parent != directory.resolve():
            raise ExportError(f"{directory} lacks safetensors weights {name!r} (pickled "
                              f"pytorch_model.bin files are not read)")
        try:
            tensors |= {k: np.asarray(v) for k, v in
                        safetensors.flax.load_file(str(path)).items()}
        except safetensors.SafetensorError as err:
            raise ExportError(f"{path} is not a readable safetensors file ({err}): it may be "
                              f"truncated; download it again") from None
    return config, tensors


def _read_json(path: Path) -> dict:
    """The JSON object in `path`; raises ExportError naming the file when it holds none."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ExportError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def import_llama(hf_dir: str | Path, out: str | Path, config_path: str | Path | None = None,
                 overrides: list[str] = (), overwrite: bool = False) -> Path:
    """Write a baseline run directory `out` from the Llama in `hf_dir` (atomically); a note on
    stderr names the `LLAMA_FIELDS` of the config's model section, which are not used.

    Raises ExportError (not an importable Llama), FileNotFoundError (neither tokenizer.model
    nor tokenizer.json: the run needs the Llama's tokenizer), ValueError (an invalid config, a
    tokenizer with more ids than the embedding has rows, or an override of one of
    `LLAMA_FIELDS`, which come from the Llama's config.json), FileExistsError (an `out` it may
    not replace: `output.check_destination`).
    """
    fixed = [o for o in overrides if o.partition("=")[0] in {f"model.{n}" for n in LLAMA_FIELDS}]
    if fixed:
        raise ValueError(f"{', '.join(fixed)}: the model's architecture comes from the Hugging "
                         f"Face config.json in {hf_dir} and cannot be overridden (other model "
                         f"fields, such as model.dtype, can)")
    hf_dir = Path(hf_dir)
    llama_cfg, tensors = read_llama_dir(hf_dir)
    model_cfg, flat = from_llama(llama_cfg, tensors)
    tokenizer = load_tokenizer(find_tokenizer(hf_dir), model_cfg.vocab_size)
    values = load_yaml(config_path) if config_path is not None else {}
    model = values.get("model")
    if ignored := [n for n in LLAMA_FIELDS if isinstance(model, dict) and n in model]:
        print(f"cem-import: note: model.{', model.'.join(ignored)} of {config_path} ignored: "
              f"the architecture comes from the Hugging Face config.json in {hf_dir}",
              file=sys.stderr)
    values = apply_overrides(values, list(overrides), SECTIONS)
    with staged_dir(out, overwrite, files(tokenizer.file_name)) as stage:
        final = Path(out).absolute()
        values["model"] = {**(values.get("model") or {}),
                           **{n: getattr(model_cfg, n) for n in LLAMA_FIELDS}}
        values["data"] = {**(values.get("data") or {}), "vocab_size": None,  # the tokenizer's
                          "tokenizer": str(final / tokenizer.file_name)}
        values["run"] = {**(values.get("run") or {}), "dir": str(final)}
        cfg = config_from_dict(values)
        params = unflat_params({k: v.astype(cfg.model.param_dtype) for k, v in flat.items()},
                               cfg.model)
        write_run(stage, cfg, params, tokenizer)
    return Path(out)
