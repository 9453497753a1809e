"""The shipped configs (every YAML under configs/ loads; a stated `expected_params` is the
model's exact count; the ~100M set varies one thing at a time) and `cem-train --dry-run`
(compiles one step on abstract inputs, prints memory and FLOPs, reads and writes nothing)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import jax
import pytest
from flax import nnx
from train_helpers import REPO, run_cli

from cem_jax.cli.train import main
from cem_jax.model import CEMTransformer, count_params
from cem_jax.train import load_config, train
from cem_jax.train.dry_run import dry_run
from cem_jax.train.sizing import check_batch_split, check_expected_params

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
FULL = REPO / "configs" / "cem_full_100m.yaml"
GIB = 2**30
# How each config of the ~100M set differs from cem_full_100m's model section.
SET_100M = {
    "llama_100m": {"tie_attention": False, "tie_mlp": False, "preconditioner": "none"},
    "cem_attn_100m": {"tie_mlp": False},
    "cem_mlp_100m": {"tie_attention": False},
    "cem_full_100m": {},
    "cem_dplr_100m": {"interaction": "dplr"},
    "cem_precond_diag_100m": {"preconditioner": "diag"},
    "cem_precond_dplr_100m": {"preconditioner": "dplr"},
    "cem_steps2_100m": {"steps": 2},
}


def abstract_count(model_cfg) -> dict[str, int]:
    """count_params of the model built with shapes only (nothing 100M-sized allocated)."""
    return count_params(nnx.eval_shape(lambda: CEMTransformer(model_cfg, rngs=nnx.Rngs(0))))


def test_the_100m_set_is_shipped():
    names = {p.stem for p in CONFIGS}
    assert set(SET_100M) <= names
    assert {"shakespeare_cem", "shakespeare_llama"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_its_stated_count_is_the_models(path):
    cfg = load_config(path)
    # one vocabulary setting: a tokenizer trained has the model's size, a given one its own
    assert cfg.data.vocab_size == (cfg.model.vocab_size if cfg.data.tokenizer is None else None)
    if path.stem not in SET_100M:
        return
    counts = abstract_count(cfg.model)
    assert cfg.expected_params == counts["total"]
    assert check_expected_params(cfg) == counts
    # the header's figures are the config's own (the budget is stated once, in the base's)
    header = path.read_text() + FULL.read_text()
    stated_m = float(re.search(r"# Parameters: ([\d.]+)M = ", header).group(1))
    assert stated_m == round(counts["total"] / 1e6, 2)
    steps, rows, tokens = (int(x.replace(",", "")) for x in re.search(
        r"Budget: ([\d,]+) steps x ([\d,]+) rows x ([\d,]+) tokens", header).groups())
    assert (steps, rows, tokens) == (cfg.run.steps, cfg.data.batch_size, cfg.data.seq_len)
    # a wrong stated count is refused with both numbers
    wrong = dataclasses.replace(cfg, expected_params=counts["total"] + 1)
    with pytest.raises(ValueError, match=rf"expected_params = {counts['total'] + 1:,} but the "
                                         rf"model section builds {counts['total']:,} "):
        check_expected_params(wrong)


# The scale ladder's larger rungs (docs/pod_training.md): Llama 3.2 1B's and Llama 3 8B's
# shapes, tied and the Llama twin: (D, L, H, G, K, F).
LADDER = {"cem_full_1b": (2048, 16, 32, 8, 64, 8192), "llama_1b": (2048, 16, 32, 8, 64, 8192),
          "cem_full_8b": (4096, 32, 32, 8, 128, 14336),
          "llama_8b": (4096, 32, 32, 8, 128, 14336)}


@pytest.mark.parametrize("name", LADDER)
def test_the_ladder_configs_state_their_shapes_and_counts(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    m = cfg.model
    assert (m.d_model, m.num_layers, m.num_heads, m.kv_heads, m.head_width, m.mlp_dim) == \
        LADDER[name]
    assert (m.tie_attention, m.tie_mlp) == ((True, True) if name.startswith("cem") else
                                           (False, False))
    counts = abstract_count(m)
    assert cfg.expected_params == counts["total"]
    stated = re.search(r"# Parameters: ([\d.]+)M = ", (REPO / "configs" / f"{name}.yaml")
                       .read_text()).group(1)
    assert float(stated) == round(counts["total"] / 1e6, 2)


def test_the_100m_set_varies_one_thing_at_a_time():
    full = load_config(FULL)
    m = full.model
    assert (m.d_model, m.num_layers, m.num_heads, m.head_width, m.kv_heads, m.mlp_dim,
            m.vocab_size) == (768, 12, 12, 64, 12, 2048, 32768)
    assert (full.data.seq_len, m.dtype, m.param_dtype) == (1024, "bfloat16", "float32")
    assert full.mesh.data == -1 and 3e-4 <= full.optimizer.lr <= 6e-4
    for name, change in SET_100M.items():
        cfg = load_config(REPO / "configs" / f"{name}.yaml")
        assert {k: getattr(cfg.model, k) for k in change} == change, name
        assert dataclasses.replace(cfg.model, **{k: getattr(m, k) for k in change}) == m, name
        assert (cfg.data, cfg.optimizer, cfg.mesh) == (full.data, full.optimizer, full.mesh)
        assert cfg.run == dataclasses.replace(full.run, dir=f"runs/{name}"), name
    counts = {name: abstract_count(load_config(REPO / "configs" / f"{name}.yaml").model)
              for name in ("llama_100m", "cem_full_100m")}
    llama, cem = counts["llama_100m"], counts["cem_full_100m"]
    assert cem["attention"] * 2 == llama["attention"]  # Wv = Wk, Wo = Wqᵀ
    assert cem["mlp"] * 3 == llama["mlp"] * 2  # Wdown = Wgᵀ


@pytest.mark.parametrize("value", ["0", "-5", "true", "1.5e8", "many"])
def test_expected_params_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="expected_params"):
        load_config(None, [f"expected_params={value}"])


def test_unknown_top_level_key_is_named():
    with pytest.raises(ValueError, match=r"expected_parms.*expected_params"):
        load_config(None, ["expected_parms=5"])


def test_train_refuses_a_wrong_count_before_writing(tmp_path):
    cfg = load_config(FULL, ["expected_params=77089561", f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"77,089,561 but the model section builds 77,089,560 "
                                         r".*expected_params: 77089560"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_dry_run_with_a_wrong_count_exits_2_naming_both(capsys):
    assert main(["--config", str(FULL), "--dry-run", "expected_params=1000"]) == 2
    err = capsys.readouterr().err
    assert "expected_params = 1,000 but the model section builds 77,089,560" in err


def test_dry_run_flops_agree_with_xla_and_arguments_are_the_state(tmp_path):
    """A small unscanned model with the loss in one chunk (XLA counts a loop's body once): XLA's
    FLOPs of the compiled step are the analytic count within a few percent (the analytic count
    leaves out norms, softmax and activations), for two steps, DPLR interaction and a DPLR
    preconditioner."""
    cfg = load_config(REPO / "configs" / "shakespeare_cem.yaml",
                      ["data.batch_size=8", "model.scan_layers=false", "model.loss_chunks=1",
                       "model.steps=2",
                       "model.interaction=dplr", "model.preconditioner=dplr",
                       f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"])
    lines = []
    report = dry_run(cfg, echo=lines.append)
    assert 0.95 < report["flops"]["xla_per_device"] / report["flops"]["analytic_per_device"] < 1.1
    n = jax.device_count()  # mesh data=-1: parameters replicated, the batch split
    params = report["params"]["total"]
    expected = 3 * 4 * params + 4 * (8 // n) * cfg.data.seq_len * 4  # params, Adam mu, nu; batch
    assert report["memory"]["arguments"] == pytest.approx(expected, rel=0.01)
    assert report["memory"]["aliased"] == pytest.approx(3 * 4 * params, rel=0.01)  # donated
    assert any(line.startswith("memory per device: arguments") for line in lines)
    assert list(tmp_path.iterdir()) == []


def test_batch_split_over_data_and_fsdp_is_checked():
    cfg = load_config(FULL, ["data.batch_size=48", "optimizer.accumulation_steps=2"])
    assert check_batch_split(cfg, SimpleNamespace(shape={"data": 2, "fsdp": 4})) == 24
    with pytest.raises(ValueError, match="24 rows .* data×fsdp = 16 devices"):
        check_batch_split(cfg, SimpleNamespace(shape={"data": 4, "fsdp": 4}))


def _parse(pattern: str, text: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the output:\n{text}"
    return match.groups()


@pytest.mark.slow
def test_dry_run_of_the_100m_model_on_8_devices(tmp_path):
    """`cem-train --config configs/cem_full_100m.yaml --dry-run` on 8 host devices: no data
    (the config's dataset is a placeholder), nothing written; the numbers are the model's."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    result = run_cli(["--config", str(FULL), "--dry-run", f"run.dir={run_dir}",
                      f"data.cache_dir={cache}"],
                     env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                          "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert not run_dir.exists() and not cache.exists()

    P, D, L, F, V, N, B = 77_089_560, 768, 12, 2048, 32768, 1024, 512
    assert _parse(r"mesh: data=(\d+) fsdp=(\d+) tensor=(\d+) \((\d+) cpu devices", out) == \
        ("8", "1", "1", "8")
    assert f"parameters: {P:,} = embedding 25,165,824 + attention 14,155,776" in out
    assert "(expected_params 77,089,560: matches)" in out
    assert f"{B} rows x {N} tokens = {B * N:,} tokens per step" in out

    line = _parse(r"(memory per device: .*)", out)[0]
    mem = {k: float(v) * GIB for k, v in re.findall(r"(\w+) ([\d.]+) GiB", line)}
    state = 3 * 4 * P  # fp32 params, Adam mu and nu, replicated (mesh data=-1)
    batch = 4 * (B // 8) * N * 4  # inputs, targets, segment_ids, positions: int32 rows
    assert mem["arguments"] == pytest.approx(state + batch, rel=0.01)
    assert mem["aliased"] == pytest.approx(state, rel=0.01)  # the state is donated
    assert mem["outputs"] == pytest.approx(state, rel=0.01)
    logits = (B // 8) * N * V * 4  # fp32 logits of this device's 64 rows: 8 GiB
    assert logits < mem["temp"] < 8 * logits  # not the whole global batch's logits
    assert mem["total"] == pytest.approx(
        mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temp"] + mem["code"],
        abs=0.001 * GIB)

    analytic, per_device = (float(x) for x in _parse(
        r"FLOPs per step \(analytic.*?\): ([\d.e+]+) = .*; ([\d.e+]+) per device", out))
    # tied: q, k and the output (Wqᵀ) are 3 DxD matmuls, the MLP 3 DxF; scores and p·k 4·D·N;
    # the tied output head 2·D·V; training = 3 x forward
    forward = L * (2 * (3 * D * D + 3 * D * F) + 4 * D * N) + 2 * D * V
    assert analytic == pytest.approx(3 * forward * B * N, rel=1e-3)
    assert per_device == pytest.approx(analytic / 8, rel=1e-3)
    xla = float(_parse(r"\(XLA cost_analysis\): ([\d.e+]+)", out)[0])
    assert 0 < xla < per_device  # the layer scan's body is counted once


@pytest.mark.slow
def test_fsdp_keeps_activations_split_over_the_batch(tmp_path):
    """Parameters sharded over "fsdp" (mesh.fsdp=8, 8 host devices), a small model: the
    compiled step's temporaries stay far below the fp32 logits of the whole global batch, which
    is what every device computed when the activations followed the D-sharded tied head instead
    of the batch (`cem_jax.sharding.constrain`; without it temp is ~0.27 GiB here)."""
    B, N, V = 64, 128, 4096
    result = run_cli(["--config", str(FULL), "--dry-run", "expected_params=null",
                      "model.d_model=64", "model.num_layers=2", "model.num_heads=4",
                      "model.head_dim=16", "model.mlp_dim=128", f"model.vocab_size={V}",
                      f"data.vocab_size={V}", f"data.batch_size={B}", f"data.seq_len={N}",
                      "mesh.data=1", "mesh.fsdp=-1", f"run.dir={tmp_path / 'run'}",
                      f"data.cache_dir={tmp_path / 'cache'}"],
                     env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                          "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert _parse(r"mesh: data=(\d+) fsdp=(\d+) tensor=(\d+)", out) == ("1", "8", "1")
    line = _parse(r"(memory per device: .*)", out)[0]
    mem = {k: float(v) * GIB for k, v in re.findall(r"(\w+) ([\d.]+) GiB", line)}
    whole_batch_logits = B * N * V * 4  # 0.125 GiB
    assert mem["temp"] < whole_batch_logits / 2  # measured 0.035 GiB (data=8: 0.036 GiB)
