"""The numbers of the study's report, from its records (`cem_jax.study.records`): stability of a
run (`diverged`, `spikes` at `spike_steps`), each config's values by seed (`Results`), and the
comparisons of a report with their tests (`compare`: paired t-intervals, two-sided p
Holm-adjusted over the report's distinct comparisons, TOST's p, and the words they earn:
`cem_jax.stats.verdict`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

from cem_jax.stats import differences, holm, paired_interval, paired_p, tost_p, verdict
from cem_jax.study.plan import RunKey, Study, best_rate, sweep_rates

SPIKE_NATS = 0.5  # a loss spike: a logged loss more than this above the running minimum
DIVERGENCE_STEP = 100  # a run diverges when it ends above its loss at this step


def spike_steps(rec: dict) -> list[int]:
    """The steps at which the logged training loss rose more than SPIKE_NATS above the running
    minimum of the losses before it (a run of such steps: its first; a non-finite loss counts
    as such a step)."""
    steps, low, above = [], math.inf, False
    for step, loss in rec["train_loss"]:
        now = loss is None or loss > low + SPIKE_NATS
        if now and not above:
            steps.append(step)
        above = now
        if loss is not None:
            low = min(low, loss)
    return steps


def spikes(rec: dict) -> int:
    """How many loss spikes the run had (`spike_steps`)."""
    return len(spike_steps(rec))


def diverged(rec: dict) -> bool:
    """cem-train stopped the run on a non-finite loss, or its last logged training loss is
    above its loss at step DIVERGENCE_STEP."""
    losses = dict(rec["train_loss"])
    if rec["status"] == "diverged" or not losses or losses[max(losses)] is None:
        return True
    at = losses.get(DIVERGENCE_STEP)
    return at is not None and losses[max(losses)] > at


def max_grad_norm(rec: dict) -> float:
    return max((g for _, g in rec["grad_norm"] if g is not None), default=math.nan)


def bits_per_byte(rec: dict) -> float | None:
    """The run's final validation bits per byte; None for a run that diverged."""
    return None if diverged(rec) else rec["val"]["bits_per_byte"]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Config `row` against config `ref` (d_s = row_s - ref_s, bits per byte) over the n seeds
    both have that did not diverge; `diverged`: the seeds of either that did."""

    row: str
    ref: str
    n: int
    mean: float
    low: float  # the 95% t-interval
    high: float
    low90: float  # the 90% t-interval: inside ±margin exactly when TOST shows equivalence
    high90: float
    p: float  # two-sided paired t-test, raw
    tost: float  # TOST within ±margin (not adjusted: see `compare`)
    diverged: int = 0
    p_holm: float = math.nan
    words: str = ""

    @property
    def key(self) -> str:
        return f"{self.row} vs {self.ref}"


class Results:
    """The records of a study, and what each config's runs say."""

    def __init__(self, study: Study, records: Mapping[RunKey, dict]):
        self.study, self.records = study, dict(records)

    def sweep_records(self, name: str) -> dict[float, dict]:
        """{rate: record} of a config's sweep."""
        s = self.study
        return {k.lr: r for k, r in self.records.items()
                if k.name == name and k.steps == s.sweep_steps and k.seed == s.sweep_seed}

    def sweep(self, name: str) -> dict[float, float | None]:
        """{rate: final validation bits per byte, None if diverged} of a config's sweep."""
        return {lr: bits_per_byte(r) for lr, r in self.sweep_records(name).items()}

    def best_rate(self, name: str) -> float | None:
        """The config's best rate; None until its sweep is done, or if every rate diverged."""
        results = self.sweep(name)
        return best_rate(sweep_rates(self.study, results), results)

    def all_diverged(self, name: str) -> bool:
        """The config's sweep is done and every rate of it diverged (no seeds are planned)."""
        results = self.sweep(name)
        rates = sweep_rates(self.study, results)
        return all(r in results for r in rates) and best_rate(rates, results) is None

    def runs(self, name: str, steps: int | None = None) -> dict[int, dict]:
        """{seed: record} of a config at its best rate for `steps` (default: the study's)."""
        lr, steps = self.best_rate(name), steps or self.study.steps
        return {k.seed: r for k, r in sorted(self.records.items())
                if k.name == name and k.lr == lr and k.steps == steps}

    def values(self, name: str, steps: int | None = None, seeds: int | None = None
               ) -> dict[int, float]:
        """{seed: final validation bits per byte} of the runs that did not diverge (of the
        first `seeds` seeds only, when given)."""
        return {s: v for s, r in self.runs(name, steps).items()
                if (v := bits_per_byte(r)) is not None and (seeds is None or s < seeds)}

    def diverged(self, name: str, steps: int | None = None, seeds: int | None = None
                 ) -> set[int]:
        """The seeds of the config's runs that diverged (of the first `seeds` seeds, when
        given)."""
        return {s for s, r in self.runs(name, steps).items()
                if diverged(r) and (seeds is None or s < seeds)}


class Pair(NamedTuple):
    """What one comparison needs: each side's values by seed, the seeds that diverged on
    either side, and the planned seeds not recorded yet on either side."""

    row: str
    values: dict[int, float]
    ref: str
    base: dict[int, float]
    diverged: set[int]
    missing: int


def compare(tables: Mapping[str, list[Pair]], margin: float, alpha: float
            ) -> tuple[dict[str, list[Comparison]], int]:
    """The comparisons of a report's tables ({table: pairs}) and the number of distinct tests
    among them. For each pair with >= 2 seeds in common: the mean paired difference, its 95%
    and 90% t-intervals, the paired t-test's p, Holm-adjusted over every distinct comparison
    of the report (the family-wise error of all its "better"/"worse" is <= alpha; a pair shown
    in two tables on the same runs is one test, so it reads the same in both), and TOST's p
    within ±margin (not adjusted: each "matches" is a claim about its own pair at level alpha,
    the level its seed count was planned for; equivalent to the 90% interval lying inside
    ±margin), and `verdict`'s words: headed "interim:" while planned seeds are missing (the
    reading may change), and saying how many seeds diverged and were left out. Pairs with
    fewer seeds are left out."""
    found, tests = {}, {}
    for table, pairs in tables.items():
        found[table] = []
        for pair in pairs:
            interval = paired_interval(pair.values, pair.base)
            if interval is None:
                continue
            narrow = paired_interval(pair.values, pair.base, level=1 - 2 * alpha)
            diffs = differences(pair.values, pair.base)
            c = Comparison(pair.row, pair.ref, interval.n, interval.mean, interval.low,
                           interval.high, narrow.low, narrow.high, paired_p(diffs),
                           tost_p(diffs, margin), len(pair.diverged))
            test = (c.key, tuple(sorted(s for s in pair.values if s in pair.base)),
                    tuple(diffs))
            tests[test] = c.p
            found[table].append((pair, test, c))
    p_holm = holm(tests)
    return {table: [dataclasses.replace(c, p_holm=p_holm[test], words=(
        "interim: " if pair.missing else "") + verdict(
            c.mean, p_holm[test] < alpha, c.tost < alpha) + (
            f"; {c.diverged} seed{'s' if c.diverged > 1 else ''} diverged and left out"
            if c.diverged else "")) for pair, test, c in rows]
        for table, rows in found.items()}, len(tests)


def main_pairs(results: Results, steps: Mapping[str, int] | None = None) -> list[Pair]:
    """The comparisons of the main table: every config against the baseline, every config but
    the two references against the control (the baseline with the CEM rows' preconditioner),
    and every config whose parent is neither against its parent. `steps[name]`: the configs of
    an equal-FLOPs table and their steps (default: every config at the study's steps); the
    references keep the study's steps."""
    s, steps = results.study, steps or {}

    def side(name: str) -> tuple[dict[int, float], set[int], int]:
        at = steps.get(name)
        return results.values(name, at), results.diverged(name, at), len(results.runs(name, at))

    pairs = []
    for name, config in s.configs.items():
        if steps and name not in steps:
            continue
        values, bad, runs = side(name)
        refs = [s.baseline] if name != s.baseline else []
        refs += [s.control] if name not in (s.baseline, s.control) else []
        refs += [config.parent] if config.parent and config.parent not in (s.baseline,
                                                                           s.control) else []
        for ref in refs:
            ref_values, ref_bad, ref_runs = side(ref)
            pairs.append(Pair(name, values, ref, ref_values, bad | ref_bad,
                              max(0, s.seeds - min(runs, ref_runs))))
    return pairs
