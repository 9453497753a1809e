"""The `safetensors` export: `model.safetensors`, `config.json` and the run's tokenizer as the
run directory holds it (`tokenizer.model`, or `tokenizer.json` and `tokenizer_config.json`).

Tensor names (stable; shapes in the model's own layout, fp32 or the run's param dtype):

    embed                                  [V,D]
    lm_head                                [D,V]        absent with tie_embeddings
    final_norm.scale                       [D]
    layers.{i}.attention.norm.scale        [D]
    layers.{i}.attention.mixer.query       [D,H,K]
    layers.{i}.attention.mixer.key         [D,G,K]
    layers.{i}.attention.mixer.value       [D,G,K]      baseline (untied) only
    layers.{i}.attention.mixer.out         [H,K,D]      baseline (untied) only
    layers.{i}.attention.mixer.diag        [H,D] or [D] DPLR only (per_head or shared)
    layers.{i}.{attention,mlp}.precond.rho []  or [D]   scalar, diag or dplr preconditioner
    layers.{i}.{attention,mlp}.precond.U   [D,r]        dplr preconditioner only
    layers.{i}.mlp.norm.scale              [D]
    layers.{i}.mlp.mixer.gate              [D,F]
    layers.{i}.mlp.mixer.up                [D,F]
    layers.{i}.mlp.mixer.down              [F,D]        baseline (untied) only

i = 0 … L-1 whatever `scan_layers` is. `config.json` = {"format": "cem_jax",
"format_version": 1, "model": every `ModelConfig` field}. The `hf` export's weights are these
names with `embed` and each projection a PyTorch `.weight` [out, in] (`hf.hf_tensors`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy

from cem_jax.config import ModelConfig
from cem_jax.config_files import from_dict
from cem_jax.data import Tokenizer, find_tokenizer, load_tokenizer
from cem_jax.data.tokenizers import saved_names
from cem_jax.export.output import ExportError, file_in, staged_dir, write_safetensors
from cem_jax.model import model_from_params

FORMAT, FORMAT_VERSION = "cem_jax", 1
WEIGHTS = "model.safetensors"


def files(tokenizer_file: str) -> tuple[str, ...]:
    """What the export of a run whose tokenizer is `tokenizer_file` writes."""
    return (WEIGHTS, "config.json", *saved_names(tokenizer_file))


def flat_params(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The model's pure parameter dict → {name: numpy array} with the names above."""
    out: dict[str, np.ndarray] = {}
    blocks = params["blocks"]
    for i in range(cfg.num_layers):
        block = jax.tree.map(lambda a, i=i: a[i], blocks) if cfg.scan_layers else blocks[i]
        _flatten(block, f"layers.{i}", out)
    _flatten({k: v for k, v in params.items() if k != "blocks"}, "", out)
    return out


def _flatten(tree, prefix: str, out: dict) -> None:
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            _flatten(value, name, out)
        else:
            out[name] = np.array(value, order="C")  # (ascontiguousarray makes 0-d 1-d)


def unflat_params(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """{name: array} → the model's pure parameter dict (layers stacked when `scan_layers`).
    Raises ExportError when a name is missing or unexpected (shapes are checked on load)."""
    layers: list[dict] = [{} for _ in range(cfg.num_layers)]
    top: dict = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if parts[0] == "layers":
            if not parts[1].isdigit() or int(parts[1]) >= cfg.num_layers:
                raise ExportError(f"tensor {name!r} names a layer the config does not have")
            node, parts = layers[int(parts[1])], parts[2:]
        else:
            node = top
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    first = _shapes(layers[0])
    for i, layer in enumerate(layers):
        for name in sorted(set(first) | set(_shapes(layer))):
            if _shapes(layer).get(name) != first.get(name):
                raise ExportError(f"tensor layers.{i}.{name} has shape "
                                  f"{_shapes(layer).get(name, 'none (missing)')}, layer 0's "
                                  f"has {first.get(name, 'none (missing)')}")
    top["blocks"] = (jax.tree.map(lambda *a: np.stack(a), *layers) if cfg.scan_layers
                     else dict(enumerate(layers)))
    return top


def _shapes(tree: dict, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out |= _shapes(value, name + ".") if isinstance(value, dict) else {name: value.shape}
    return out


def config_json(cfg: ModelConfig) -> dict:
    """The config.json content of the safetensors export."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "model": dataclasses.asdict(cfg)}


def write_weights(directory: Path, params: dict, cfg: ModelConfig, metadata: dict) -> None:
    """Write `model.safetensors` (names above) into `directory`."""
    write_safetensors(directory, WEIGHTS, flat_params(params, cfg), metadata)


def export_safetensors(params: dict, cfg: ModelConfig, tokenizer: Tokenizer, out: str | Path,
                       overwrite: bool = False) -> Path:
    """Write the safetensors export of a model and its tokenizer to directory `out`
    (atomically; see `output.staged_dir`). Returns `out`. Raises FileExistsError for an `out`
    it may not replace."""
    with staged_dir(out, overwrite, files(tokenizer.file_name)) as stage:
        write_weights(stage, params, cfg, {"format": "pt", "cem_jax_format": str(FORMAT_VERSION)})
        file_in(stage, "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")
        tokenizer.save(file_in(stage, tokenizer.file_name))
    return Path(out)


def load_safetensors(directory: str | Path) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Read a safetensors export: (ModelConfig, the model's pure parameter dict, its tokenizer
    or None when it has none). Raises ExportError for a directory that is not one, or whose
    tensors do not fit its config; FileNotFoundError for a missing file; ValueError for a
    tokenizer with more ids than the model's vocabulary."""
    directory = Path(directory)
    meta = json.loads((directory / "config.json").read_text())
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{directory} is not a cem_jax safetensors export (config.json has "
                          f"format {meta.get('format')!r}, version {meta.get('format_version')})")
    cfg = from_dict(ModelConfig, meta["model"], section="model")
    params = unflat_params(safetensors.numpy.load_file(str(directory / WEIGHTS)), cfg)
    try:
        model_from_params(cfg, params)
    except ValueError as err:
        raise ExportError(f"{directory / WEIGHTS} does not fit its config.json: {err}") from None
    try:
        path = find_tokenizer(directory)
    except FileNotFoundError:
        return cfg, params, None
    return cfg, params, load_tokenizer(path, cfg.vocab_size)
