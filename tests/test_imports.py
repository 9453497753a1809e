"""The import contracts of pyproject.toml (`lint-imports`: the config modules load no JAX, the
model's modules import one way, no package or module imports in a circle), and what importing a
config module loads in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    result = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module", ["cem_jax.config", "cem_jax.data.config",
                                    "cem_jax.train_config"])
def test_a_config_module_loads_no_jax(module):
    code = (f"import json, sys, {module}; print(json.dumps(sorted(m for m in sys.modules if "
            f"m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'numpy', 'grain'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
