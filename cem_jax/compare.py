"""`cem-compare`: train several configs alike, once per seed, and write a Markdown report of
their validation bits per byte (mean ± standard deviation over the seeds, and the paired
difference to a baseline row with a 95% interval), with a PNG of their validation curves beside
it; optionally at equal training FLOPs, on an out-of-domain text, with the energy descent of the
trained CEM layers and with test-time recursion.

    cem-compare --configs configs/shakespeare_llama.yaml configs/shakespeare_cem*.yaml \\
        --steps 400 --seeds 0,1,2 --out docs/results.md --runs-dir runs/compare \\
        [--budget steps,flops] [--recursion-configs shakespeare_cem] [section.key=value ...]

Seeds: run `s` sets run.seed = data.seed = s (model init and data order). The baseline row is
`--baseline` (a config's file name or stem), by default the first Llama config (both ties off).
Its difference to a row is paired by seed: d_s = row_s - baseline_s over the seeds both
finished, shown as mean [95% t-interval] (scipy.stats.t, n - 1 degrees of freedom); a row whose
interval contains 0 says "not separated".

Budgets (`--budget`, one table each): `steps` trains every config for --steps; `flops` gives
every config of `--flops-configs` (default: all) the training FLOPs of the baseline at --steps:
steps = round(steps · F_baseline / F_config) with F the analytic `flops_per_token`.

After training, from each run's checkpoint (in this process): bits per byte on `--ood`
("milton", the out-of-domain split of the default corpus; "none"; or a text file, glob or
FORMAT:PATH); for every config with a tied sub-layer, per layer and step, the fraction of tokens
whose energy went down across the update and the mean energy change on the first
`--descent-batches` validation batches (`cem_jax.monitor.descent_statistics`, a figure beside
the curves) and its learned preconditioner; for `--recursion-configs`, validation bits per byte
and the energy after each step with every sub-layer run for N = `--recursion-steps` steps
(test-time recursion: the steps share their weights). These use the runs of the first budget.

Each run trains in its own `python -m cem_jax.train` process, in
RUNS_DIR/<config stem>/steps<N>_seed<s> (its output in train.log there): a crash or a NaN in one
run is a row marked failed, not the end of the comparison, and every run starts from a fresh JAX
runtime, so one run's memory or compile cache does not shape the next one's speed. SIGINT or
SIGTERM (Ctrl-C) goes to the run in training, which stops at a safe point and saves, and ends
the comparison after it without a report (status 75, as cem-train's); so does a run stopped by a
signal of its own. Run again, it reuses finished runs (and the evaluations cached in their
analysis.json) and resumes unfinished ones. The overrides apply to every config. A run
directory holding another run (model, data, optimizer, steps or seed) is refused: use another
--runs-dir. Whatever follows the END marker in an existing output file (a reading of the
results) is kept on rewrite. The report itself (tables, intervals, figures) is written by
`cem_jax.compare_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from cem_jax import exits
from cem_jax.compare_report import Report, figure_names, figure_path, step_flops
from cem_jax.data import make_eval_batches
from cem_jax.evaluate import bits_per_byte_of, evaluate_run, positive_int
from cem_jax.monitor import descent_statistics, preconditioner_stats
from cem_jax.rundir import Run, load_run
from cem_jax.train.metrics import logged_records, logged_values
from cem_jax.train_config import TrainConfig, load_config

BUDGETS = ("steps", "flops")
# How a row's note words cem-train's exit status (`cem_jax.exits.ExitStatus`).
_STATUS_WORDS = {1: "crashed", 2: "cannot run as configured", 3: "diverged",
                 75: "stopped by a signal: run cem-compare again to resume it"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-compare`; returns 0 if every run finished, 1 if one failed, 2 on bad
    arguments or configs, 75 when a signal stopped it (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if 0 in args.recursion_steps:
        parser.error("--recursion-steps: a sub-layer takes at least 1 step, e.g. 1,2,3,4")
    stems = [Path(c).stem for c in args.configs]
    if len(set(stems)) != len(stems):
        parser.error(f"config file names must differ (they name the run dirs): {stems}")
    paths = dict(zip(stems, args.configs, strict=True))
    for flag in ("baseline", "flops_configs", "recursion_configs"):
        named = getattr(args, flag)
        unknown = [n for n in ([named] if isinstance(named, str) else named or [])
                   if Path(n).stem not in paths]
        if unknown:
            parser.error(f"--{flag.replace('_', '-')} {unknown[0]} is not one of --configs "
                         f"(name a config by its file or stem: {', '.join(stems)})")
    flops_stems = {_stem(n) for n in args.flops_configs or stems}
    recursion_stems = {_stem(n) for n in args.recursion_configs or ()}
    try:
        cfgs = {stem: load_config(path, args.overrides) for stem, path in paths.items()}
        baseline = _stem(args.baseline) if args.baseline else default_baseline(cfgs)
        plans = {}  # budget -> {stem: steps}
        for budget in args.budget:
            chosen = [s for s in stems if budget == "steps" or s in flops_stems or s == baseline]
            plans[budget] = budget_steps({s: cfgs[s] for s in chosen}, baseline, args.steps,
                                         budget)
        eval_every = args.eval_every or max(1, args.steps // 8)
        runs = {}  # (stem, steps, seed) -> RunSpec; a run two tables share trains once
        for seed in args.seeds:
            for plan in plans.values():
                for stem, steps in plan.items():
                    runs.setdefault((stem, steps, seed), RunSpec.make(
                        stem, paths[stem], steps, seed, eval_every, args.runs_dir,
                        args.overrides))
    except (ValueError, FileNotFoundError) as err:
        print(f"cem-compare: configuration error: {err}", file=sys.stderr)
        return 2
    unwritable = _unwritable(args.out, args.budget)  # found now, not after an hour of training
    if unwritable:
        parser.error(unwritable)
    with exits.caught("cem-compare"):
        results = {}
        for key, spec in runs.items():
            results[key] = train_one(spec)
            if results[key]["stopped"] or exits.received() is not None:
                return _stopped(f"while training {spec.stem} seed {spec.seed} (its "
                                f"{Path(results[key]['dir']) / 'train.log'} says what it saved)")
        first = next(iter(plans.values()))
        for (stem, steps, seed), row in results.items():
            if exits.received() is not None:
                return _stopped("before the report")
            if not row["ok"]:
                continue
            of_first = first.get(stem) == steps  # descent and recursion: the first table's runs
            analyze(row, runs[stem, steps, seed].cfg, ood=args.ood,
                    descent_batches=args.descent_batches
                    if of_first and _tied(cfgs[stem].model) else 0,
                    recursion=args.recursion_steps if of_first and stem in recursion_stems
                    else ())
    report = Report(command="cem-compare " + shlex.join(argv), cfgs=cfgs, baseline=baseline,
                    seeds=args.seeds, plans=plans, results=results, ood=args.ood,
                    descent_batches=args.descent_batches)
    report.write(args.out)
    print(f"cem-compare: wrote {args.out} and its figures")
    return 0 if all(r["ok"] for r in results.values()) else 1


def _stopped(where: str) -> int:
    """cem-compare's last line when a signal stopped it (no report is written: it would lack
    the runs still to do); returns 75, cem-train's status for a stop (`ExitStatus.STOPPED`)."""
    status = int(exits.ExitStatus.STOPPED)
    signum = exits.received()
    name = f" ({signal.Signals(signum).name})" if signum is not None else ""
    print(f"cem-compare: stopped by a signal{name} {where}; run the same command again to go on "
          f"from there (exit status {status})", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cem-compare",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--configs", nargs="+", required=True, metavar="YAML")
    parser.add_argument("--steps", type=positive_int, required=True,
                        help="training steps of every run (of the baseline with --budget flops)")
    parser.add_argument("--seeds", type=_int_list, default=[0], metavar="S,S,...",
                        help="run.seed = data.seed of the runs of each config (default 0)")
    parser.add_argument("--baseline", metavar="CONFIG",
                        help="the row the others are compared to (default: the first config "
                        "with tie_attention and tie_mlp false, else the first)")
    parser.add_argument("--budget", type=_budgets, default=["steps"], metavar="steps,flops",
                        help="equal steps, equal training FLOPs, or both (one table each)")
    parser.add_argument("--flops-configs", nargs="+", metavar="CONFIG",
                        help="the configs of the equal-FLOPs table (default: all)")
    parser.add_argument("--eval-every", type=positive_int,
                        help="validation interval (default steps/8)")
    parser.add_argument("--ood", default="milton", metavar="CORPUS",
                        help="out-of-domain text: milton (default), none, or a file, glob or "
                        "FORMAT:PATH")
    parser.add_argument("--descent-batches", type=_count, default=4, metavar="N",
                        help="validation batches of the energy descent statistics (0: none)")
    parser.add_argument("--recursion-configs", nargs="+", metavar="CONFIG",
                        help="configs whose runs are evaluated at --recursion-steps")
    parser.add_argument("--recursion-steps", type=_int_list, default=[1, 2, 3, 4],
                        metavar="N,N,...", help="CEM steps per sub-layer at test time")
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/compare"))
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


def _count(text: str) -> int:
    """`text` as an integer >= 0; raises argparse.ArgumentTypeError otherwise."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return int(text)


def _int_list(text: str) -> list[int]:
    """'0,1,2' → [0, 1, 2] (distinct integers >= 0, in order); raises ArgumentTypeError."""
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items) or len(set(map(int, items))) != len(items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of distinct "
                                         "integers >= 0, e.g. 0,1,2")
    return [int(t) for t in items]


def _budgets(text: str) -> list[str]:
    """'steps,flops' → ['steps', 'flops']; raises ArgumentTypeError for anything else."""
    items = [t.strip() for t in text.split(",")]
    if not items or any(t not in BUDGETS for t in items) or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"{text!r}: give steps, flops or steps,flops")
    return items


def _unwritable(out: Path, budgets: Sequence[str]) -> str:
    """Why the report cannot be written to `out` and its PNGs beside it ("" if it can);
    creates the folder of `out`."""
    for path in (out, *(figure_path(out, f) for f in figure_names(budgets))):
        if path.is_dir():
            return (f"--out {path} is a directory: give the Markdown file to write, e.g. "
                    f"{path / 'results.md'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return (f"cannot create {out.parent}, the folder of --out ({err.strerror}: "
                f"{err.filename}): choose another --out")
    if not os.access(out.parent, os.W_OK):
        return f"cannot write in {out.parent}, the folder of --out: choose another --out"
    return ""


def _stem(name: str) -> str:
    return Path(name).stem


def _tied(model) -> bool:
    return model.kinds != ("llama_attention", "swiglu")


def default_baseline(cfgs: Mapping[str, TrainConfig]) -> str:
    """The first config whose attention and MLP are both untied (Llama), else the first."""
    return next((s for s, c in cfgs.items() if not _tied(c.model)), next(iter(cfgs)))


def budget_steps(cfgs: Mapping[str, TrainConfig], baseline: str, steps: int, budget: str
                 ) -> dict[str, int]:
    """Training steps of each config under `budget`: "steps" gives every config `steps`;
    "flops" gives each the training FLOPs of `baseline` at `steps`, in whole steps:
    max(1, round(steps · F_baseline / F_config)), F = `flops_per_token` at the config's
    sequence length times its tokens per step (batch_size · seq_len)."""
    if budget == "steps":
        return dict.fromkeys(cfgs, steps)
    target = steps * step_flops(cfgs[baseline])
    return {stem: max(1, round(target / step_flops(cfg))) for stem, cfg in cfgs.items()}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run: config `stem` (file `path`) for `steps` with `seed`."""

    stem: str
    path: str
    steps: int
    seed: int
    args: tuple[str, ...]
    cfg: TrainConfig

    @classmethod
    def make(cls, stem: str, path: str, steps: int, seed: int, eval_every: int,
             runs_dir: Path, overrides: Sequence[str]) -> RunSpec:
        """The run's `cem-train` arguments and resolved config (raises as `load_config`)."""
        args = ("run.progress=false", *overrides, f"run.steps={steps}",
                f"run.eval_every={eval_every}", f"run.seed={seed}", f"data.seed={seed}",
                f"run.dir={runs_dir / stem / f'steps{steps}_seed{seed}'}")
        return cls(stem, path, steps, seed, args, load_config(path, list(args)))


def train_one(spec: RunSpec) -> dict:
    """Train (or resume, or reuse) one run; returns its result as a dict: "ok", "note",
    "dir", "seed", "steps", "wall_s" and `read_metrics`' fields."""
    cfg, run_dir = spec.cfg, Path(spec.cfg.run.dir)
    row = {"dir": str(run_dir), "seed": spec.seed, "steps": spec.steps, "ok": False, "note": "",
           "stopped": False}
    clash = _other_run(run_dir, cfg)
    if clash:
        row["note"] = clash
        print(f"cem-compare: {spec.stem}: {clash}", file=sys.stderr)
        return row
    book = run_dir / "compare.json"  # training wall time summed over invocations
    wall = json.loads(book.read_text())["wall_s"] if book.is_file() else 0.0
    if not _finished(run_dir, cfg):
        print(f"cem-compare: training {spec.stem} seed {spec.seed} ({spec.steps} steps) in "
              f"{run_dir}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(run_dir / "train.log", "a") as log:
            status = train_process(["--config", spec.path, *spec.args], log)
        wall += time.perf_counter() - start
        book.write_text(json.dumps({"wall_s": wall}))
        row["stopped"] = status == exits.ExitStatus.STOPPED
        if status != 0:
            words = _STATUS_WORDS.get(status, "killed" if status < 0 else "crashed")
            row["note"] = (f"cem-train exited with status {status} ({words}); see "
                           f"{run_dir / 'train.log'}")
            print(f"cem-compare: {spec.stem}: {row['note']}", file=sys.stderr)
    row.update(read_metrics(run_dir, cfg), wall_s=wall)
    row["ok"] = not row["note"] and _finished(run_dir, cfg)
    return row


def train_process(argv: list[str], log) -> int:
    """Run `python -m cem_jax.train ARGV` with its output in the file `log`; returns its exit
    status (`cem_jax.exits.ExitStatus`, or -N for a kill by signal N). It runs in its own
    session, and a SIGINT or SIGTERM that cem-compare receives meanwhile is passed on to it (a
    Ctrl-C in the terminal reaches it once: it stops at a safe point and saves)."""
    child = subprocess.Popen([sys.executable, "-m", "cem_jax.train", *argv], stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    with exits.forwarding(child.pid):
        return child.wait()


def read_metrics(run_dir: Path, cfg: TrainConfig) -> dict:
    """From `metrics.jsonl`: the final validation {"loss", "perplexity", "bits_per_byte"}
    ("eval", empty if none), the validation curve ("curve": [(step, bits per byte)]) and the
    median tokens/s of the training log windows after the first tenth of the steps."""
    by_kind = {"train": {}, "eval": {}}
    for r in logged_records(run_dir):  # a step logged again after a resume keeps its last
        by_kind[r["kind"]][r["step"]] = r
    evals = sorted(by_kind["eval"].items())
    speeds = [r["tokens_per_s"] for step, r in by_kind["train"].items()
              if step > cfg.run.steps / 10 and "tokens_per_s" in r]
    return {"eval": evals[-1][1] if evals else {},
            "curve": [(step, bits_per_byte_of(r)) for step, r in evals],
            "tokens_per_s": statistics.median(speeds) if speeds else math.nan}


def _finished(run_dir: Path, cfg: TrainConfig) -> bool:
    """The metrics hold the final validation (written once the last step is done), or, for a
    run without a validation split, the last step's training record."""
    kind = "eval" if cfg.data.has_validation else "train"
    return logged_values(run_dir, cfg.run.steps, kind) is not None


def _other_run(run_dir: Path, cfg: TrainConfig) -> str:
    """Why `run_dir` cannot hold this run ("" if it is new or the same run)."""
    if not (run_dir / "config.yaml").is_file():
        return ""
    saved = load_config(run_dir / "config.yaml").to_dict()
    new = cfg.to_dict()
    for section in ("model", "data", "optimizer"):
        if saved[section] != new[section]:
            return f"{run_dir} holds a run with another {section} section; use another --runs-dir"
    for key in ("steps", "seed"):
        if saved["run"][key] != new["run"][key]:
            return (f"{run_dir} holds a run with run.{key}={saved['run'][key]}; use another "
                    f"--runs-dir")
    return ""


# ----------------------------------------------------------------------------------------------
# Evaluations of a finished run (cached in RUN_DIR/analysis.json)
# ----------------------------------------------------------------------------------------------


def analyze(row: dict, cfg: TrainConfig, *, ood: str, descent_batches: int,
            recursion: Sequence[int]) -> None:
    """Add to `row` what is asked of its finished run: "ood" (`evaluate_run` on `ood` unless
    "none"); "descent" (`descent_statistics` on the first `descent_batches` validation batches,
    with "tokens" counted) and "precond" (`preconditioner_stats`) unless descent_batches is 0;
    "recursion": {N: {"bits_per_byte": validation at N steps per sub-layer, "descent": as
    above at N steps}} for N in `recursion`. Each result is computed once and kept in
    RUN_DIR/analysis.json; the checkpoint is loaded only when one is missing."""
    cache = AnalysisCache(Path(row["dir"]))
    if ood != "none":
        row["ood"] = cache.get(f"ood:{ood}", lambda run: _evaluate(run, ood))
    if not cfg.data.has_validation:
        return
    batches = max(descent_batches, 1)  # the energies of the recursion table need a sample

    def descent(steps: int) -> dict:
        return cache.get(f"descent:{batches}:{steps}", lambda run: _descent(run, batches, steps))

    def validation(steps: int) -> float:
        return cache.get(f"validation@{steps}",
                         lambda run: bits_per_byte_of(_evaluate(run, None, steps)))

    if descent_batches:
        row["descent"] = descent(cfg.model.steps)
        row["precond"] = cache.get("precond", _precond)
    if recursion:
        row["recursion"] = {n: {"bits_per_byte": validation(n), "descent": descent(n)}
                            for n in recursion}


class AnalysisCache:
    """Results by key in RUN_DIR/analysis.json; `get(key, compute)` calls compute(the loaded
    `cem_jax.rundir.Run`) only for a key it does not hold, and saves the result."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.path = run_dir, run_dir / "analysis.json"
        self.results = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.run = None

    def get(self, key: str, compute: Callable):
        if key not in self.results:
            if self.run is None:
                self.run = load_run(self.run_dir)
            print(f"cem-compare: {key} of {self.run_dir}", flush=True)
            self.results[key] = compute(self.run)
            self.path.write_text(json.dumps(self.results))
        return self.results[key]


def _evaluate(run: Run, text: str | None, steps: int | None = None) -> dict:
    """`evaluate_run` on the "milton" split, a text (a corpus spec) or, for None, validation."""
    if text == "milton":
        return evaluate_run(run, corpus="milton", progress=False, steps=steps)
    return evaluate_run(run, text, progress=False, steps=steps)


def _descent(run: Run, batches: int, steps: int) -> dict:
    """`descent_statistics` of `run` at `steps` CEM steps per sub-layer on its first `batches`
    validation batches, as JSON: {kind: {name: [L][steps]}, "tokens": count}."""
    data = make_eval_batches(run.config.data, run.tokenizer, "validation")
    sample = [data[i] for i in range(min(batches, len(data)))]
    model = dataclasses.replace(run.config.model, steps=steps)
    stats = descent_statistics(model, run.params, sample)
    return {**{kind: {k: v.tolist() for k, v in s.items()} for kind, s in stats.items()},
            "tokens": int(sum(np.sum(b["weights"] > 0) for b in sample))}


def _precond(run: Run) -> dict:
    return {kind: {k: v.tolist() for k, v in s.items()}
            for kind, s in preconditioner_stats(run.model()).items()}


if __name__ == "__main__":
    sys.exit(main())
