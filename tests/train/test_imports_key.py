"""A config's `imports`: a user's module (tests/train/plugin_logcosh.py, outside cem_jax)
registers an activation that `cem-train` trains with, and a fresh `cem-sample` process loads
the run it wrote; a module that cannot be imported is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_helpers import REPO, run_cli

from cem_jax.cli.train import main

HERE = Path(__file__).parent


def _env() -> dict[str, str]:
    """PYTHONPATH with this folder first: where the user's module is found."""
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_a_registered_activation_trains_and_loads_in_a_fresh_process(tiny_overrides, tmp_path):
    config = tmp_path / "logcosh.yaml"
    config.write_text(yaml.safe_dump({"imports": ["plugin_logcosh"],
                                      "model": {"activation": "logcosh"}}))
    run_dir = tmp_path / "run"
    result = run_cli(["--config", str(config), *tiny_overrides, f"run.dir={run_dir}",
                      "run.steps=3"], env=_env())
    assert result.returncode == 0, result.stderr
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["imports"] == ["plugin_logcosh"] and saved["model"]["activation"] == "logcosh"

    sample = subprocess.run([sys.executable, "-m", "cem_jax.cli.sample", "--run", str(run_dir),
                             "--max-new-tokens", "5", "--temperature", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, **_env()})
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.strip()

    # without the module on the path, the run's config names what nothing registered
    sample = subprocess.run([sys.executable, "-m", "cem_jax.cli.sample", "--run", str(run_dir)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert sample.returncode == 2  # a config that cannot be read as it is: not a crash
    assert "imports: module 'plugin_logcosh' cannot be imported" in sample.stderr


def test_an_unknown_or_failing_module_is_one_line(tiny_overrides, tmp_path, capsys,
                                                  monkeypatch):
    assert main([*tiny_overrides, f"run.dir={tmp_path / 'a'}", "imports=[no_such_module]"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "cem-train: configuration error: imports: module 'no_such_module' cannot be imported "
        "(No module named 'no_such_module'); install it or put its folder on PYTHONPATH "
        "(exit status 2)"]
    (tmp_path / "broken_energies.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main([*tiny_overrides, f"run.dir={tmp_path / 'b'}",
                 "imports=[broken_energies]"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "cem-train: configuration error: imports: module 'broken_energies' raised RuntimeError "
        "when imported: boom (python -c 'import broken_energies' shows where) (exit status 2)"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
