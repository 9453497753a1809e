"""Where a run goes: a config read from a moved run directory is not retargeted silently, a path
orbax cannot restore from is refused before anything is written, `~` is the home directory."""

import shutil

import pytest

from cem_jax.cli.train import main


@pytest.mark.slow
def test_the_config_of_a_moved_run_names_both_directories(tiny_overrides, tmp_path, capsys):
    args = [*tiny_overrides, "run.sample_tokens=0", "run.eval_batches=1"]
    assert main([*args, f"run.dir={tmp_path / 'a'}", "run.steps=2"]) == 0
    shutil.move(tmp_path / "a", tmp_path / "b")
    config = str(tmp_path / "b" / "config.yaml")
    capsys.readouterr()
    assert main(["--config", config, "run.steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"{config} is the config of the run directory {tmp_path / 'b'}, but it names run.dir "\
           f"{tmp_path / 'a'}" in err
    assert f"add run.dir={tmp_path / 'b'} to train the run in {tmp_path / 'b'}" in err
    assert not (tmp_path / "a").exists()
    assert main(["--config", config, "run.steps=3", f"run.dir={tmp_path / 'b'}"]) == 0
    assert "resumed" in capsys.readouterr().out


def test_brackets_in_the_run_dir_are_refused_before_anything_is_written(tiny_overrides, tmp_path,
                                                                        capsys):
    run_dir = tmp_path / "br[1]" / "run"
    assert main([*tiny_overrides, f"run.dir={run_dir}", "run.steps=2"]) == 2
    assert "has '[' or ']' in its path: orbax would write checkpoints there that can never be " \
           "restored" in capsys.readouterr().err
    assert not (tmp_path / "br[1]").exists()


@pytest.mark.slow
def test_a_tilde_in_the_run_dir_is_the_home_directory(tiny_overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main([*tiny_overrides, "run.dir=~/runs/x", "run.steps=1", "run.sample_tokens=0",
                 "run.eval_batches=1"]) == 0
    assert (tmp_path / "home" / "runs" / "x" / "checkpoints").is_dir()
    assert not (tmp_path / "~").exists()
