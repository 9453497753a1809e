"""A run directory written by an earlier cem_jax (commit 6542a6f: a grain iterator file per
process in each checkpoint, `data.vocab_size` beside `model.vocab_size`; tests/fixtures/
run_6542a6f/README.md says how it was made) resumes with the batch it would have trained on,
and loads, samples and exports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from train_helpers import train_losses

from cem_jax.cli.export import main as export_main
from cem_jax.cli.sample import main as sample_main
from cem_jax.cli.train import main
from cem_jax.rundir import load_run

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_6542a6f"
STEP_3_LOSS = 5.746387481689453  # what commit 6542a6f logged resuming this run


@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """A copy of the fixture, as the working directory (its config's paths are relative)."""
    shutil.copytree(FIXTURE, tmp_path / "old")
    monkeypatch.chdir(tmp_path / "old")
    return tmp_path / "old" / "run"


def test_an_old_run_resumes_with_its_next_batch(old_run, capsys):
    assert main(["--config", "run/config.yaml", "run.log_every=1"]) == 0
    assert "resumed run from step 2" in capsys.readouterr().out
    losses = train_losses(old_run)
    assert sorted(losses) == [2, 3, 4]
    assert losses[3] == pytest.approx(STEP_3_LOSS, rel=1e-6)


def test_an_old_run_loads_samples_and_exports(old_run, tmp_path, capsys):
    run = load_run(old_run)
    assert run.step == 2 and run.config.model.vocab_size == 320
    assert sample_main(["--run", str(old_run), "--max-new-tokens", "4", "--temperature",
                        "0"]) == 0
    assert export_main(["--run", str(old_run), "--format", "safetensors", "--out",
                        str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()
