"""The shipped configs after `base:` inheritance: each resolves to exactly the values its full
file had before (written down below from those files), and no file repeats what its base says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cem_jax.config_files import load_yaml
from cem_jax.train_config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# What each config set apart from the TrainConfig defaults, taken from the full files before
# they became deltas of a base; every other field must resolve to its default. The defaults are
# now the Shakespeare family's values but for model.scan_layers and run.dir
# (`test_the_defaults_train_what_make_train_trains`); the 100M family states the empty
# sample_prompt it had from the defaults before.
SHAKESPEARE = {"model": {"d_model": 128, "num_heads": 2, "mlp_dim": 352, "scan_layers": False},
               "data": {"seq_len": 128}, "optimizer": {"lr": 0.01},
               "run": {"steps": 1500, "eval_every": 250, "checkpoint_every": 250,
                       "sample_prompt": "ROMEO:"}}
SET_100M = {
    "model": {"vocab_size": 32768, "d_model": 768, "num_layers": 12, "num_heads": 12,
              "head_dim": 64, "mlp_dim": 2048, "dtype": "bfloat16", "remat": "full"},
    "data": {"corpus": "gs://YOUR-BUCKET/tokens/fineweb-edu-10bt", "val_fraction": 0.0005,
             "val_tokens": 4000000, "vocab_size": 32768, "seq_len": 1024, "batch_size": 512,
             "num_threads": 4},
    "optimizer": {"lr": 0.0006, "warmup_steps": 2000},
    "run": {"steps": 10000, "log_every": 50, "eval_every": 1000, "eval_batches": 20,
            "checkpoint_every": 1000, "sample_prompt": ""}}
LLAMA = {"tie_attention": False, "tie_mlp": False, "preconditioner": "none"}
# name: (its family's values, its own model fields, expected_params)
CASES = {
    "shakespeare_cem": (SHAKESPEARE, {}, None),
    "shakespeare_llama": (SHAKESPEARE, LLAMA, None),
    "shakespeare_llama_scalar": (SHAKESPEARE, {"tie_attention": False, "tie_mlp": False}, None),
    "shakespeare_cem_attn": (SHAKESPEARE, {"tie_mlp": False}, None),
    "shakespeare_cem_mlp": (SHAKESPEARE, {"tie_attention": False}, None),
    "shakespeare_cem_dplr": (SHAKESPEARE, {"interaction": "dplr"}, None),
    "shakespeare_cem_precond_diag": (SHAKESPEARE, {"preconditioner": "diag"}, None),
    "shakespeare_cem_precond_dplr": (SHAKESPEARE, {"preconditioner": "dplr"}, None),
    "shakespeare_cem_steps2": (SHAKESPEARE, {"steps": 2}, None),
    "cem_full_100m": (SET_100M, {}, 77089560),
    "llama_100m": (SET_100M, LLAMA, 110119680),
    "cem_attn_100m": (SET_100M, {"tie_mlp": False}, 95963928),
    "cem_mlp_100m": (SET_100M, {"tie_attention": False}, 91245336),
    "cem_dplr_100m": (SET_100M, {"interaction": "dplr"}, 77200152),
    "cem_precond_diag_100m": (SET_100M, {"preconditioner": "diag"}, 77107968),
    "cem_precond_dplr_100m": (SET_100M, {"preconditioner": "dplr"}, 77181696),
    "cem_steps2_100m": (SET_100M, {"steps": 2}, 77089560),
}


def _leaves(values: dict, prefix: str = ""):
    """(dotted key, (type name, value)) for every leaf of a nested dict: 1, 1.0 and True differ."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", (type(value).__name__, value)


@pytest.mark.parametrize("name", CASES)
def test_config_resolves_to_the_values_of_its_full_file(name):
    family, model, expected_params = CASES[name]
    want = load_config(None).to_dict()  # the defaults; a field added later stays at its default
    for section, values in family.items():
        want[section].update(values)
    want["model"].update(model)
    want["run"]["dir"] = f"runs/{name}"
    want["expected_params"] = expected_params
    got = load_config(CONFIGS / f"{name}.yaml").to_dict()
    assert dict(_leaves(got)) == dict(_leaves(want))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_no_config_repeats_what_its_base_says(path):
    own = yaml.safe_load(path.read_text(encoding="utf-8"))
    if "base" not in own:
        return
    said = dict(_leaves(load_yaml(path.parent / own.pop("base"))))
    repeated = [key for key, value in _leaves(own) if said.get(key) == value]
    assert not repeated, f"{path.name} repeats what its base says: {repeated}"


def test_variants_are_deltas_of_one_base_per_family():
    bases = {p.stem: yaml.safe_load(p.read_text(encoding="utf-8")).get("base")
             for p in CONFIGS.glob("*.yaml")}
    assert {name: bases[name] for name in CASES} == {
        name: None if name in ("shakespeare_cem", "cem_full_100m") else
        "shakespeare_cem.yaml" if name.startswith("shakespeare") else "cem_full_100m.yaml"
        for name in CASES}


def test_the_defaults_train_what_make_train_trains():
    """`cem-train` without --config trains what `make train` (its TRAIN_CONFIG) trains: the
    same model, data, optimizer and steps; only the layout of the layers (one scan: the
    default for deep models; the file unrolls its 4 small ones, faster on a CPU) differs, so
    its checkpoints go to a directory of their own."""
    makefile = (CONFIGS.parent / "Makefile").read_text(encoding="utf-8")
    assert "TRAIN_CONFIG ?= configs/shakespeare_cem.yaml" in makefile
    want = load_config(CONFIGS / "shakespeare_cem.yaml").to_dict()
    want["model"]["scan_layers"], want["run"]["dir"] = True, "runs/default"
    assert load_config(None).to_dict() == want
