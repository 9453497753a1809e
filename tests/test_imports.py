"""The import contracts of pyproject.toml (`lint-imports`: the config modules and the commands'
argument parsers load no JAX, the model's modules import one way, no package or module imports
in a circle), what importing a config module loads in a fresh process, and that every command
answers `--help` without loading JAX."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    result = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert [c.get("ignore_imports") for c in contracts["contracts"]] == [None] * 3  # no way up


def test_the_module_form_of_cem_train_runs_the_command():
    """`python -m cem_jax.cli.train` is cem-train (the library has no `python -m` shim that
    imports the commands from below them)."""
    result = subprocess.run([sys.executable, "-m", "cem_jax.cli.train", "--config",
                             "nothere.yaml"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("cem-train: configuration error: config file 'nothere.yaml' does "
                             "not exist (exit status 2)\n")
    assert not (REPO / "cem_jax" / "train" / "__main__.py").exists()


@pytest.mark.parametrize("module", ["cem_jax.config", "cem_jax.data.config",
                                    "cem_jax.train_config"])
def test_a_config_module_loads_no_jax(module):
    code = (f"import json, sys, {module}; print(json.dumps(sorted(m for m in sys.modules if "
            f"m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'numpy', 'grain'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "tensorstore", "scipy", "torch")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_command_answers_help_before_it_imports_jax(script):
    """`cem-X --help` runs its entry point (pyproject.toml [project.scripts]) in a fresh process:
    status 0, its usage printed, and none of the heavy libraries imported (a --help that loads
    JAX takes seconds)."""
    module, function = SCRIPTS[script].split(":")
    code = (f"import json, sys; sys.argv = [{script!r}, '--help']\n"
            f"from {module} import {function}\n"
            f"try:\n    status = {function}()\nexcept SystemExit as stop:\n"
            f"    status = stop.code\n"
            f"print(json.dumps([status, sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {HEAVY!r})]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    *usage, last = result.stdout.splitlines()
    assert f"usage: {script} " in "\n".join(usage)
    assert json.loads(last) == [0, []], last


@pytest.mark.parametrize("command,args,error,heavy", [
    ("train", ["--config"], "cem-train: configuration error: config file '{}' does not exist "
                            "(exit status 2)", HEAVY),
    ("study", [], "cem-study: error: {} does not exist: give the study's YAML file, e.g. "
                  "docs/study/study.yaml", tuple(m for m in HEAVY if m != "scipy"))])
def test_a_command_refuses_a_missing_file_before_it_imports_jax(tmp_path, command, args, error,
                                                                 heavy):
    """A config or study file error is the user's to fix at once: one line and status 2,
    without the seconds of importing JAX (it was imported before the file was read). A study
    file's seeds are planned with scipy (`cem_jax.stats`), which loads in a fraction of that."""
    missing = str(tmp_path / "nope.yaml")
    code = (f"import json, sys\nfrom cem_jax.cli.{command} import main\n"
            f"status = main({[*args, missing]!r})\n"
            f"print(json.dumps([status, sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {heavy!r})]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert json.loads(result.stdout.splitlines()[-1]) == [2, []], result.stdout
    assert result.stderr == error.format(missing) + "\n"


@pytest.mark.parametrize("entry,argv,said", [
    ("cem_jax.cli.study:main", ["nothere.yaml"],
     "cem-study: error: nothere.yaml does not exist: give the study's YAML file"),
    ("cem_jax.cli.train:main", ["--config", "nothere.yaml"],
     "cem-train: configuration error: config file 'nothere.yaml' does not exist"),
])
def test_a_missing_file_is_answered_before_the_heavy_libraries_load(entry, argv, said):
    """A command given a file that does not exist says so (status 2) without importing JAX,
    scipy or the other heavy libraries (seconds of start-up on a loaded machine)."""
    module, function = entry.split(":")
    code = (f"import json, sys\nfrom {module} import {function}\n"
            f"status = {function}({argv!r})\n"
            f"print(json.dumps([status, sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {HEAVY!r})]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.stderr.startswith(said), result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [2, []]
