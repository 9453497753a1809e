"""`cem-compare`: train several configs alike, once per seed, and write a Markdown report of
their validation bits per byte (mean ± standard deviation over the seeds, and the paired
difference to a baseline row with a 95% interval), with a PNG of their validation curves beside
it; optionally at equal training FLOPs, on an out-of-domain text, with the energy descent of the
trained CEM layers and with test-time recursion.

    cem-compare --configs configs/shakespeare_llama.yaml configs/shakespeare_cem*.yaml \\
        --steps 400 --seeds 0,1,2 --out runs/compare/results.md --runs-dir runs/compare \\
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

Each run trains in its own `python -m cem_jax.cli.train` process, in
RUNS_DIR/<config stem>/steps<N>_seed<s> (its output in train.log there): a crash or a NaN in one
run is a row marked failed, not the end of the comparison, and every run starts from a fresh JAX
runtime, so one run's memory or compile cache does not shape the next one's speed. SIGINT or
SIGTERM (Ctrl-C) goes to the run in training, which stops at a safe point and saves, and ends
the comparison after it without a report (status 75, as cem-train's); so does a run stopped by a
signal of its own. Run again, it reuses finished runs (and the evaluations cached in their
analysis.json) and resumes unfinished ones. The overrides apply to every config. A run
directory holding another run (model, data, optimizer, steps or seed) is refused: use another
--runs-dir. Whatever follows the END marker in an existing output file (a reading of the
results) is kept on rewrite. This module parses the arguments; the comparison itself is
`cem_jax.compare`: which runs the tables need (`plan`), their training (`runs`), their
evaluation (`analysis`) and the report (tables, intervals, figures: `report`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cem_jax import exits
from cem_jax.cli.arguments import count, positive_int
from cem_jax.compare.plan import BUDGETS, default_baseline, plan_tables, run_specs
from cem_jax.data import files
from cem_jax.train_config import load_config

if TYPE_CHECKING:
    from cem_jax.compare.runs import Key, RunSpec

# The runs, their analysis and the report import JAX: they are imported once the arguments are
# parsed (`cem-compare --help` and a usage error answer at once).


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-compare`; returns 0 if every run finished, 1 if one failed, 2 on bad
    arguments or configs, 75 when a signal stopped it (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    paths = _config_paths(parser, args)
    try:
        cfgs = {stem: load_config(path, args.overrides) for stem, path in paths.items()}
        baseline = _stem(args.baseline) if args.baseline else default_baseline(cfgs)
        plans = plan_tables(cfgs, baseline, args.steps, args.budget,
                            {_stem(n) for n in args.flops_configs or cfgs})
        runs = run_specs(plans, paths, args.seeds, args.eval_every or max(1, args.steps // 8),
                         args.runs_dir, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"cem-compare: configuration error: {err}", file=sys.stderr)
        return 2
    unwritable = _unwritable(args.out, args.budget)  # found now, not after an hour of training
    if unwritable:
        parser.error(unwritable)
    with exits.caught("cem-compare"):
        results, stopped = _train_and_analyze(args, plans, runs)
        if stopped is not None:
            return stopped
    from cem_jax.compare.report import Report

    report = Report(command="cem-compare " + shlex.join(argv), cfgs=cfgs, baseline=baseline,
                    seeds=args.seeds, plans=plans, results=results, ood=args.ood,
                    descent_batches=args.descent_batches)
    report.write(args.out)
    print(f"cem-compare: wrote {args.out} and its figures")
    return 0 if all(r["ok"] for r in results.values()) else 1


def _train_and_analyze(args: argparse.Namespace, plans: Mapping[str, Mapping[str, int]],
                       runs: Mapping[Key, RunSpec]) -> tuple[dict[Key, dict], int | None]:
    """Train the runs (`train_all`), then analyze the finished ones (`analyze_all`: the
    descent and the recursion for the first table's runs only): (their rows by key, None),
    or, once a signal stopped it, (the rows so far, `_stopped`'s status)."""
    from cem_jax.compare.analysis import analyze_all
    from cem_jax.compare.runs import train_all

    results, stopped = train_all(runs)
    if stopped is not None:
        stem, _, seed = stopped
        log = files.join(results[stopped]["dir"], "train.log")
        return results, _stopped(f"while training {stem} seed {seed} (its {log} says what it "
                                 "saved)")
    if not analyze_all(results, runs, next(iter(plans.values())), ood=args.ood,
                       descent_batches=args.descent_batches,
                       recursion_stems={_stem(n) for n in args.recursion_configs or ()},
                       recursion=args.recursion_steps):
        return results, _stopped("before the report")
    return results, None


def _config_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """{stem: file} of --configs, once the arguments that name configs or steps are checked
    (a bad one ends the command through `parser.error`, status 2)."""
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
    return paths


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
    parser.add_argument("--configs", nargs="+", required=True, metavar="YAML",
                        help="the configs to compare, one row each "
                             "(e.g. configs/shakespeare_*.yaml)")
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
    parser.add_argument("--descent-batches", type=count, default=4, metavar="N",
                        help="validation batches of the energy descent statistics (0: none)")
    parser.add_argument("--recursion-configs", nargs="+", metavar="CONFIG",
                        help="configs whose runs are evaluated at --recursion-steps")
    parser.add_argument("--recursion-steps", type=_int_list, default=[1, 2, 3, 4],
                        metavar="N,N,...", help="CEM steps per sub-layer at test time")
    parser.add_argument("--out", type=Path, default=Path("runs/compare/results.md"),
                        help="the report (Markdown; its figures and analysis.json beside it; "
                             "default runs/compare/results.md)")
    parser.add_argument("--runs-dir", default="runs/compare",
                        help="where the runs are trained: a folder, or a bucket's URL")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides applied to every config (as cem-train's)")
    return parser


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
    from cem_jax.compare.report import figure_names, figure_path

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


if __name__ == "__main__":
    sys.exit(main())
