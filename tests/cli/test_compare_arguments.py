"""`cem-compare`'s arguments: a bad count, seed list, budget or config name, and an --out that
cannot be written, each refused (status 2) before any training; the help in whole sentences."""

from __future__ import annotations

import pytest

from cem_jax.cli.compare import main


@pytest.mark.parametrize("flag", ["--steps", "--eval-every"])
@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_steps_and_eval_every_must_be_positive(flag, value, tmp_path, capsys):
    argv = ["--configs", "c.yaml", "--steps", "4", flag, value, "--out", str(tmp_path / "r.md")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}: {value!r} is not a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0,x"], "argument --seeds: '0,x' is not a comma-separated list of distinct"),
    (["--seeds", "1,1"], "argument --seeds: '1,1' is not a comma-separated list of distinct"),
    (["--budget", "time"], "argument --budget: 'time': give steps, flops or steps,flops"),
    (["--baseline", "other.yaml"], "--baseline other.yaml is not one of --configs"),
    (["--recursion-configs", "c", "nope"], "--recursion-configs nope is not one of --configs"),
    (["--recursion-steps", "0,1"], "--recursion-steps: a sub-layer takes at least 1 step"),
])
def test_bad_seeds_budgets_and_config_names_are_refused(args, message, tmp_path, capsys):
    argv = ["--configs", "c.yaml", "--steps", "4", *args, "--out", str(tmp_path / "r.md")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("out", ["docs", "file/results.md", "read-only/results.md"])
def test_an_unwritable_out_is_refused_before_any_training(out, tmp_path, capsys, monkeypatch):
    (tmp_path / "docs").mkdir()
    # a folder without write permission (faked: the tests may run as root, who may write anywhere)
    monkeypatch.setattr("os.access", lambda path, mode: "read-only" not in str(path))
    (tmp_path / "file").write_text("not a folder\n")
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  preconditioner: none\n")
    argv = ["--configs", str(config), "--steps", "4", "--out", str(tmp_path / out),
            "--runs-dir", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    expected = {"docs": "is a directory: give the Markdown file to write",
                "file/results.md": f"cannot create {tmp_path / 'file'}, the folder of --out",
                "read-only/results.md": f"cannot write in {tmp_path / 'read-only'}, the folder"}
    assert "cem-compare: error: " in err and expected[out] in err
    assert not (tmp_path / "runs").exists()


def test_help_describes_the_command_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "with a PNG of their validation curves beside it; " in help_text
