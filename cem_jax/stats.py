"""The statistics of the comparison reports (`cem_jax.compare.report`, `cem_jax.study`): paired
differences by seed with a t-interval, the two one-sided tests of equivalence within a margin
(TOST), Holm's step-down adjustment over a family of tests, the seed count a TOST needs, and the
words a comparison earns.

All tests are paired t-tests on d_s = a_s - b_s over the seeds s both runs have (n - 1 degrees
of freedom, sd with n - 1). TOST: Schuirmann (1987), "A comparison of the two one-sided tests
procedure and the power approach for assessing the equivalence of average bioavailability";
Holm (1979), "A simple sequentially rejective multiple test procedure".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Hashable, Mapping

import scipy.stats


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


def differences(values: Mapping[int, float], base: Mapping[int, float]) -> list[float]:
    """values[s] - base[s] over the seeds s in both, in the order of `values`."""
    return [values[s] - base[s] for s in values if s in base]


def paired_interval(values: Mapping[int, float], base: Mapping[int, float],
                    level: float = 0.95) -> Interval | None:
    """The differences values[s] - base[s] over the seeds s in both: their mean and the
    `level` t-interval mean ± t_{(1+level)/2, n-1} · sd / √n (Student's t, sd with n - 1);
    None with fewer than 2 seeds in common."""
    diffs = differences(values, base)
    if len(diffs) < 2:
        return None
    mean = statistics.fmean(diffs)
    half = scipy.stats.t.ppf((1 + level) / 2, len(diffs) - 1) * _stderr(diffs)
    return Interval(mean, mean - half, mean + half, len(diffs))


def paired_p(diffs: list[float]) -> float:
    """Two-sided p-value of the paired t-test of mean(diffs) = 0 (n >= 2); 0 or 1 when the
    differences do not vary (1 if they are all 0)."""
    se = _stderr(diffs)
    mean = statistics.fmean(diffs)
    if se == 0:
        return 1.0 if mean == 0 else 0.0
    return float(2 * scipy.stats.t.sf(abs(mean) / se, len(diffs) - 1))


def tost_p(diffs: list[float], margin: float) -> float:
    """p-value of equivalence within ±margin (TOST: the larger of the one-sided p-values of
    mean <= -margin and mean >= +margin, n >= 2); equivalence is shown at level α when it is
    below α, i.e. when the (1 - 2α) t-interval lies inside (-margin, +margin)."""
    se, mean, df = _stderr(diffs), statistics.fmean(diffs), len(diffs) - 1
    if se == 0:
        return 0.0 if abs(mean) < margin else 1.0
    lower = scipy.stats.t.sf((mean + margin) / se, df)  # H0: mean <= -margin
    upper = scipy.stats.t.cdf((mean - margin) / se, df)  # H0: mean >= +margin
    return float(max(lower, upper))


def holm(pvalues: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """Holm-adjusted p-values of a family: sorted ascending p_(1) <= ... <= p_(m), the
    adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) · p_(j)); a test is rejected at level α
    when its adjusted p-value is below α (family-wise error <= α)."""
    if not all(math.isfinite(p) and 0 <= p <= 1 for p in pvalues.values()):
        raise ValueError(f"p-values must be finite and in [0, 1], got {dict(pvalues)}")
    order = sorted(pvalues, key=pvalues.get)
    adjusted, running = {}, 0.0
    for rank, key in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * pvalues[key]))
        adjusted[key] = running
    return adjusted


def equivalence_margin(n: int, sd: float, alpha: float = 0.05, power: float = 0.8,
                       delta: float = 0.0) -> float:
    """The smallest margin that a TOST at level `alpha` over n paired seeds shows with
    probability `power` when the true difference is `delta` and the paired differences have
    standard deviation `sd`: |delta| + (t_{1-α, n-1} + t_{q, n-1}) · sd / √n, with q = 1 -
    (1 - power)/2 at delta = 0 (either one-sided test may fail) and q = power otherwise (the t
    approximations of Julious (2004), "Sample sizes for clinical trials with normal data",
    §4)."""
    q = 1 - (1 - power) / 2 if delta == 0 else power
    return float(abs(delta) + (scipy.stats.t.ppf(1 - alpha, n - 1) + scipy.stats.t.ppf(q, n - 1))
                 * sd / math.sqrt(n))


MAX_SEEDS = 10_000  # beyond any study: a plan that needs more has a field out of range


def seeds_for_equivalence(margin: float, sd: float, alpha: float = 0.05, power: float = 0.8,
                          delta: float = 0.0) -> int:
    """The smallest number of paired seeds n >= 2 whose `equivalence_margin` (at a true
    difference `delta`) is <= margin; raises ValueError unless margin and sd are > 0 and
    |delta| < margin, or when more than `MAX_SEEDS` would be needed."""
    if margin <= 0 or sd <= 0 or abs(delta) >= margin:
        raise ValueError(f"margin and sd must be > 0 and |delta| < margin, got margin={margin}, "
                         f"sd={sd}, delta={delta}")
    def enough(n: int) -> bool:  # the margin shrinks as n grows: search by halving
        return equivalence_margin(n, sd, alpha, power, delta) <= margin

    if enough(MAX_SEEDS):
        low, high = 1, MAX_SEEDS  # not enough(low) or low == 1; enough(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if enough(mid) else (mid, high)
        return max(high, 2)
    raise ValueError(f"more than {MAX_SEEDS:,} seeds would be needed (margin {margin}, sd {sd}, "
                     f"alpha {alpha}, power {power}, delta {delta})")


def slope_interval(x: list[float], y: list[float], level: float = 0.95) -> Interval | None:
    """The least-squares slope of y on x and its `level` t-interval (n - 2 degrees of
    freedom, `scipy.stats.linregress`'s standard error); None with fewer than 3 points or a
    single x."""
    if len(x) < 3 or len(set(x)) < 2:
        return None
    fit = scipy.stats.linregress(x, y)
    half = scipy.stats.t.ppf((1 + level) / 2, len(x) - 2) * fit.stderr
    return Interval(float(fit.slope), float(fit.slope - half), float(fit.slope + half), len(x))


def verdict(low: float, high: float, equivalent: bool) -> str:
    """The reading of one comparison of bits per byte (lower is better) from its 95% interval
    [low, high] and its TOST: "worse" or "better" whenever the interval excludes 0 (", within
    the margin" added when TOST shows equivalence too); "matches" only when the interval holds
    0 and TOST shows equivalence; "not separated" when neither (the data do not decide)."""
    if low > 0 or high < 0:
        return ("worse" if low > 0 else "better") + (", within the margin" if equivalent else "")
    return "matches" if equivalent else "not separated"


def _stderr(diffs: list[float]) -> float:
    return statistics.stdev(diffs) / math.sqrt(len(diffs))
