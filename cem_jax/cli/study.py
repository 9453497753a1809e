"""`cem-study`: run the study of a YAML file a run at a time, each run's file written as soon as
it is trained, then regenerate the report from the files.

    cem-study docs/study/study.yaml [--max-runs N] [--hours H] [--report-only]

A planned run whose file exists is never trained again, so the study completes over as many
invocations as it needs: `--max-runs` and `--hours` bound one invocation (a run started before
the time is up is finished). A reported run's file that lacks its Milton evaluation (written
before a sweep could run at the reported budget) is first completed from the run's final
checkpoint. A run that crashes is reported and skipped for this invocation; a diverged run is a
result (its file says so). SIGINT or SIGTERM goes to the run in training, which stops at a safe
point and saves; one that comes while no run trains stops cem-study at the next safe point (a
record or the report written whole, never half). Either way the report is then written from the
files so far (atomically, as every record) and the command exits 75 (run it again to resume that
run); a second SIGINT leaves at once. Exit status: 0, or 1 when a run crashed, 2 for a bad study
file or option, a record that is not one or that another study made (the message names the
file), a folder it cannot write (or, with --report-only, a records folder that does not exist),
a record to complete whose run directory is gone, or a code tree with uncommitted changes to
tracked files (a record names the commit that trained it); 75 when a signal stopped it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cem_jax import exits
from cem_jax.cli.arguments import count, non_negative_float

if TYPE_CHECKING:
    from cem_jax.study.analysis import Results
    from cem_jax.study.plan import Study


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-study`; returns its exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    with exits.caught("cem-study"):  # from the start: JAX's import, the report's writing
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from cem_jax.study.plan import flops_steps, load_study  # no JAX: a bad file answers at once
    from cem_jax.train_config import load_config

    try:
        study = load_study(args.study)
    except (ValueError, FileNotFoundError) as err:
        print(f"cem-study: error: {err}", file=sys.stderr)
        return 2
    from cem_jax.compare.report import step_flops  # these import JAX
    from cem_jax.study.analysis import Results
    from cem_jax.study.records import (
        complete_record,
        dirty_tree,
        lacks_measures,
        outputs,
        read_records,
        train_and_record,
    )
    from cem_jax.study.report import write_report

    try:
        flops = {name: step_flops(load_config(c.file, [*study.overrides, *c.overrides]))
                 for name, c in study.all_configs().items()}
        _check_writable(study.report.parent, "report")
        if not study.records.is_dir() and (args.report_only or study.report.exists()):
            why = ("there is nothing to report" if args.report_only else
                   f"its report {study.report} is from records elsewhere")
            raise ValueError(f"{study.records}, the folder of the study's records, is not a "
                             f"folder: {why} (the report is left as it was); set records in "
                             f"{args.study}" + ("" if args.report_only else
                                                f", or delete {study.report} to start afresh"))
        if not args.report_only:
            _check_writable(study.records, "records")
            dirty = dirty_tree(outputs=outputs(study))
            if dirty:
                raise ValueError(f"cannot record runs: {dirty} (--report-only needs no clean "
                                 "tree)")
        found = read_records(study)
    except (ValueError, FileNotFoundError) as err:
        print(f"cem-study: error: {err}", file=sys.stderr)
        return 2
    named = set(study.all_configs())
    strays = sorted({k.name for k in found} - named)
    if strays:
        print(f"cem-study: warning: records in {study.records} name configs the study does not "
              f"({', '.join(strays)}): the report leaves them out", file=sys.stderr)
    results = Results(study, {k: r for k, r in found.items() if k.name in named})
    deadline = None if args.hours is None else time.monotonic() + args.hours * 3600
    failed, trained, status = set(), 0, 0
    for key, rec in sorted(results.records.items()):
        if args.report_only or exits.received() is not None:
            break
        if lacks_measures(study, key, rec):
            print(f"cem-study: completing {key.label}: its Milton evaluation (and energy "
                  "descent) from its final checkpoint", flush=True)
            try:
                results.records[key] = complete_record(study, key, rec)
            except (ValueError, FileNotFoundError) as err:
                print(f"cem-study: error: {err}", file=sys.stderr)
                return 2
    while not args.report_only and exits.received() is None:
        todo = [k for k in _planned(study, results, flops)
                if k not in results.records and k not in failed]
        if not todo or trained == args.max_runs or (
                deadline is not None and time.monotonic() >= deadline):
            break
        key = todo[0]
        print(f"cem-study: run {key.label} ({len(todo)} planned run"
              f"{'s' * (len(todo) != 1)} to go, this one included; the plan grows as "
              "sweeps finish)", flush=True)
        rec, row = train_and_record(study, key)
        trained += 1
        if row["stopped"]:
            status = int(exits.ExitStatus.STOPPED)
            break
        if rec is None:
            failed.add(key)
            status = 1
            print(f"cem-study: {key.label}: {row['note']}", file=sys.stderr)
        else:
            results.records[key] = rec
    planned = _planned(study, results, flops)
    write_report(study, results, planned, flops_steps(study, flops))
    left = sum(k not in results.records for k in planned)
    print(f"cem-study: wrote {study.report}; {len(planned) - left} of {len(planned)} planned "
          f"runs recorded" + (" (the study is complete)" if not left else ""))
    if status == exits.ExitStatus.STOPPED or exits.received() is not None:
        print("cem-study: stopped by a signal; run the same command again to go on",
              file=sys.stderr)
        return int(exits.ExitStatus.STOPPED)
    return status


def _check_writable(folder: Path, field: str) -> None:
    """Create `folder` (the study's `field`); raises ValueError if it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create {folder}, the folder of the study's {field} "
                         f"({err.strerror}): set another in the study file's {field}") from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write in {folder}, the folder of the study's {field}: "
                         f"set another in the study file's {field}")


def _planned(study: Study, results: Results, flops: dict[str, float]):
    from cem_jax.study.plan import plan

    sweeps = {name: results.sweep(name) for name in study.all_configs()}
    return plan(study, sweeps, flops)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cem-study",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("study", help="the study's YAML file, e.g. docs/study/study.yaml")
    parser.add_argument("--max-runs", type=count, metavar="N",
                        help="train at most N runs in this invocation (default: all; 0: "
                        "none, only complete records and write the report)")
    parser.add_argument("--hours", type=non_negative_float, metavar="H",
                        help="start no run after H hours (default: no limit)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: regenerate the report from the files")
    return parser


if __name__ == "__main__":
    sys.exit(main())
