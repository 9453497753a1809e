"""A sub-layer kind of a user's (tests/train/plugin_kind.py, outside cem_jax: parameters and an
energy, no closed form) is a layer like the built-in ones: its update is -jax.grad of its
energy, P times that with a preconditioner, cem-train trains and resumes it, a fresh process
samples from the run, and the hf export refuses it in one line."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import plugin_kind  # noqa: F401  (registers the kind "logcosh_pull")
import pytest
import yaml
from flax import nnx
from train_helpers import REPO, run_cli, train_losses

from cem_jax.config import ModelConfig
from cem_jax.kinds import Context, Kind, Param, check_kind, get_kind, register_kind
from cem_jax.layers import SubLayer
from cem_jax.model import CEMTransformer, init_cache
from cem_jax.numerics import rms_norm
from cem_jax.train import load_config, train
from cem_jax.updates import Mixer

HERE = Path(__file__).parent


@pytest.mark.parametrize("impl", ["xla", "autodiff"])
@pytest.mark.parametrize("preconditioner,p", [("none", 1.0), ("scalar", 0.05), ("diag", None)])
def test_the_update_is_p_times_minus_the_energy_gradient(impl, preconditioner, p):
    cfg = ModelConfig(d_model=16, num_heads=2, mlp_dim=24, mlp_kind="logcosh_pull", impl=impl,
                      preconditioner=preconditioner)
    kind = get_kind("logcosh_pull")
    sub = SubLayer(cfg, kind, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    if preconditioner == "scalar":  # P = softplus(ρ) = 0.05, far from the identity it starts at
        sub.precond.rho[...] = jnp.asarray(math.log(math.expm1(0.05)))
    elif preconditioner == "diag":
        sub.precond.rho[...] = jnp.asarray(rng.normal(size=16) - 2.0, jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    params = sub.mixer.values(jnp.float32)
    y = rms_norm(x, sub.norm.scale[...], cfg.norm_eps)
    oracle = -jax.grad(lambda y_: kind.energy(params, y_, y, Context(cfg)).sum())(y)
    scale = p if p is not None else jax.nn.softplus(sub.precond.rho[...])
    (got, _), sown = nnx.capture(sub, nnx.Intermediate)(x, monitor=True)
    (energies,) = sown["energies"].get_value()
    np.testing.assert_allclose(got - x, scale * oracle, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(oracle).max()) > 1e-3  # a real update, not zero
    # the monitor records the kind's own energy before the step
    np.testing.assert_allclose(energies[0, 0], kind.energy(params, y, y, Context(cfg)),
                               rtol=1e-6)


def _env() -> dict[str, str]:
    """PYTHONPATH with this folder first: where the user's module is found."""
    return {**os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_cem_train_trains_resumes_and_a_fresh_process_samples(tiny_overrides, tmp_path):
    config = tmp_path / "kind.yaml"
    config.write_text(yaml.safe_dump({"imports": ["plugin_kind"],
                                      "model": {"mlp_kind": "logcosh_pull"}}))
    run_dir = tmp_path / "run"
    args = ["--config", str(config), *tiny_overrides, f"run.dir={run_dir}",
            "run.checkpoint_every=3"]
    result = run_cli([*args, "run.steps=3"], env=_env())
    assert result.returncode == 0, result.stderr
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["imports"] == ["plugin_kind"]
    assert saved["model"]["mlp_kind"] == "logcosh_pull"
    result = run_cli([*args, "run.steps=5"], env=_env())  # resumes from checkpoint 3
    assert result.returncode == 0, result.stderr
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert all(np.isfinite(v) for v in losses.values())

    loaded = subprocess.run(
        [sys.executable, "-c",
         "import sys; from cem_jax.rundir import load_run; run = load_run(sys.argv[1]); "
         "w = run.params['blocks']['mlp']['mixer']['w']; print(run.config.model.mlp_kind, "
         "tuple(w.shape))", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=_env())
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["logcosh_pull", "(2,", "32,", "64)"]
    sample = subprocess.run([sys.executable, "-m", "cem_jax.cli.sample", "--run", str(run_dir),
                             "--max-new-tokens", "5", "--temperature", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env=_env())
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.strip()
    export = subprocess.run(
        [sys.executable, "-c", "import sys; from cem_jax.cli.export import main; sys.exit(main())",
         "--run", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")], cwd=REPO,
        capture_output=True, text=True, timeout=300, env=_env())
    assert export.returncode == 2
    assert "sub-layer kind 'logcosh_pull' is not built in" in export.stderr
    assert len(export.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()

    # the module changed since the run was written: a parameter renamed, or of another shape
    source = (HERE / "plugin_kind.py").read_text()
    for name, changed, want in (
            ("renamed", source.replace('"u": Param', '"v": Param').replace('p["u"]', 'p["v"]'),
             "it has no ['blocks']['mlp']['mixer']['v']"),
            ("reshaped", source.replace('"w": Param((cfg.d_model, cfg.mlp_dim)',
                                        '"w": Param((cfg.d_model, 2 * cfg.mlp_dim)'),
             "not compatible with the stored shape")):
        assert changed != source
        (tmp_path / name).mkdir()
        (tmp_path / name / "plugin_kind.py").write_text(changed)
        loaded = subprocess.run(
            [sys.executable, "-c", "import sys; from cem_jax.rundir import load_run; "
             "load_run(sys.argv[1])", str(run_dir)], cwd=REPO, capture_output=True, text=True,
            timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(tmp_path / name), os.environ.get("PYTHONPATH", "")])})
        assert loaded.returncode == 1
        last = loaded.stderr.strip().splitlines()[-1]
        assert "holds other parameters than the model of config.yaml builds" in last, last
        assert want in last and "delete" not in last, last


@pytest.mark.slow
def test_the_readme_kind_trains_a_model_in_a_fresh_process(tmp_path):
    readme = (REPO / "README.md").read_text()
    code = "# my_energies.py" + readme.split("```python\n# my_energies.py")[1].split("```")[0]
    assert len(code.strip().splitlines()) <= 15  # the README's promise: a kind in ≤ 15 lines
    (tmp_path / "my_energies.py").write_text(code)
    script = """
import jax, jax.numpy as jnp, optax
from flax import nnx
import my_energies
from cem_jax import CEMTransformer, ModelConfig
cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, mlp_dim=48,
                  mlp_kind="logcosh_pull")
model = CEMTransformer(cfg, rngs=nnx.Rngs(0))
tokens = jnp.tile(jnp.arange(17) % 8, (4, 1))
opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
def loss(m):
    logits = m(tokens[:, :-1]).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
@nnx.jit  # one compiled step (30 op-by-op steps took minutes on a loaded 2-core CPU)
def step(model, opt):
    opt.update(model, nnx.grad(loss)(model))
first = float(loss(model))
for _ in range(30):
    step(model, opt)
print(first, float(loss(model)), model.blocks.mlp.mixer.w[...].shape)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr
    first, last, shape = result.stdout.split(maxsplit=2)
    assert float(last) < 0.5 * float(first), result.stdout  # it learns the cycle of 8
    assert shape.strip() == "(2, 32, 48)"


def test_a_kind_without_a_cache_that_reads_other_tokens_is_refused_for_decoding():
    # E_t = Σ_s≤t (y_t · c_s): the context of earlier tokens, which cache "none" cannot give
    def energy(p, y, c, ctx):
        return jnp.sum(y * jnp.cumsum(c, axis=1) * p["w"], axis=-1)

    register_kind(Kind("running_sum", "attention",
                       lambda cfg: {"w": Param((cfg.d_model,), ("embed",))}, energy),
                  replace=True)
    cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, mlp_dim=24,
                      attention_kind="running_sum")
    with pytest.raises(ValueError, match="'running_sum' declares cache 'none' but its energy "
                                         "at a token reads the context at other tokens"):
        init_cache(cfg, 1, 8)
    init_cache(dataclasses.replace(cfg, attention_kind=None, mlp_kind="logcosh_pull"), 1, 8)


@pytest.mark.slow
def test_cem_train_refuses_a_kind_that_peeks_ahead_or_drops_a_folded_p():
    cfg = ModelConfig(d_model=16, num_heads=2, mlp_dim=24)
    params = lambda cfg: {"w": Param((cfg.d_model,), ("embed",))}  # noqa: E731

    def peeking(p, y, c, ctx):  # E_t reads c_s for every s, the later ones too
        return jnp.sum(y * p["w"] * jnp.sum(c, axis=1, keepdims=True), axis=-1)

    with pytest.raises(ValueError, match="reads the context of later tokens"):
        check_kind(Kind("peeking", "attention", params, peeking), cfg)

    def summed(p, y, c, ctx):  # one energy for the whole sequence, not one per token
        return jnp.sum(y * c * p["w"])

    def wide(p, y, c, ctx):  # per feature, not per token
        return y * c * p["w"]

    def broken(p, y, c, ctx):
        return y[:, :, :, 0]

    with pytest.raises(ValueError, match=r"'summed': its energy gives \(\) for y, c \[1, 4, "
                                         r"16\]; E\(params, y, c, ctx\) must give one energy per "
                                         r"token, \[B,T\] \[1, 4\]"):
        check_kind(Kind("summed", "mlp", params, summed), cfg)
    with pytest.raises(ValueError, match=r"'wide': its energy gives \(1, 4, 16\)"):
        check_kind(Kind("wide", "mlp", params, wide), cfg)
    with pytest.raises(ValueError, match=r"'broken': its energy fails on a random input y, c "
                                         r"\[1, 4, 16\]: IndexError: Too many indices"):
        check_kind(Kind("broken", "mlp", params, broken), cfg)

    def ignores_p(p, ctx):  # a closed form that never reads params["out_scale"]
        return Mixer(lambda c, index: c, lambda y, c: y * p["w"], None)

    with pytest.raises(ValueError, match="declares folds_preconditioner but its mixer's update "
                                         "does not scale with params\\['out_scale'\\]"):
        check_kind(Kind("ignores_p", "mlp", params, mixer=ignores_p,
                        folds_preconditioner=True), cfg)
    def plain(p, y, c, ctx):
        return jnp.sum(y * c * p["w"], axis=-1)

    for axes in (("embedding",), ("embed", None)):  # an unknown name; one too many
        with pytest.raises(ValueError, match=re.escape(
                f"sub-layer kind 'odd_axes': parameter 'w' of shape (16,) names logical axes "
                f"{axes}; give one per dimension, each one of embed, vocab,")):
            check_kind(Kind("odd_axes", "mlp", lambda cfg, a=axes: {"w": Param((16,), a)},
                            plain), cfg)
    register_kind(Kind("odd_axes", "mlp", lambda cfg: {"w": Param((16,), ("embedding",))},
                       plain), replace=True)  # a notebook builds the model: the same words
    with pytest.raises(ValueError, match=re.escape(
            "sub-layer kind 'odd_axes': parameter 'w' of shape (16,) names logical axes "
            "('embedding',)")):
        nnx.eval_shape(lambda: CEMTransformer(dataclasses.replace(cfg, mlp_kind="odd_axes"),
                                              rngs=nnx.Rngs(0)))
    check_kind(get_kind("logcosh_pull"), cfg)  # the plugin's kind passes
    for name in ("cem_attention", "cem_dplr_attention", "cem_mlp", "swiglu"):
        check_kind(get_kind(name), dataclasses.replace(cfg, num_heads=2))  # and the built-ins


@pytest.mark.slow
def test_the_dry_run_refuses_a_kind_with_an_unknown_logical_axis(tiny_overrides, tmp_path):
    source = (HERE / "plugin_kind.py").read_text()
    (tmp_path / "plugin_kind.py").write_text(source.replace('("embed", "mlp")),\n',
                                                            '("embed", "hidden")),\n', 1))
    config = tmp_path / "kind.yaml"
    config.write_text(yaml.safe_dump({"imports": ["plugin_kind"],
                                      "model": {"mlp_kind": "logcosh_pull"}}))
    for extra in ([], ["--target", "tpu-v5p-8"]):
        result = run_cli(["--config", str(config), *tiny_overrides, "--dry-run", *extra],
                         env={"PYTHONPATH": str(tmp_path)})
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            "cem-train: error: sub-layer kind 'logcosh_pull': parameter 'w' of "
            "shape (32, 64) names logical axes ('embed', 'hidden'); give one per dimension, "
            "each one of embed, vocab, heads, kv_heads, mlp, norm or None (replicated) "
            "(exit status 2)"]


@pytest.mark.slow
def test_a_kind_that_cannot_decode_trains_and_skips_its_sample(tiny_overrides, tmp_path,
                                                                 caplog):
    # causal, but E_t reads every c_s (s ≤ t): no decode cache can give it that context
    def running_sum(p, y, c, ctx):
        return jnp.sum(y * jnp.cumsum(c, axis=1) * p["w"], axis=-1) / c.shape[1]

    register_kind(Kind("running_mean", "attention",
                       lambda cfg: {"w": Param((cfg.d_model,), ("embed",))}, running_sum),
                  replace=True)
    with caplog.at_level(logging.WARNING, logger="cem_jax"):
        summary = train(load_config(None, [*tiny_overrides, f"run.dir={tmp_path / 'run'}",
                                           "run.steps=2", "model.attention_kind=running_mean"]))
    assert summary["step"] == 2 and summary["sample"] == ""
    assert any("no sample: sub-layer kind 'running_mean' declares cache 'none'" in r.getMessage()
               for r in caplog.records)
