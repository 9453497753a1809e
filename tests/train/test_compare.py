"""`cem-compare`: the paired interval against a hand-computed example, the steps an equal-FLOPs
budget gives, and end to end on two tiny configs with two seeds: mean ± sd and paired
differences from the runs' own metrics, the out-of-domain column from `evaluate_run`, parameter
counts equal to `count_params`, the descent and test-time recursion sections, valid PNGs, and a
rerun that neither retrains nor re-evaluates. Its arguments: tests/cli/test_compare_arguments.py."""

from __future__ import annotations

import json
import math
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flax import nnx
from train_helpers import REPO

from cem_jax.cli.compare import main
from cem_jax.compare.plan import budget_steps
from cem_jax.compare.runs import RunSpec, train_one, train_process
from cem_jax.evaluate import bits_per_byte_of, evaluate_run
from cem_jax.model import CEMTransformer, count_params
from cem_jax.rundir import load_run
from cem_jax.stats import paired_interval
from cem_jax.train.metrics import flops_per_token, logged_records
from cem_jax.train_config import load_config, save_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _tables(markdown: str) -> dict[str, dict[str, dict[str, str]]]:
    """{heading: {key: {column: cell}}} of each Markdown table, under the heading before it;
    a row's key joins its cells of the columns config, trained steps, N, sub-layer, step."""
    tables, title, lines = {}, "", markdown.splitlines() + [""]
    for i, line in enumerate(lines):
        if line.startswith("#"):
            title = line.lstrip("# ")
        if line.startswith("|") and not lines[i - 1].startswith("|"):
            end = next(j for j in range(i, len(lines)) if not lines[j].startswith("|"))
            head, *rows = ([c.strip() for c in row.strip("|").split("|")]
                           for row in [lines[i], *lines[i + 2:end]])
            keys = [k for k, name in enumerate(head)
                    if name in ("config", "trained steps", "N", "sub-layer", "step")]
            tables[title] = {" ".join(row[k] for k in keys): dict(zip(head, row, strict=True))
                             for row in rows}
    return tables


def _int(cell: str) -> int:
    return int(cell.replace(",", ""))


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_paired_interval_against_a_hand_computed_example():
    # differences by seed 0.10, 0.20, 0.30 (seed 3 has no baseline: left out): mean 0.2,
    # sd 0.1, t(0.975, 2) = 4.302653 → half width 4.302653 · 0.1 / √3 = 0.248414
    interval = paired_interval({0: 2.10, 1: 2.25, 2: 2.20, 3: 9.0}, {0: 2.00, 1: 2.05, 2: 1.90})
    assert interval.n == 3 and interval.mean == pytest.approx(0.2)
    assert (interval.low, interval.high) == pytest.approx((-0.048414, 0.448414), abs=1e-6)
    assert not interval.separated
    # 0.10, 0.12, 0.14: mean 0.12, sd 0.02, half width 4.302653 · 0.02 / √3 = 0.049683
    interval = paired_interval({0: 1.10, 1: 1.12, 2: 1.14}, {0: 1.0, 1: 1.0, 2: 1.0})
    assert (interval.low, interval.high) == pytest.approx((0.070317, 0.169683), abs=1e-6)
    assert interval.separated
    # 4 pairs -0.1, -0.3, -0.2, -0.2: mean -0.2, sd 0.081650, t(0.975, 3) = 3.182446
    interval = paired_interval({s: 0.0 for s in range(4)}, {0: 0.1, 1: 0.3, 2: 0.2, 3: 0.2})
    assert (interval.low, interval.high) == pytest.approx((-0.329923, -0.070077), abs=1e-6)
    assert paired_interval({0: 1.0, 1: 2.0}, {1: 1.5}) is None  # one pair: no interval


def test_equal_flops_gives_each_config_the_steps_its_flops_per_token_imply():
    cfgs = {name: load_config(CONFIGS / f"{name}.yaml") for name in (
        "shakespeare_llama", "shakespeare_cem", "shakespeare_cem_steps2", "shakespeare_cem_dplr")}
    # training FLOPs/token at T = 128: Llama 7,176,192, tied 6,782,976, T = 2 10,518,528,
    # DPLR 8,355,840; steps = round(400 · 7,176,192 / F)
    assert budget_steps(cfgs, "shakespeare_llama", 400, "flops") == {
        "shakespeare_llama": 400, "shakespeare_cem": 423, "shakespeare_cem_steps2": 273,
        "shakespeare_cem_dplr": 344}
    assert set(budget_steps(cfgs, "shakespeare_llama", 400, "steps").values()) == {400}


def test_the_flops_budget_passes_each_run_its_steps(tiny_overrides, tmp_path, monkeypatch,
                                                   capsys):
    calls = []

    def fake_train(argv, log):  # records what cem-train was asked to do; trains nothing
        calls.append(argv)
        return 1

    monkeypatch.setattr("cem_jax.compare.runs.train_process", fake_train)
    configs = {"llama": "model:\n  tie_attention: false\n  tie_mlp: false\n",
               "steps2": "model:\n  steps: 2\n", "dplr": "model:\n  interaction: dplr\n"}
    for name, text in configs.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    argv = ["--configs", *(str(tmp_path / f"{n}.yaml") for n in configs), "--steps", "40",
            "--budget", "flops", "--seeds", "0,1", "--out", str(tmp_path / "r.md"),
            "--runs-dir", str(tmp_path / "runs"), "--ood", "none", *tiny_overrides]
    assert main(argv) == 1  # every run "failed"
    steps = {}
    for call in calls:
        args = dict(a.split("=", 1) for a in call[2:])
        steps.setdefault(Path(call[1]).stem, set()).add(int(args["run.steps"]))
        assert args["run.seed"] == args["data.seed"]
    fpt = {n: flops_per_token(load_config(tmp_path / f"{n}.yaml", tiny_overrides).model, 16)
           for n in configs}
    assert steps == {n: {round(40 * fpt["llama"] / fpt[n])} for n in configs}
    assert steps["steps2"] != {40} and len(calls) == 6  # 3 configs × 2 seeds
    text = (tmp_path / "r.md").read_text()
    assert "## Equal training FLOPs" in text and "llama seed 1 (40 steps): cem-train exited" in text


def test_a_run_killed_mid_write_is_a_failed_row(tiny_overrides, tmp_path, monkeypatch):
    """A kill can tear the last line of metrics.jsonl: the row is failed, the report written."""
    def killed_train(argv, log):
        run_dir = Path(dict(a.split("=", 1) for a in argv[2:])["run.dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 5.0}\n'
                                               '{"step": 2, "ki')
        return -9

    monkeypatch.setattr("cem_jax.compare.runs.train_process", killed_train)
    (tmp_path / "llama.yaml").write_text("model:\n  tie_attention: false\n  tie_mlp: false\n")
    argv = ["--configs", str(tmp_path / "llama.yaml"), "--steps", "4", "--seeds", "0",
            "--out", str(tmp_path / "r.md"), "--runs-dir", str(tmp_path / "runs"),
            "--ood", "none", *tiny_overrides]
    assert main(argv) == 1
    assert "llama seed 0 (4 steps): cem-train exited with status -9 (killed)" in \
        (tmp_path / "r.md").read_text()


def test_a_runs_directory_holding_another_run_is_refused(tiny_overrides, tmp_path, capsys):
    """A run's directory that holds a run of another model (or seed) is not trained over: the
    row says which section differs and what to do, headed by the calling command."""
    config = CONFIGS / "shakespeare_cem.yaml"
    spec = RunSpec.make("cem", str(config), 4, 0, 2, tmp_path / "runs", tiny_overrides)
    other = RunSpec.make("cem", str(config), 4, 0, 2, tmp_path / "runs",
                         [*tiny_overrides, "model.num_layers=1"])
    run_dir = Path(spec.cfg.run.dir)
    run_dir.mkdir(parents=True)
    save_config(other.cfg, run_dir / "config.yaml")
    row = train_one(spec, "cem-study")
    assert not row["ok"] and row["status"] == 0
    assert row["note"].startswith(f"{run_dir} holds a run with another model section; move "
                                  "that directory away, or train in another runs directory")
    assert capsys.readouterr().err.startswith(f"cem-study: cem: {run_dir} holds a run")
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained over it


@pytest.mark.slow  # ~70 s: four runs; the default run keeps the two cem-compare tests above
def test_compare_two_tiny_configs_with_two_seeds(tiny_overrides, tmp_path, capsys):
    configs = []
    for name, tied in (("tiny_llama", False), ("tiny_cem", True)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"# {name}\nmodel:\n  tie_attention: {str(tied).lower()}\n"
                        f"  tie_mlp: {str(tied).lower()}\n  preconditioner: "
                        f"{'diag' if tied else 'none'}\n")
        configs.append(path)
    overrides = [*tiny_overrides, "run.sample_tokens=0", "run.peak_flops=1e12"]
    ood = next(o for o in overrides if o.startswith("data.corpus=")).split("=", 1)[1]
    out, runs = tmp_path / "docs" / "results.md", tmp_path / "runs"
    argv = ["--configs", *map(str, configs), "--steps", "4", "--eval-every", "2",
            "--seeds", "0,1", "--budget", "steps,flops", "--ood", ood,
            "--descent-batches", "2", "--recursion-configs", "tiny_cem",
            "--recursion-steps", "1,2", "--out", str(out), "--runs-dir", str(runs), *overrides]
    assert main(argv) == 0, capsys.readouterr()
    assert capsys.readouterr().out.count("cem-compare: training ") == 4  # flops: same steps

    text = out.read_text()
    assert "cem-compare --configs " in text and "--seeds 0,1" in text
    tables = _tables(text)
    steps_table = tables["Equal steps (4 steps)"]
    assert set(steps_table) == {"tiny_llama", "tiny_cem"}
    flops_title = next(t for t in tables if t.startswith("Equal training FLOPs"))
    assert {k: v["steps"] for k, v in tables[flops_title].items()} == {"tiny_llama": "4",
                                                                      "tiny_cem": "4"}
    bpb, milton = {}, {}
    for path in configs:
        row, stem = steps_table[path.stem], path.stem
        bpb[stem], milton[stem] = {}, []
        for seed in (0, 1):
            run_dir = runs / stem / f"steps4_seed{seed}"
            cfg = load_config(run_dir / "config.yaml")
            assert (cfg.run.seed, cfg.data.seed) == (seed, seed)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            bpb[stem][seed] = bits_per_byte_of([r for r in records if r["kind"] == "eval"][-1])
            milton[stem].append(evaluate_run(load_run(run_dir), ood, progress=False)
                                ["bits_per_byte"])
        values = list(bpb[stem].values())
        assert row["seeds"] == "2" and values[0] != values[1]  # the seeds differ
        assert row["val bits/byte"] == \
            f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"
        assert row["out-of-domain bits/byte"] == \
            f"{statistics.fmean(milton[stem]):.4f} ± {statistics.stdev(milton[stem]):.4f}"
        counts = count_params(CEMTransformer(cfg.model, rngs=nnx.Rngs(0)))
        assert _int(row["params"]) == counts["total"]
        assert float(row["tokens/s"].replace(",", "")) > 0
    assert steps_table["tiny_llama"]["Δ vs tiny_llama (95% CI)"] == "baseline"
    interval = paired_interval(bpb["tiny_cem"], bpb["tiny_llama"])
    delta = steps_table["tiny_cem"]["Δ vs tiny_llama (95% CI)"]
    assert delta.startswith(f"{interval.mean:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]")
    assert delta.endswith("not separated") == (not interval.separated)
    params = tables["Parameters by part (`count_params`)"]
    assert 2 * _int(params["tiny_cem"]["attention"]) == _int(params["tiny_llama"]["attention"])

    descent = tables["Energy descent in the trained CEM layers"]
    assert set(descent) == {"tiny_cem attention 1", "tiny_cem mlp 1"}  # Llama has no energy
    for row in descent.values():
        for layer in ("layer 0", "layer 1"):
            fraction, change = row[layer].split(" / ")
            assert 0 <= float(fraction.rstrip("%")) <= 100 and math.isfinite(float(change))
    precond = tables["Learned preconditioner P (first seed's run)"]
    assert set(precond) == {"tiny_cem attention", "tiny_cem mlp"}  # one row per sub-layer
    recursion = tables["Test-time recursion"]
    assert set(recursion) == {"tiny_cem 1 1", "tiny_cem 1 2"}
    assert recursion["tiny_cem 1 2"]["attention energy: before → after each step"].count(" → ") == 2
    exact = [evaluate_run(load_run(runs / "tiny_cem" / f"steps4_seed{s}"), progress=False,
                          steps=2)["bits_per_byte"] for s in (0, 1)]
    assert recursion["tiny_cem 1 2"]["val bits/byte"].startswith(f"{statistics.fmean(exact):.4f}")
    for name in ("curves_steps", "curves_flops", "descent"):
        width, height = _png_size(out.with_name(f"results_{name}.png"))
        assert width > 100 and height > 100

    # A reading appended below the marker survives a rerun, which reuses the finished runs and
    # their cached evaluations: nothing is trained or evaluated again.
    out.write_text(text + "My reading.\n")
    kept = {p: p.read_bytes() for p in runs.rglob("*") if p.name in ("train.log",
                                                                      "analysis.json")}
    assert len(kept) == 8
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "training" not in printed and " of " not in printed
    assert {p: p.read_bytes() for p in kept} == kept
    assert out.read_text() == text + "My reading.\n"


def test_a_run_stopped_by_a_signal_ends_the_comparison_without_a_report(
        tiny_overrides, tmp_path, monkeypatch, capsys):
    calls = []

    def stopped_train(argv, log):  # as cem-train stopped by SIGTERM at a step
        calls.append(argv)
        return 75

    monkeypatch.setattr("cem_jax.compare.runs.train_process", stopped_train)
    (tmp_path / "a.yaml").write_text("model:\n  preconditioner: none\n")
    (tmp_path / "b.yaml").write_text("model:\n  preconditioner: diag\n")
    argv = ["--configs", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--steps", "4",
            "--out", str(tmp_path / "r.md"), "--runs-dir", str(tmp_path / "runs"), "--ood",
            "none", *tiny_overrides]
    assert main(argv) == 75
    assert len(calls) == 1 and not (tmp_path / "r.md").exists()  # b is not started
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("cem-compare: a: cem-train exited with status 75 (stopped by a "
                             "signal: run cem-compare again to resume it); see ")
    assert err[1].startswith("cem-compare: stopped by a signal while training a seed 0 (its ")
    assert err[1].endswith("run the same command again to go on from there (exit status 75)")


@pytest.mark.slow  # ~40 s: cem-compare and cem-train started twice each
def test_a_signal_stops_the_comparison_once_its_run_has_saved(tiny_overrides, tmp_path):
    """Ctrl-C in cem-compare's terminal: the run in training gets the SIGINT once (it runs in
    its own session), stops at a safe point and saves; cem-compare writes no report and says
    how to go on, and the same command again resumes the run and writes it."""
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  preconditioner: none\n")
    out, run_dir = tmp_path / "r.md", tmp_path / "runs" / "tiny" / "steps200_seed0"
    argv = [sys.executable, "-m", "cem_jax.cli.compare", "--configs", str(config), "--steps", "200",
            "--eval-every", "100", "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
            "--ood", "none", "--descent-batches", "0", *tiny_overrides, "run.sample_tokens=0",
            "run.peak_flops=1e12"]
    compare = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 120
    while not logged_records(run_dir):  # its first step is done
        assert compare.poll() is None and time.monotonic() < deadline, compare.communicate()
        time.sleep(0.05)
    compare.send_signal(signal.SIGINT)
    stderr = compare.communicate(timeout=120)[1]
    assert compare.returncode == 75, stderr
    assert stderr.splitlines()[-1] == (
        f"cem-compare: stopped by a signal (SIGINT) while training tiny seed 0 (its "
        f"{run_dir / 'train.log'} says what it saved); run the same command again to go on from "
        f"there (exit status 75)")
    stopped = re.fullmatch(r"cem-train: stopped by a signal \(SIGINT\) at step (\d+); checkpoint "
                           r"saved in .*: start it again to resume \(exit status 75\)",
                           (run_dir / "train.log").read_text().splitlines()[-1])
    assert stopped and not out.exists(), stderr
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resumed {run_dir} from step {stopped.group(1)}" in (run_dir / "train.log").read_text()
    assert "| tiny |" in out.read_text()


@pytest.mark.slow
def test_a_run_without_validation_counts_as_finished(tiny_overrides, tmp_path, capsys):
    path = tmp_path / "no_val.yaml"
    path.write_text("model:\n  preconditioner: none\n")
    out, runs = tmp_path / "results.md", tmp_path / "runs"
    argv = ["--configs", str(path), "--steps", "3", "--out", str(out), "--runs-dir", str(runs),
            "--ood", "none", *tiny_overrides, "data.val_corpus=null", "run.sample_tokens=0"]
    assert main(argv) == 0, capsys.readouterr()
    assert "training no_val" in capsys.readouterr().out
    assert main(argv) == 0  # reused: not trained again
    assert "training" not in capsys.readouterr().out


def test_the_trainer_imports_this_process_s_code_not_the_current_directory_s(tmp_path,
                                                                           monkeypatch):
    """A study run from another checkout trained with that checkout's code while its record
    named the commit of this process's (`python -m` puts the current directory first)."""
    (tmp_path / "cem_jax").mkdir()
    (tmp_path / "cem_jax" / "__init__.py").write_text("raise SystemExit(42)\n")
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "train.log", "w+") as log:
        assert train_process(["--help"], log) == 0
        log.seek(0)
        assert "usage: cem-train" in log.read()
