"""The evaluations of a comparison's finished runs, from their checkpoints in this process, each
computed once and cached in RUN_DIR/analysis.json (`AnalysisCache`): bits per byte on an
out-of-domain text, the energy descent statistics and learned preconditioners of a run's CEM
layers, and test-time recursion (`analyze`; every run of a comparison: `analyze_all`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from cem_jax import exits
from cem_jax.compare.plan import tied
from cem_jax.compare.runs import Key, RunSpec
from cem_jax.data import files, make_eval_batches
from cem_jax.evaluate import bits_per_byte_of, evaluate_run
from cem_jax.monitor import descent_statistics, preconditioner_stats
from cem_jax.rundir import Run, load_run
from cem_jax.train_config import TrainConfig


def analyze_all(results: Mapping[Key, dict], runs: Mapping[Key, RunSpec],
                first: Mapping[str, int], *, ood: str, descent_batches: int,
                recursion_stems: Collection[str], recursion: Sequence[int]) -> bool:
    """`analyze` each finished run into its row of `results` (`runs` holds their specs): the
    energy descent (of the configs with a tied sub-layer) and the test-time recursion (of the
    configs of `recursion_stems`) only for the runs of the first table, whose plan is `first`
    ({stem: steps}). Returns False when a signal came first (the rows after it are left as
    they are), else True."""
    for key, row in results.items():
        if exits.received() is not None:
            return False
        if not row["ok"]:
            continue
        stem, steps, _ = key
        cfg = runs[key].cfg
        of_first = first.get(stem) == steps
        analyze(row, cfg, ood=ood,
                descent_batches=descent_batches if of_first and tied(cfg.model) else 0,
                recursion=recursion if of_first and stem in recursion_stems else ())
    return True


def analyze(row: dict, cfg: TrainConfig, *, ood: str, descent_batches: int,
            recursion: Sequence[int]) -> None:
    """Add to `row` what is asked of its finished run: "ood" (`evaluate_run` on `ood` unless
    "none"); "descent" (`descent_statistics` on the first `descent_batches` validation batches,
    with "tokens" counted) and "precond" (`preconditioner_stats`) unless descent_batches is 0;
    "recursion": {N: {"bits_per_byte": validation at N steps per sub-layer, "descent": as
    above at N steps}} for N in `recursion`. Each result is computed once and kept in
    RUN_DIR/analysis.json; the checkpoint is loaded only when one is missing."""
    cache = AnalysisCache(row["dir"])
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

    def __init__(self, run_dir: str):
        self.run_dir, self.path = run_dir, files.join(run_dir, "analysis.json")
        self.results = json.loads(files.read_text(self.path)) if files.is_file(self.path) \
            else {}
        self.run = None

    def get(self, key: str, compute: Callable):
        if key not in self.results:
            if self.run is None:
                self.run = load_run(self.run_dir)
            print(f"cem-compare: {key} of {self.run_dir}", flush=True)
            self.results[key] = compute(self.run)
            files.write_text(self.path, json.dumps(self.results))
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
