"""cem-study's records, for real: one tiny run trained and recorded carries its resolved config,
its tokenizer and datasets' identities (the manifests' hashes) and the library versions; a tree
with uncommitted changes to tracked files records nothing; a sweep at the reported budget keeps
its runs apart from the reported ones and validates on the selection works, and the reported
runs are measured on Milton (a record written without it is completed from its checkpoint)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from train_helpers import REPO

from cem_jax.cli import study as cli
from cem_jax.data import find_tokenizer, load_tokenizer
from cem_jax.data.shakespeare import ARCHIVE_NAME
from cem_jax.data.shards import read_manifest
from cem_jax.study import records
from cem_jax.study.analysis import Results
from cem_jax.study.plan import RunKey, load_study, plan
from cem_jax.study.records import (
    code_commit,
    dirty_tree,
    lacks_measures,
    record_path,
    run_spec,
    train_and_record,
)


def _study(tmp_path: Path, overrides: list[str]) -> Path:
    spec = {"margin": 0.05, "alpha": 0.05, "power": 0.8, "planning_sd": 0.03, "min_seeds": 2,
            "records": str(tmp_path / "records"), "runs_dir": str(tmp_path / "runs"),
            "report": str(tmp_path / "results.md"), "baseline": "shakespeare_llama",
            "overrides": overrides,
            "configs": {"shakespeare_llama": {"file": str(REPO / "configs/shakespeare_llama.yaml")},
                        "shakespeare_cem": {"file": str(REPO / "configs/shakespeare_cem.yaml"),
                                            "parent": "shakespeare_llama"}},
            "sweep": {"steps": 3, "eval_every": 3, "seed": 0, "rates": [0.01], "extend": 0},
            "main": {"steps": 6, "eval_every": 3},
            "sizes": {"configs": ["shakespeare_llama", "shakespeare_cem"], "seeds": 2,
                      "scales": {"d32": []}}}
    (tmp_path / "records").mkdir(parents=True)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_no_hours_left_trains_nothing(tmp_path, monkeypatch, capsys):
    path = _study(tmp_path, [])
    monkeypatch.setattr(records, "dirty_tree", lambda **kwargs: "")  # a clean tree
    assert cli.main([str(path), "--hours", "0"]) == 0
    out = capsys.readouterr().out
    assert "cem-study: run " not in out and "; 0 of 2 planned runs recorded" in out
    assert not any((tmp_path / "records").iterdir()) and not (tmp_path / "runs").exists()


def test_a_recorded_run_carries_its_config_data_identity_and_versions(tmp_path, tiny_overrides):
    study = load_study(_study(tmp_path, [*tiny_overrides, "expected_params=null"]))
    key = RunKey("shakespeare_llama", 0.01, 3, 0)
    rec, row = train_and_record(study, key)
    assert row["ok"] and rec == json.loads(record_path(study, key).read_text())
    run_dir = Path(row["dir"])
    assert rec["resolved_config"] == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert rec["resolved_config"]["model"]["d_model"] == 32
    assert rec["resolved_config"]["optimizer"]["lr"] == 0.01
    tokenizer = load_tokenizer(find_tokenizer(run_dir))
    data = rec["data"]
    assert data["tokenizer_sha256"] == tokenizer.sha256
    # the tiny corpus: 12 training documents and 2 validation ones, each its own dataset
    assert (data["train"]["documents"], data["validation"]["documents"]) == (12, 2)
    cache = Path(run_spec(study, key).cfg.data.cache_dir)
    datasets = {read_manifest(str(p.parent)).identity: p.parent
                for p in cache.glob("tokens/*/manifest.json")}
    assert {data["train"]["identity"], data["validation"]["identity"]} <= set(datasets)
    assert data["train"]["identity"] != data["validation"]["identity"]
    assert "milton" not in data  # a sweep run is not evaluated on Milton
    assert rec["eval_split"] == "validation"
    assert rec["ran"]["versions"]["optax"] == importlib.metadata.version("optax")
    assert rec["ran"]["versions"]["flax"] == importlib.metadata.version("flax")
    assert set(rec["ran"]["versions"]) == {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                                           "grain", "numpy"}


@pytest.mark.slow
def test_a_reported_run_is_measured_on_milton_and_an_old_record_completed(
        tmp_path, tiny_overrides, archive_cache, monkeypatch, capsys):
    path = _study(tmp_path, [*tiny_overrides, "expected_params=null",
                             f"data.shakespeare_archive={archive_cache / ARCHIVE_NAME}"])
    spec = yaml.safe_load(path.read_text())
    spec["sweep"].update(steps=6, seed=100)  # the sweep at the reported budget, as tied_vs_llama
    path.write_text(yaml.safe_dump(spec))
    study = load_study(path)
    key = RunKey("shakespeare_cem", 0.01, 6, 0)
    assert not study.is_sweep(key) and study.is_sweep(RunKey("shakespeare_cem", 0.01, 6, 100))
    monkeypatch.setattr(records, "dirty_tree", lambda *args, **kwargs: "")  # a clean tree
    rec, row = train_and_record(study, key)
    measured = ("ood_bits_per_byte", "ood_loss", "descent", "descent_init", "descent_tokens")
    assert row["ok"] and set(measured) <= set(rec) and 1 < rec["ood_bits_per_byte"] < 10
    assert rec["data"]["milton"]["identity"] not in (rec["data"]["train"]["identity"],
                                                     rec["data"]["validation"]["identity"])
    assert rec["data"]["milton"]["tokens"] > 10 * rec["data"]["validation"]["tokens"]
    assert not lacks_measures(study, key, rec) and "completed" not in rec

    # a record written without them (as tied_vs_llama's first ones were) is completed first
    old = {k: v for k, v in rec.items() if k not in measured}
    old["data"] = {k: v for k, v in rec["data"].items() if k != "milton"}
    record_path(study, key).write_text(json.dumps(old))
    assert lacks_measures(study, key, old)
    assert cli.main([str(path), "--max-runs", "0"]) == 0  # trains nothing
    assert f"cem-study: completing {key.label}: its Milton evaluation" in capsys.readouterr().out
    done = json.loads(record_path(study, key).read_text())
    assert {k: done[k] for k in measured} == {k: rec[k] for k in measured}  # the same checkpoint
    assert done["data"] == rec["data"]
    assert done["completed"]["fields"] == ["data.milton", *measured]
    assert done["completed"]["commit"] == records.code_commit()
    report = Path(spec["report"]).read_text()
    assert ("1 record of reported runs lacked the Milton evaluation (and energy descent) of the "
            f"runs' final checkpoints when written; code {done['completed']['commit']} "
            "completed them") in report

    # its run directory gone: refused in one line naming the record, which is kept as it was
    record_path(study, key).write_text(json.dumps(old))
    shutil.rmtree(row["dir"])
    assert cli.main([str(path), "--max-runs", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cem-study: error: cannot complete {record_path(study, key)} from its "
                          "run directory") and err.count("\n") == 1
    assert json.loads(record_path(study, key).read_text()) == old


def test_uncommitted_changes_to_tracked_files_refuse_to_record(tmp_path, monkeypatch, capsys):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    assert dirty_tree(tmp_path) == ""
    (tmp_path / "new.txt").write_text("an untracked file is no change to the code\n")
    assert dirty_tree(tmp_path) == ""
    (tmp_path / "report.md").write_text("a study's report\n")
    git("add", "report.md")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "report")
    commit = code_commit(tmp_path)
    assert len(commit) >= 7 and not commit.endswith("-dirty")
    (tmp_path / "report.md").write_text("regenerated\n")  # the study's own output
    assert dirty_tree(tmp_path, outputs=(tmp_path / "report.md",)) == ""
    assert code_commit(tmp_path, outputs=(tmp_path / "report.md",)) == commit  # not code
    assert code_commit(tmp_path) == commit + "-dirty"
    (tmp_path / "a.py").write_text("x = 2\n")
    assert dirty_tree(tmp_path, outputs=(tmp_path / "report.md",)).startswith(
        "1 tracked file differs from the commit (a.py): commit or stash")
    assert code_commit(tmp_path, outputs=(tmp_path / "report.md",)) == commit + "-dirty"
    assert dirty_tree(tmp_path).startswith("2 tracked files differ from the commit (a.py, "
                                           "report.md)")
    git("checkout", "a.py", "report.md")
    (tmp_path / "runs").mkdir()  # a study's records, beside its study file runs.yaml
    for name in ("runs/x.json", "runs.yaml"):
        (tmp_path / name).write_text("1\n")
        git("add", name)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "study")
    (tmp_path / "runs" / "x.json").write_text("2\n")
    assert dirty_tree(tmp_path, outputs=(tmp_path / "runs",)) == ""
    (tmp_path / "runs.yaml").write_text("2\n")  # the plan edited: code, not an output
    assert dirty_tree(tmp_path, outputs=(tmp_path / "runs",)).startswith(
        "1 tracked file differs from the commit (runs.yaml)")
    outside = tmp_path.parent / f"{tmp_path.name}-plain"
    outside.mkdir()
    assert "is not in a git checkout" in dirty_tree(outside)
    assert code_commit(outside) == "unknown"

    path = _study(tmp_path / "study", [])
    monkeypatch.setattr(records, "dirty_tree", lambda outputs: dirty_tree(tmp_path, outputs))
    assert cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cem-study: error: cannot record runs: 2 tracked files differ") and \
        err.count("\n") == 1
    assert not list((tmp_path / "study" / "records").iterdir())
    assert cli.main([str(path), "--report-only"]) == 0  # a report needs no clean tree


def test_a_sweep_at_the_reported_budget_stays_apart_and_validates_on_the_selection_works():
    study = load_study(REPO / "docs/study/tied_vs_llama.yaml")
    assert study.seeds == 10 and study.sweep_seed >= study.seeds
    flops = dict.fromkeys(study.all_configs(), 1e12)
    first = plan(study, {}, flops)
    core = [k for k in first if "-d256" not in k.name]
    assert {(k.steps, k.seed) for k in first} == {(1500, 100)}
    assert len(core) == 9 and {k.lr for k in core} == {0.00354, 0.005, 0.00707}
    sweep, reported = RunKey("shakespeare_cem", 0.005, 1500, 100), RunKey(
        "shakespeare_cem", 0.005, 1500, 0)
    assert run_spec(study, sweep).cfg.data.selection == "validation"
    assert run_spec(study, reported).cfg.data.selection == "excluded"
    # the best at the √2 grid's top edge: one rate beyond it by the grid's ratio
    sweeps = {n: {0.00354: 2.1, 0.005: 2.0, 0.00707: 1.9} for n in study.configs}
    runs = plan(study, sweeps, flops)
    assert RunKey("shakespeare_llama", 0.01, 1500, 100) in runs
    sweeps = {n: {**s, 0.01: 1.95} for n, s in sweeps.items()}
    runs = plan(study, sweeps, flops)
    assert [k.seed for k in runs if k.name == "shakespeare_cem" and k.seed < 100] == \
        list(range(10))
    # the sweep's own run at the best rate is not one of the reported seeds
    record = {"val": {"bits_per_byte": 1.9}, "status": "ok", "train_loss": [[1500, 3.0]]}
    records = {RunKey("shakespeare_cem", r, 1500, 100): {**record, "val": {"bits_per_byte": v}}
               for r, v in sweeps["shakespeare_cem"].items()}
    records[RunKey("shakespeare_cem", 0.00707, 1500, 0)] = record
    results = Results(study, records)
    assert results.best_rate("shakespeare_cem") == 0.00707
    assert list(results.runs("shakespeare_cem")) == [0]
