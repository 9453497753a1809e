"""The numbers of the study's report, from its records (`cem_jax.study.records`): stability of a
run (`diverged`, `spikes` at `spike_steps`), each config's values by seed (`Results`, on the
validation split or on Milton), and the comparisons of a report with their tests (`compare`:
paired t-intervals, two-sided p Holm-adjusted over the report's distinct comparisons, TOST's p,
the relative size and per-token perplexity ratio, and the words they earn:
`cem_jax.stats.verdict`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
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


SPLITS = ("validation", "milton")  # what a config's values measure: held-out works, Milton


def bits_per_byte(rec: dict, split: str = "validation") -> float | None:
    """The run's final bits per byte on `split` (SPLITS); None for a run that diverged or that
    was not evaluated on it."""
    if diverged(rec):
        return None
    return rec["val"]["bits_per_byte"] if split == "validation" else rec.get("ood_bits_per_byte")


def bytes_per_token(rec: dict, split: str = "validation") -> float | None:
    """UTF-8 bytes per token of `split` as the run's tokenizer cuts it, from its final loss
    (nats/token) and bits per byte; None where the record lacks either."""
    loss, bpb = ((rec["val"] or {}).get("loss"), bits_per_byte(rec)) if split == "validation" \
        else (rec.get("ood_loss"), bits_per_byte(rec, split))
    return loss / math.log(2) / bpb if loss and bpb else None


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
    sd: float  # of the paired differences
    ref_mean: float  # the reference's mean bits per byte over the same seeds
    bytes_per_token: float | None  # of the split compared (None: unknown)
    diverged: int = 0
    p_holm: float = math.nan
    words: str = ""

    @property
    def key(self) -> str:
        return f"{self.row} vs {self.ref}"

    @property
    def percent(self) -> float:
        """Δ as a percentage of the reference's bits per byte."""
        return 100 * self.mean / self.ref_mean

    @property
    def perplexity_ratio(self) -> float | None:
        """The row's per-token perplexity over the reference's: 2^(Δ · bytes per token)."""
        return None if self.bytes_per_token is None else 2 ** (self.mean * self.bytes_per_token)

    def size(self) -> str:
        """Direction and size first: "higher by 0.0169 bits/byte [95% +0.0082, +0.0256],
        +0.9%, ×1.033 per-token perplexity"."""
        ratio = self.perplexity_ratio
        return (f"{'higher' if self.mean > 0 else 'lower'} by {abs(self.mean):.4f} bits/byte "
                f"[95% {self.low:+.4f}, {self.high:+.4f}], {self.percent:+.1f}%"
                + (f", ×{ratio:.3f} per-token perplexity" if ratio is not None else ""))


class Results:
    """The records of a study, and what each config's runs say."""

    def __init__(self, study: Study, records: Mapping[RunKey, dict]):
        self.study, self.records = study, dict(records)

    def sweep_records(self, name: str) -> dict[float, dict]:
        """{rate: record} of a config's sweep."""
        return {k.lr: r for k, r in self.records.items()
                if k.name == name and self.study.is_sweep(k)}

    def sweep_split(self) -> str:
        """What the sweep's runs validate on: "selection" (the selection works) or
        "validation"."""
        splits = {r.get("eval_split", "validation") for name in self.study.all_configs()
                  for r in self.sweep_records(name).values()}
        return "selection" if "selection" in splits else "validation"

    def sweep(self, name: str) -> dict[float, float | None]:
        """{rate: final bits per byte on the sweep's split, None if diverged} of a config's
        sweep."""
        return {lr: bits_per_byte(r) for lr, r in self.sweep_records(name).items()}

    def best_rate(self, name: str) -> float | None:
        """The config's best rate; None until its sweep is done, or if every rate diverged."""
        results = self.sweep(name)
        return best_rate(sweep_rates(self.study, name, results), results)

    def best_at_edge(self, name: str) -> bool:
        """The config's best rate is the lowest or highest rate its sweep tried, so its optimum
        may lie beyond them."""
        best, tried = self.best_rate(name), self.sweep(name)
        return best is not None and best in (min(tried), max(tried))

    def all_diverged(self, name: str) -> bool:
        """The config's sweep is done and every rate of it diverged (no seeds are planned)."""
        results = self.sweep(name)
        rates = sweep_rates(self.study, name, results)
        return all(r in results for r in rates) and best_rate(rates, results) is None

    def runs(self, name: str, steps: int | None = None) -> dict[int, dict]:
        """{seed: record} of a config at its best rate for `steps` (default: the study's); a
        sweep run at those steps is not among them."""
        lr, steps = self.best_rate(name), steps or self.study.steps
        return {k.seed: r for k, r in sorted(self.records.items())
                if k.name == name and k.lr == lr and k.steps == steps
                and not self.study.is_sweep(k)}

    def values(self, name: str, steps: int | None = None, seeds: int | None = None,
               split: str = "validation") -> dict[int, float]:
        """{seed: final bits per byte on `split`} of the runs that did not diverge (of the first
        `seeds` seeds only, when given)."""
        return {s: v for s, r in self.runs(name, steps).items()
                if (v := bits_per_byte(r, split)) is not None and (seeds is None or s < seeds)}

    def bytes_per_token(self, name: str, steps: int | None = None,
                        split: str = "validation") -> float | None:
        """Bytes per token of `split` in the config's runs (the same in each: one tokenizer)."""
        found = [b for r in self.runs(name, steps).values()
                 if (b := bytes_per_token(r, split)) is not None]
        return statistics.fmean(found) if found else None

    def diverged(self, name: str, steps: int | None = None, seeds: int | None = None
                 ) -> set[int]:
        """The seeds of the config's runs that diverged (of the first `seeds` seeds, when
        given)."""
        return {s for s, r in self.runs(name, steps).items()
                if diverged(r) and (seeds is None or s < seeds)}


class Pair(NamedTuple):
    """What one comparison needs: each side's values by seed, the seeds that diverged on
    either side, the planned seeds not recorded yet on either side, and the split's bytes per
    token (None: unknown)."""

    row: str
    values: dict[int, float]
    ref: str
    base: dict[int, float]
    diverged: set[int]
    missing: int
    bytes_per_token: float | None = None


def compare(tables: Mapping[str, list[Pair]], margin: float, alpha: float
            ) -> tuple[dict[str, list[Comparison]], int]:
    """The comparisons of a report's tables ({table: pairs}) and the number of distinct tests
    among them. For each pair with >= 2 seeds in common: the mean paired difference, its 95%
    and 90% t-intervals, the paired t-test's p, Holm-adjusted over every distinct comparison
    of the tables (a pair shown in two tables on the same runs is one test, so it reads the
    same in both), TOST's p within ±margin (not adjusted: each equivalence is a claim about its
    own pair at level alpha, the level its seed count was planned for; equivalent to the 90%
    interval lying inside ±margin), and `verdict`'s words, which follow the 95% interval:
    headed "interim:" while planned seeds are missing (the reading may change), and saying how
    many seeds diverged and were left out. Pairs with fewer seeds are left out."""
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
                           tost_p(diffs, margin), statistics.stdev(diffs),
                           statistics.fmean(pair.base[s] for s in pair.values if s in pair.base),
                           pair.bytes_per_token, len(pair.diverged))
            test = (c.key, tuple(sorted(s for s in pair.values if s in pair.base)),
                    tuple(diffs))
            tests[test] = c.p
            found[table].append((pair, test, c))
    p_holm = holm(tests)
    return {table: [dataclasses.replace(c, p_holm=p_holm[test], words=(
        "interim: " if pair.missing else "") + verdict(c.low, c.high, c.tost < alpha) + (
            f"; {c.diverged} seed{'s' if c.diverged > 1 else ''} diverged and left out"
            if c.diverged else "")) for pair, test, c in rows]
        for table, rows in found.items()}, len(tests)


def _pair(results: Results, row: str, ref: str, planned: int, split: str,
          steps: Mapping[str, int], seeds: int | None = None) -> Pair:
    """Config `row` against `ref` on `split`, each at its `steps[name]` (default: the study's
    steps), over the first `seeds` seeds (all when None), `planned` seeds on each side."""

    def side(name: str) -> tuple[dict[int, float], set[int], int]:
        at = steps.get(name)
        return (results.values(name, at, seeds, split), results.diverged(name, at, seeds),
                sum(seeds is None or k < seeds for k in results.runs(name, at)))

    (values, bad, runs), (base, ref_bad, ref_runs) = side(row), side(ref)
    return Pair(row, values, ref, base, bad | ref_bad, max(0, planned - min(runs, ref_runs)),
                results.bytes_per_token(ref, steps.get(ref), split))


def main_pairs(results: Results, steps: Mapping[str, int] | None = None,
               split: str = "validation") -> list[Pair]:
    """The comparisons of the main table on `split`: every config against the baseline, every
    config but the two references against the control (the baseline with the CEM rows'
    preconditioner) when the study has one, and every config whose parent is neither against
    its parent. `steps[name]`: the configs of an equal-FLOPs table and their steps (default:
    every config at the study's steps); the references keep the study's steps."""
    s, steps = results.study, steps or {}
    pairs = []
    for name, config in s.configs.items():
        if steps and name not in steps:
            continue
        refs = [s.baseline] if name != s.baseline else []
        refs += [s.control] if s.control and name not in (s.baseline, s.control) else []
        refs += [config.parent] if config.parent and config.parent not in (s.baseline,
                                                                           s.control) else []
        pairs += [_pair(results, name, ref, s.seeds, split, steps) for ref in refs]
    return pairs


def size_pairs(results: Results, split: str = "validation") -> list[Pair]:
    """The size trend's comparisons on `split`: at each size, every config of the trend against
    the baseline at that size, over the first `sizes.seeds` seeds."""
    s = results.study
    return [_pair(results, s.sized(name, size), s.sized(s.baseline, size), s.size_seeds, split,
                  {}, s.size_seeds)
            for size in s.sizes for name in s.size_configs if name != s.baseline]
