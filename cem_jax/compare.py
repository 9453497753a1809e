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
runtime, so one run's memory or compile cache does not shape the next one's speed. Run again,
it reuses finished runs (and the evaluations cached in their analysis.json) and resumes
unfinished ones. The overrides apply to every config. A run directory holding another run
(model, data, optimizer, steps or seed) is refused: use another --runs-dir. Whatever follows the
END marker in an existing output file (a reading of the results) is kept on rewrite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import scipy.stats

from cem_jax.data import make_eval_batches
from cem_jax.evaluate import bits_per_byte_of, evaluate_run, positive_int
from cem_jax.monitor import descent_statistics, preconditioner_stats
from cem_jax.rundir import Run, load_run
from cem_jax.train.config import TrainConfig, load_config
from cem_jax.train.dry_run import param_counts as abstract_param_counts
from cem_jax.train.metrics import flops_per_token

PARTS = ("embedding", "attention", "mlp", "norm", "preconditioner", "head", "total")
BUDGETS = ("steps", "flops")
KINDS = ("attention", "mlp")
SHORT = {"attention": "attn", "mlp": "mlp"}
END = "<!-- end of cem-compare output: text below this line is kept on rewrite -->"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-compare`; returns 0 if every run finished, 1 if one failed, 2 on bad
    arguments or configs."""
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
    results = {key: train_one(spec) for key, spec in runs.items()}
    first = next(iter(plans.values()))
    for (stem, steps, seed), row in results.items():
        if row["ok"]:
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


def _stem(name: str) -> str:
    return Path(name).stem


def _tied(model) -> bool:
    return model.tie_attention or model.tie_mlp


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


def step_flops(cfg: TrainConfig) -> float:
    """Training FLOPs of one optimizer step: `flops_per_token` × batch_size × seq_len."""
    tokens = cfg.data.batch_size * cfg.data.seq_len
    return flops_per_token(cfg.model, cfg.data.seq_len) * tokens


@dataclasses.dataclass(frozen=True)
class Interval:
    """Mean of n paired differences and its two-sided t-interval [low, high]."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def separated(self) -> bool:
        """The interval excludes 0."""
        return self.low > 0 or self.high < 0


def paired_interval(values: Mapping[int, float], base: Mapping[int, float],
                    level: float = 0.95) -> Interval | None:
    """The differences values[s] - base[s] over the seeds s in both: their mean and the
    `level` t-interval mean ± t_{(1+level)/2, n-1} · sd / √n (Student's t, sd with n - 1);
    None with fewer than 2 seeds in common."""
    diffs = [values[s] - base[s] for s in values if s in base]
    if len(diffs) < 2:
        return None
    mean = statistics.fmean(diffs)
    half = scipy.stats.t.ppf((1 + level) / 2, len(diffs) - 1) * statistics.stdev(diffs) \
        / math.sqrt(len(diffs))
    return Interval(mean, mean - half, mean + half, len(diffs))


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
    row = {"dir": str(run_dir), "seed": spec.seed, "steps": spec.steps, "ok": False, "note": ""}
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
            status = subprocess.run([sys.executable, "-m", "cem_jax.train", "--config",
                                     spec.path, *spec.args], stdout=log,
                                    stderr=subprocess.STDOUT).returncode
        wall += time.perf_counter() - start
        book.write_text(json.dumps({"wall_s": wall}))
        if status != 0:
            row["note"] = f"cem-train exited with status {status}; see {run_dir / 'train.log'}"
            print(f"cem-compare: {spec.stem}: {row['note']}", file=sys.stderr)
    row.update(read_metrics(run_dir, cfg), wall_s=wall)
    row["ok"] = not row["note"] and _finished(run_dir, cfg)
    return row


def param_counts(cfg: TrainConfig) -> dict[str, int]:
    """The config's parameter counts by part (every part of `PARTS`, 0 when absent)."""
    counts = abstract_param_counts(cfg.model)
    return {part: counts.get(part, 0) for part in PARTS}


def read_metrics(run_dir: Path, cfg: TrainConfig) -> dict:
    """From `metrics.jsonl`: the final validation {"loss", "perplexity", "bits_per_byte"}
    ("eval", empty if none), the validation curve ("curve": [(step, bits per byte)]) and the
    median tokens/s of the training log windows after the first tenth of the steps."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] \
        if path.is_file() else []
    by_kind = {"train": {}, "eval": {}}
    for r in records:  # a step logged again after a resume keeps its last record
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
    path = run_dir / "metrics.jsonl"
    kind = "eval" if cfg.data.has_validation else "train"
    return path.is_file() and any(
        r["kind"] == kind and r["step"] == cfg.run.steps
        for r in map(json.loads, path.read_text().splitlines()))


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


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def figure_path(out: Path, name: str) -> Path:
    """A PNG next to the Markdown file: results.md, "descent" → results_descent.png."""
    return out.with_name(f"{out.stem}_{name}.png")


def _figures(budgets: Sequence[str]) -> list[str]:
    return [*(f"curves_{b}" for b in budgets), "descent"]


def _unwritable(out: Path, budgets: Sequence[str]) -> str:
    """Why the report cannot be written to `out` and its PNGs beside it ("" if it can);
    creates the folder of `out`."""
    for path in (out, *(figure_path(out, f) for f in _figures(budgets))):
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


@dataclasses.dataclass
class Report:
    """Everything `cem-compare` writes: `results[(stem, steps, seed)]` are `train_one` rows
    with `analyze`'s additions; `plans[budget]` maps each config of a table to its steps."""

    command: str
    cfgs: dict[str, TrainConfig]
    baseline: str
    seeds: list[int]
    plans: dict[str, dict[str, int]]
    results: dict[tuple[str, int, int], dict]
    ood: str
    descent_batches: int
    counts: dict[str, dict[str, int]] = dataclasses.field(init=False)

    def __post_init__(self):
        self.counts = {stem: param_counts(cfg) for stem, cfg in self.cfgs.items()}

    def rows(self, stem: str, steps: int) -> dict[int, dict]:
        """{seed: result} of a config's runs at `steps`."""
        return {seed: self.results[stem, steps, seed] for seed in self.seeds
                if (stem, steps, seed) in self.results}

    def per_seed(self, stem: str, steps: int, key: Callable[[dict], float | None] = None
            ) -> dict[int, float]:
        """{seed: figure} over the finished runs (default figure: validation bits per byte)."""
        key = key or (lambda r: bits_per_byte_of(r["eval"]))
        return {s: v for s, r in self.rows(stem, steps).items()
                if r["ok"] and (v := key(r)) is not None}

    def write(self, out: Path) -> None:
        """Write the Markdown file (keeping any text after END in an existing one) and PNGs."""
        lines = ["# cem-compare results", "", "Produced by", "", "```bash", self.command, "```",
                 "", self._intro(), ""]
        for budget, plan in self.plans.items():
            lines += self._table(budget, plan, out)
        lines += self._params_table()
        first = next(iter(self.plans.values()))
        lines += self._descent(first, out)
        lines += self._recursion(first)
        notes = [f"- {stem} seed {seed} ({steps} steps): {r['note']}"
                 for (stem, steps, seed), r in self.results.items() if r["note"]]
        lines += (["## Failed runs", "", *notes, ""] if notes else []) + [END, ""]
        kept = out.read_text().split(END, 1)[1].lstrip("\n") \
            if out.is_file() and END in out.read_text() else ""
        out.write_text("\n".join(lines) + kept)

    def _intro(self) -> str:
        wall = sum(r.get("wall_s", 0.0) for r in self.results.values())
        ood = "" if self.ood == "none" else (
            f" The out-of-domain column is bits per byte on {self.ood!r} (whole text).")
        return (f"Seeds {', '.join(map(str, self.seeds))}: each config trains once per seed, "
                "with run.seed = data.seed = the seed (model init and data order). Validation "
                "bits per byte after the last step (the whole validation split; with "
                "run.eval_batches, its first batches and an estimate), as mean ± standard "
                f"deviation over the seeds. Δ: the difference to the baseline "
                f"({self.baseline}) paired by seed, mean [95% t-interval]; \"not separated\" "
                f"when the interval contains 0.{ood} tokens/s: median over the training log "
                "windows after the first tenth of the steps (compilation and evaluation "
                "excluded); wall time: of one `cem-train` process (start-up, compilation, "
                f"evaluations, checkpoints and the sample included). Runs: {len(self.results)}, "
                f"{wall / 60:.0f} min of training in all.")

    def _table(self, budget: str, plan: dict[str, int], out: Path) -> list[str]:
        base_steps = plan[self.baseline]
        if budget == "steps":
            title = f"## Equal steps ({base_steps} steps)"
        else:
            flops = base_steps * step_flops(self.cfgs[self.baseline])
            title = (f"## Equal training FLOPs ({flops:.3g} FLOPs per run: {self.baseline} at "
                     f"{base_steps} steps; analytic `flops_per_token`)")
        ood = [] if self.ood == "none" else [
            f"{'Milton' if self.ood == 'milton' else 'out-of-domain'} bits/byte"]
        head = ["config", "params", "steps", "training FLOPs", "seeds", "val bits/byte",
                f"Δ vs {self.baseline} (95% CI)", *ood, "tokens/s", "wall time"]
        lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        base = self.per_seed(self.baseline, base_steps)
        for stem, steps in plan.items():
            rows, values = self.rows(stem, steps), self.per_seed(stem, steps)
            ok = [r for r in rows.values() if r["ok"]]
            name = stem if len(ok) == len(rows) else f"{stem} ({len(rows) - len(ok)} failed)"
            delta = "baseline" if stem == self.baseline else _delta(paired_interval(values, base))
            cells = [name, f"{self.counts[stem]['total']:,}", str(steps),
                     f"{steps * step_flops(self.cfgs[stem]):.3g}", str(len(values)),
                     _mean_sd(values.values()), delta]
            if ood:
                cells.append(_mean_sd(self.per_seed(stem, steps, lambda r: bits_per_byte_of(
                    r["ood"]) if "ood" in r else None).values()))
            cells += [_num(_mean(r.get("tokens_per_s") for r in ok), 0, ","),
                      _num(_mean(r["wall_s"] for r in ok) / 60, 1) + " min" if ok else "–"]
            lines.append("| " + " | ".join(cells) + " |")
        png = figure_path(out, f"curves_{budget}")
        self._plot_curves(budget, plan, png)
        return lines + ["", f"![validation bits per byte, mean over the seeds]({png.name})", ""]

    def _params_table(self) -> list[str]:
        base = self.counts[self.baseline]["total"]
        head = ["config", *PARTS, f"vs {self.baseline}"]
        lines = ["## Parameters by part (`count_params`)", "", "| " + " | ".join(head) + " |",
                 "|" + "---|" * len(head)]
        for stem, counts in self.counts.items():
            lines.append("| " + " | ".join([stem, *(f"{counts[p]:,}" for p in PARTS),
                                            f"{counts['total'] / base - 1:+.1%}"]) + " |")
        return lines + [""]

    def _descent(self, plan: dict[str, int], out: Path) -> list[str]:
        stats = {stem: [r["descent"] for r in self.rows(stem, steps).values() if "descent" in r]
                 for stem, steps in plan.items()}
        stats = {stem: s for stem, s in stats.items() if s}
        if not stats:
            return []
        tokens = next(iter(stats.values()))[0]["tokens"]
        L = max(len(s[0][k]["down"]) for s in stats.values() for k in KINDS if k in s[0])
        head = ["config", "sub-layer", "step", *(f"layer {i}" for i in range(L))]
        lines = ["## Energy descent in the trained CEM layers", "",
                 f"On the first {self.descent_batches} validation batches ({tokens:,} tokens), "
                 "per layer and step: the fraction of tokens whose energy went down across the "
                 "update / the mean energy change (after − before, in the energy's units), "
                 "mean over the seeds. The default update applies the y-gradient to x "
                 "(DESIGN.md §1), so descent is not guaranteed: the cells listed below the "
                 "table are where it does not hold for every token.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        up = []
        for stem, per_seed in stats.items():
            for kind in KINDS:
                if kind not in per_seed[0]:
                    continue
                down, change = (np.mean([s[kind][k] for s in per_seed], axis=0)
                                for k in ("down", "change"))
                for k in range(down.shape[1]):
                    cells = [f"{down[i, k]:.0%} / {change[i, k]:+.3g}" for i in range(len(down))]
                    lines.append("| " + " | ".join([stem, kind, str(k + 1), *cells]) + " |")
                    up += [f"{stem} {kind} layer {i} step {k + 1} ({1 - down[i, k]:.1%} of "
                           f"the tokens{', mean energy up' if change[i, k] > 0 else ''})"
                           for i in range(len(down)) if down[i, k] < 0.995 or change[i, k] > 0]
        png = figure_path(out, "descent")
        _plot_descent(stats, png)
        lines += ["", "Where the energy went up for more than 0.5% of the tokens (or on "
                  "average): " + ("; ".join(up) if up else "nowhere") + ".", "",
                  f"![fraction of tokens whose energy went down]({png.name})", ""]
        return lines + self._precond_table(plan, L)

    def _precond_table(self, plan: dict[str, int], L: int) -> list[str]:
        head = ["config", "sub-layer", *(f"layer {i}" for i in range(L))]
        lines = ["### Learned preconditioner P (first seed's run)", "",
                 "softplus(ρ), P's diagonal: mean [min, max] over its entries (one for a scalar "
                 "P); ‖U‖: Frobenius norm of the low-rank part of a dplr P.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for stem, steps in plan.items():
            precond = next((r["precond"] for r in self.rows(stem, steps).values()
                            if r.get("precond")), None)
            for kind, p in (precond or {}).items():
                cells = [f"{p['mean'][i]:.3f}" + (f" [{p['min'][i]:.3f}, {p['max'][i]:.3f}]"
                                                  if p["min"][i] != p["max"][i] else "")
                         + (f", ‖U‖ {p['u_norm'][i]:.3f}" if "u_norm" in p else "")
                         for i in range(len(p["mean"]))]
                lines.append("| " + " | ".join([stem, kind, *cells]) + " |")
        return lines + [""]

    def _recursion(self, plan: dict[str, int]) -> list[str]:
        stems = [s for s, steps in plan.items()
                 if any("recursion" in r for r in self.rows(s, steps).values())]
        if not stems:
            return []
        head = ["config", "trained steps", "N", "seeds", "val bits/byte",
                "Δ vs N = trained (95% CI)", "attention energy: before → after each step",
                "MLP energy: before → after each step"]
        lines = ["## Test-time recursion", "",
                 "Each run evaluated with every sub-layer run for N CEM steps (its weights "
                 "unchanged: the steps share them): validation bits per byte over the whole "
                 "split, and the energy before step 1 and after steps 1…N (mean over layers, "
                 "the tokens of the descent sample, and seeds).", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for stem in stems:
            trained = self.cfgs[stem].model.steps
            runs = {s: r for s, r in self.rows(stem, plan[stem]).items() if "recursion" in r}
            ns = next(iter(runs.values()))["recursion"]
            for n in ns:
                values = {s: r["recursion"][n]["bits_per_byte"] for s, r in runs.items()}
                ref = {s: r["recursion"][trained]["bits_per_byte"] for s, r in runs.items()
                       if trained in r["recursion"]}
                delta = "–" if n == trained or not ref else _delta(paired_interval(values, ref))
                energies, samples = [], [r["recursion"][n]["descent"] for r in runs.values()]
                for kind in KINDS:  # per run, means over the layers: E before step 1, after each
                    chains = [[np.mean(np.asarray(d[kind]["before"])[:, 0]),
                               *np.mean(d[kind]["after"], axis=0)] for d in samples if kind in d]
                    energies.append(" → ".join(f"{e:.3f}" for e in np.mean(chains, axis=0))
                                    if chains else "–")
                lines.append("| " + " | ".join([stem, str(trained), str(n), str(len(values)),
                                                _mean_sd(values.values()), delta, *energies])
                             + " |")
        return lines + [""]

    def _plot_curves(self, budget: str, plan: dict[str, int], path: Path) -> None:
        """Validation bits per byte (mean over the seeds) vs step, or vs training FLOPs."""
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for stem, steps in plan.items():
            curves = [dict(r["curve"]) for r in self.rows(stem, steps).values()
                      if r["ok"] and r.get("curve")]
            ticks = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if ticks:
                x = np.array(ticks, float) * (step_flops(self.cfgs[stem]) if budget == "flops"
                                              else 1)
                ax.plot(x, [np.mean([c[t] for c in curves]) for t in ticks], marker="o",
                        markersize=3, label=stem)
        ax.set_xlabel("training FLOPs" if budget == "flops" else "step")
        ax.set_ylabel("validation bits per byte")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _plot_descent(stats: dict[str, list[dict]], path: Path) -> None:
    """One heatmap per config: layers (rows) × (sub-layer, step) in order of execution
    (columns), coloured by the fraction of tokens whose energy went down."""
    plt = _pyplot()
    cols = min(3, len(stats))
    rows = -(-len(stats) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1, 3 * rows), dpi=110,
                             squeeze=False, layout="constrained")
    for ax, (stem, per_seed) in zip(axes.flat, stats.items(), strict=False):
        kinds = [k for k in KINDS if k in per_seed[0]]
        down = {k: np.mean([s[k]["down"] for s in per_seed], axis=0) for k in kinds}
        steps = down[kinds[0]].shape[1]
        grid = np.stack([down[k][:, j] for j in range(steps) for k in kinds], axis=1)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(grid.shape[1]),
                      [f"{SHORT[k]} {j + 1}" for j in range(steps) for k in kinds], fontsize=7)
        ax.set_yticks(range(grid.shape[0]), [f"layer {i}" for i in range(grid.shape[0])],
                      fontsize=7)
        ax.set_title(stem, fontsize=8)
    for ax in list(axes.flat)[len(stats):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="fraction of tokens whose energy went down")
    fig.savefig(path)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def _mean_sd(values) -> str:
    """'2.1758 ± 0.0123' (mean ± sample standard deviation), '2.1758' for one, '–' for none."""
    values = list(values)
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def _delta(interval: Interval | None) -> str:
    if interval is None:
        return "– (needs 2 seeds)"
    text = f"{interval.mean:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]"
    return text if interval.separated else text + " not separated"


def _num(value, digits: int, sep: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:{sep}.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
