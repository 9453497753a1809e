"""`cem-compare` end to end on two tiny configs (a Llama twin and its tied-attention variant):
one row per config with plausible parsed numbers, parameter counts equal to `count_params`,
the tied attention half the untied one, a valid PNG of the curves, and a rerun that reuses the
finished runs instead of training again; bad arguments refused before any training."""

from __future__ import annotations

import math
import re

import pytest
from flax import nnx

from cem_jax.compare import main
from cem_jax.model import CEMTransformer, count_params
from cem_jax.train.config import load_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _table(markdown: str) -> dict[str, dict[str, str]]:
    """{config: {column: cell}} of the Markdown table."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(head, row, strict=True)) for row in rows}


def _int(cell: str) -> int:
    return int(cell.replace(",", ""))


def test_compare_two_tiny_configs(tiny_overrides, tmp_path, capsys):
    configs = []
    for name, tied in (("tiny_llama", False), ("tiny_cem_attn", True)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"# {name}\nmodel:\n  tie_attention: {str(tied).lower()}\n"
                        f"  tie_mlp: false\n  preconditioner: none\n")
        configs.append(path)
    overrides = [*tiny_overrides, "run.sample_tokens=0", "run.peak_flops=1e12"]
    out, runs = tmp_path / "docs" / "results.md", tmp_path / "runs"
    argv = ["--configs", *map(str, configs), "--steps", "4", "--eval-every", "2",
            "--out", str(out), "--runs-dir", str(runs), *overrides]
    assert main(argv) == 0, capsys.readouterr()

    text = out.read_text()
    assert "cem-compare --configs " in text and "--steps 4" in text
    table = _table(text)
    assert set(table) == {"tiny_llama", "tiny_cem_attn"}
    for path in configs:
        row = table[path.stem]
        bpb, loss, ppl = (float(row[k]) for k in ("bits/byte", "val loss", "perplexity"))
        assert 0 < bpb < 20 and math.isfinite(bpb)
        assert abs(ppl - math.exp(loss)) < 0.01 * ppl
        assert float(row["tokens/s"].replace(",", "")) > 0
        assert re.fullmatch(r"[\d.]+ min", row["wall time"])
        cfg = load_config(path, overrides)
        counts = count_params(CEMTransformer(cfg.model, rngs=nnx.Rngs(0)))
        assert _int(row["total"]) == counts["total"]
        assert _int(row["attention"]) == counts["attention"]
    assert 2 * _int(table["tiny_cem_attn"]["attention"]) == _int(table["tiny_llama"]["attention"])

    png = out.with_name("results_curves.png")
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100

    # A reading appended below the marker survives a rerun, which reuses the finished runs.
    out.write_text(text + "My reading.\n")
    logs = {p: p.stat().st_size for p in runs.glob("*/train.log")}
    capsys.readouterr()
    assert main(argv) == 0
    assert "training" not in capsys.readouterr().out
    assert {p: p.stat().st_size for p in runs.glob("*/train.log")} == logs
    assert _table(out.read_text()) == table and out.read_text().endswith("My reading.\n")


def test_a_run_without_validation_counts_as_finished(tiny_overrides, tmp_path, capsys):
    path = tmp_path / "no_val.yaml"
    path.write_text("model:\n  preconditioner: none\n")
    out, runs = tmp_path / "results.md", tmp_path / "runs"
    argv = ["--configs", str(path), "--steps", "3", "--out", str(out), "--runs-dir", str(runs),
            *tiny_overrides, "data.val_corpus=null", "run.sample_tokens=0"]
    assert main(argv) == 0, capsys.readouterr()
    assert "training no_val" in capsys.readouterr().out
    assert main(argv) == 0  # reused: not trained again
    assert "training" not in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--steps", "--eval-every"])
@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_steps_and_eval_every_must_be_positive(flag, value, tmp_path, capsys):
    argv = ["--configs", "c.yaml", "--steps", "4", flag, value, "--out", str(tmp_path / "r.md")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}: {value!r} is not a positive integer" in capsys.readouterr().err


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
    assert "with a PNG of their validation curves beside it. " in help_text
