"""What `--overwrite` of cem-export and cem-import may replace: only the entries the earlier
output wrote (listed in its marker), never a user's file, never a directory that holds a
training run (metrics.jsonl, a checkpoint step > 0, a lock a cem-train holds), and never a run
that cem-train has started training (it removes a cem-import's marker)."""

from __future__ import annotations

import contextlib
import fcntl
import json
from pathlib import Path

import pytest

from cem_jax.cli import export as cli
from cem_jax.cli.train import main as train_main
from cem_jax.export import hf, hf_llama, importer, safetensors_io
from cem_jax.export.output import MARKER, staged_dir
from cem_jax.export.safetensors_io import load_safetensors
from cem_jax.rundir import available_steps

LLAMA = dict(tie_attention=False, tie_mlp=False, preconditioner="none")
OLD_MARKER = "written by cem_jax; `--overwrite` may replace this folder\n"  # before file lists


def _files(directory: Path) -> dict[str, bytes]:
    """{relative path: content} of every file under `directory` (the marker included)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


def _listed(directory: Path) -> list[str]:
    return json.loads((directory / MARKER).read_text())["files"]


@contextlib.contextmanager
def _held_lock(run_dir: Path):
    """Hold `run_dir/.lock` as a running cem-train does (its flock, its "pid ... on ..." line)."""
    with open(run_dir / ".lock", "a+") as f:
        f.truncate(0)
        f.write("pid 1234 on elsewhere")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


@pytest.fixture
def llama_dir(make_run, tmp_path):
    """(a Hugging Face Llama directory exported from a baseline run, that run's config)."""
    run_dir, cfg, _ = make_run(**LLAMA)
    assert cli.main(["--run", str(run_dir), "--format", "hf-llama", "--out",
                     str(tmp_path / "llama")]) == 0
    return tmp_path / "llama", cfg


def _import(llama: Path, out: Path, cfg, *flags: str) -> int:
    """cem-import of `llama` into `out` with the data section of `cfg` (a run that trains on
    the export tests' corpus for 2 steps)."""
    data = cfg.data
    overrides = [f"data.{k}={getattr(data, k)}" for k in
                 ("corpus", "val_corpus", "vocab_size", "seq_len", "batch_size", "cache_dir")]
    return cli.import_main(["--hf", str(llama), "--out", str(out), *flags, *overrides,
                            "run.steps=2", "run.sample_tokens=0", "run.progress=false",
                            "run.eval_batches=1"])


def _replacements(llama: Path, run: Path, out: Path, cfg, capsys) -> list[tuple[str, int, str]]:
    """(command, exit status, stderr) of cem-import --overwrite and cem-export --overwrite (two
    formats) over `out`; `run` is the run exported."""
    capsys.readouterr()
    results = [("cem-import", _import(llama, out, cfg, "--overwrite"), capsys.readouterr().err)]
    for fmt in ("safetensors", "hf-llama"):
        status = cli.main(["--run", str(run), "--format", fmt, "--out", str(out), "--overwrite"])
        results.append((f"cem-export {fmt}", status, capsys.readouterr().err))
    return results


def test_a_trained_import_is_never_replaced(llama_dir, tmp_path, capsys):
    llama, cfg = llama_dir
    run = tmp_path / "run"
    imported = tmp_path / "from_llama"
    assert _import(llama, imported, cfg) == 0
    assert train_main(["--config", str(imported / "config.yaml")]) == 0  # fine-tune 2 steps
    assert available_steps(imported) == [0, 2]
    before = _files(imported)
    for command, status, err in _replacements(llama, run, imported, cfg, capsys):
        assert (command, status) == (command, 2)
        assert (f"{imported} holds a training run (metrics.jsonl): it is never replaced by an "
                "export or import, --overwrite or not; choose another --out") in err
    assert _files(imported) == before and available_steps(imported) == [0, 2]
    assert MARKER not in before  # cem-train took the run: it is no cem-import output any more

    # A run trained by an older cem-train kept its marker: the training state still refuses,
    # a checkpoint step > 0 alone as well.
    (imported / MARKER).write_text(OLD_MARKER)
    (imported / "metrics.jsonl").unlink()
    before = _files(imported)
    for command, status, err in _replacements(llama, run, imported, cfg, capsys):
        assert (command, status) == (command, 2)
        assert f"{imported} holds a training run (checkpoint 2)" in err
    assert _files(imported) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from_llama", "llama", "run"]


def test_a_held_lock_always_refuses(llama_dir, tmp_path, capsys):
    llama, cfg = llama_dir
    imported = tmp_path / "from_llama"
    assert _import(llama, imported, cfg) == 0  # an untrained import: replaceable, unless held
    before = _files(imported)
    with _held_lock(imported):
        for command, status, err in _replacements(llama, tmp_path / "run", imported, cfg, capsys):
            assert (command, status) == (command, 2)
            assert (f"{imported} is in use by cem-train (pid 1234 on elsewhere): a training run "
                    "is never replaced by an export or import; choose another --out") in err
    assert _files(imported) == {**before, ".lock": b"pid 1234 on elsewhere"}

    # A cem-train that takes the lock while an export is being written: refused at the end.
    with contextlib.ExitStack() as held:
        with pytest.raises(FileExistsError, match="is in use by cem-train"), staged_dir(
                imported, overwrite=True, names=["config.json"]) as stage:
            (stage / "config.json").write_text("{}")
            held.enter_context(_held_lock(imported))
    assert _files(imported) == {**before, ".lock": b"pid 1234 on elsewhere"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from_llama", "llama", "run"]

    assert _import(llama, imported, cfg, "--overwrite") == 0  # released: replaced, lock kept
    assert (imported / ".lock").read_text() == "pid 1234 on elsewhere"
    assert _listed(imported) == ["checkpoints", "config.yaml", "tokenizer.model"]
    assert _listed(imported) == sorted(importer.files("tokenizer.model"))


def test_overwrite_replaces_only_what_the_earlier_export_wrote(make_run, tmp_path, capsys):
    run_dir, cfg, _ = make_run(**LLAMA)
    out = tmp_path / "exported"
    args = ["--run", str(run_dir), "--out", str(out)]
    assert cli.main([*args, "--format", "hf"]) == 0
    (out / "README.md").write_text("# my model card")
    (out / "notes").mkdir()
    (out / "notes" / "eval.txt").write_text("ppl 12")
    assert cli.main([*args, "--format", "safetensors", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        MARKER, "README.md", "config.json", "model.safetensors", "notes", "tokenizer.model"]
    assert (out / "README.md").read_text() == "# my model card"  # the user's, kept
    assert (out / "notes" / "eval.txt").read_text() == "ppl 12"
    assert _listed(out) == ["config.json", "model.safetensors", "tokenizer.model"]
    assert load_safetensors(out)[0] == cfg.model  # no hf file left beside the safetensors ones

    # A file of the user's that the new export would write: refused before anything is written.
    (out / "generation_config.json").write_text('{"mine": true}')
    before = _files(out)
    capsys.readouterr()
    assert cli.main([*args, "--format", "hf", "--overwrite"]) == 2
    assert (f"{out} holds generation_config.json, which the earlier cem-export or cem-import "
            "did not write and this one would replace: move it elsewhere or choose another "
            "--out") in capsys.readouterr().err
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]


def test_an_old_marker_without_a_file_list(make_run, tmp_path, capsys):
    """Such a folder is replaced only when it holds nothing but the files of one of the older
    outputs: the marker cannot tell a file the user added from the export's."""
    run_dir, _, _ = make_run(**LLAMA)
    out = tmp_path / "exported"
    args = ["--run", str(run_dir), "--out", str(out)]
    assert cli.main([*args, "--format", "hf"]) == 0
    (out / MARKER).write_text(OLD_MARKER)
    assert cli.main([*args, "--format", "hf-llama", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        MARKER, "config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
        "tokenizer_config.json"]  # the hf export's modeling code went with it

    (out / MARKER).write_text(OLD_MARKER)
    (out / "README.md").write_text("# my model card")
    before = _files(out)
    capsys.readouterr()
    assert cli.main([*args, "--format", "hf-llama", "--overwrite"]) == 2
    assert (f"{out} holds README.md besides the files of an earlier output whose marker (of an "
            "older cem_jax) lists none, so --overwrite cannot tell them apart: move README.md "
            "elsewhere or choose another --out") in capsys.readouterr().err
    assert _files(out) == before


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "huggingface"])
@pytest.mark.parametrize("fmt", ["safetensors", "hf", "hf-llama"])
def test_each_output_lists_the_files_it_declares(make_run, tmp_path, fmt, tokenizer):
    """The names a format declares for a run's tokenizer (checked against a folder's files
    before the export) are the ones it writes and its marker lists."""
    run_dir, _, _ = make_run(tokenizer=tokenizer, **LLAMA)
    assert cli.main(["--run", str(run_dir), "--format", fmt, "--out", str(tmp_path / "o")]) == 0
    written = sorted(p.name for p in (tmp_path / "o").iterdir() if p.name != MARKER)
    declared = {"safetensors": safetensors_io.files, "hf": hf.files, "hf-llama": hf_llama.files}
    name = {"sentencepiece": "tokenizer.model", "huggingface": "tokenizer.json"}[tokenizer]
    assert _listed(tmp_path / "o") == written == sorted(declared[fmt](name))
    assert name in written and ("tokenizer_config.json" in written) == (
        fmt != "safetensors" or tokenizer == "huggingface")
