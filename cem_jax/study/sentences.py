"""The study report's sentences on its comparisons: the Summary (every comparison's direction and
size first, then its reading, with the same comparison on Milton beside it; the line after
PRIMARY, the study's primary comparison, is the one the README quotes), the Reading (each
sentence restating a number of the tables), and the lines of the trend's slope over model size
(`slope_lines`) that close both and the size table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from cem_jax.stats import differences, slope_interval
from cem_jax.study.analysis import Comparison, Results, diverged, spike_steps
from cem_jax.study.plan import Study, rate_text
from cem_jax.study.text import count_text, p_text
from cem_jax.study.what_ran import margin_units

SUMMARY_START = "<!-- summary -->"
SUMMARY_END = "<!-- end of summary -->"
PRIMARY = "<!-- primary: the README quotes the next line -->"


def summary_section(study: Study, results: Results, main: list[Comparison],
                    flops: list[Comparison], size_cmp: list[Comparison], slopes: list[str],
                    milton: Mapping[str, list[Comparison]]) -> list[str]:
    """The Summary: the primary comparison, then a line per comparison of the equal-steps,
    equal-FLOPs (those not on the equal-steps runs) and size tables, then the `slopes`;
    `milton` the same tables on Milton."""
    same_tests = {(c.key, c.mean, c.n) for c in main}  # a FLOPs row on the equal-steps runs
    by_key = {c.key: c for c in milton["main"]}
    flops_ood = {c.key: c for c in milton["flops"]}
    wanted = [(c, f"{study.steps:,} steps", by_key) for c in main]
    wanted += [(c, "equal training FLOPs", flops_ood) for c in flops
               if (c.key, c.mean, c.n) not in same_tests]
    sizes_ood = {c.key: c for c in milton["sizes"]}
    wanted += [(c, f"the size trend at {_size_of(study, c.ref)} ({study.steps:,} steps, seeds "
                f"0–{study.size_seeds - 1})", sizes_ood) for c in size_cmp]
    lines = [f"- {c.key}, {budget}: {_line(c, ood, study.alpha, _edge_note(results, c))}."
             for c, budget, ood in wanted]
    primary = []
    if study.primary:
        found = next((c for c in main if (c.row, c.ref) == study.primary), None)
        row, ref = study.primary
        primary = [PRIMARY, f"**Primary** ({study.primary_named}): {row} vs {ref}, "
                   f"{study.steps:,} steps: " + (_primary(study, found, by_key.get(found.key),
                                                          _edge_note(results, found))
                                                 if found else "no two seeds in common yet."),
                   ""]
    return ["## Summary", "",
            f"Margin ±{study.margin} bits/byte ({margin_units(study, results)}). Each line: Δ "
            "= row − reference, its direction and size first, then its reading (defined under "
            "What ran), and the same comparison on Milton (out of domain) where the runs were "
            "evaluated there; a Holm-adjusted p is given where it does not confirm a difference "
            "the interval shows.", "", *primary, SUMMARY_START,
            *(lines or ["No comparison has two seeds yet."]), *slopes, SUMMARY_END, ""]


def _line(c: Comparison, milton: Mapping[str, Comparison], alpha: float, caveat: str = ""
          ) -> str:
    """A comparison's size first, its reading (bracketing a Holm-adjusted p that does not
    confirm a difference its interval shows, and `caveat`), and the same comparison on
    Milton."""

    def reading(c: Comparison, caveat: str = "") -> str:
        unconfirmed = (c.low > 0 or c.high < 0) and c.p_holm >= alpha
        holm = f"Holm p {c.p_holm:.2g}" if unconfirmed else ""
        return f"**{c.words}**" + _bracketed("; ".join(n for n in (holm, caveat) if n))

    line = f"{c.size()}, {c.n} seeds: {reading(c, caveat)}"
    ood = milton.get(c.key)
    if ood is not None:
        line += f"; on Milton, {ood.size()}: {reading(ood)}"
    return line


def _primary(study: Study, c: Comparison, ood: Comparison | None, caveat: str) -> str:
    """The primary comparison: its estimate and reading (bracketing `caveat`), then
    equivalence and non-inferiority at the margin, then Milton."""
    tost = "shown" if c.tost < study.alpha else "not shown"
    inferior = "shown" if c.high90 < study.margin else "not shown"
    pct = f"{1 - 2 * study.alpha:.0%}"
    return (f"{c.size()}, {c.n} seeds: **{c.words}**{_bracketed(caveat)}. At the "
            f"±{study.margin} margin, "
            f"equivalence is {tost} (TOST p {p_text(c.tost)}; {pct} interval [{c.low90:+.4f}, "
            f"{c.high90:+.4f}]) and non-inferiority is {inferior} (its upper bound "
            f"{c.high90:+.4f} against +{study.margin})."
            + (f" On Milton: {ood.size()}, **{ood.words}**." if ood else ""))


def _edge_note(results: Results, c: Comparison) -> str:
    """A comparison's caveat for each side whose best rate is at an edge of its sweep ("" when
    none is): a rate beyond it may change Δ. Bracket it, or join it to a bracket, to use it."""
    edges = [f"{name}'s best rate, {rate_text(results.best_rate(name))}, is at an edge of the "
             "rates its sweep tried" for name in (c.row, c.ref) if results.best_at_edge(name)]
    beyond = "it" if len(edges) == 1 else "either"
    return f"{'; '.join(edges)}: a rate beyond {beyond} may change this Δ" if edges else ""


def _bracketed(text: str) -> str:
    """` (text)`, or "" for no text."""
    return f" ({text})" if text else ""


def reading_section(study: Study, results: Results, main: list[Comparison],
                    flops: list[Comparison], sizes: list[Comparison], slopes: list[str]
                    ) -> list[str]:
    """The Reading: each config's best rate and stability, then each comparison's words with
    its Holm and TOST p, then the `slopes`."""
    lines = ["## Reading", "", "Each sentence restates a number of the tables above.", ""]
    for name in study.all_configs():
        best = results.best_rate(name)
        if best is not None:
            bad = [rate_text(r) for r, rec in sorted(results.sweep_records(name).items())
                   if diverged(rec)]
            runs = results.runs(name)
            at = [f"seed {seed} at step {step}" for seed, r in runs.items()
                  for step in spike_steps(r)]
            stability = (f"; at it, {len(results.diverged(name))} of {len(runs)} seeds "
                         f"diverged, {count_text(len(at), 'loss spike')}"
                         + (f" ({', '.join(at)})" if at else "")) if runs else ""
            lines.append(f"- {name}: best rate {rate_text(best)} of the sweep"
                         + (", at an edge of the rates it tried" * results.best_at_edge(name))
                         + (f" (diverged at {', '.join(bad)})" if bad else " (no rate diverged)")
                         + stability + ".")
        elif results.all_diverged(name):
            rates = ", ".join(rate_text(r) for r in sorted(results.sweep_records(name)))
            lines.append(f"- {name}: every rate of its sweep diverged ({rates}); no seeds "
                         "were trained, so it has no comparison.")
    labelled = [*((c, "equal steps") for c in main), *((c, "equal FLOPs") for c in flops),
                *((c, f"the size trend at {_size_of(study, c.ref)}") for c in sizes)]
    for c, table in labelled:
        notes = (f"Holm p {p_text(c.p_holm)}, TOST p {p_text(c.tost)}", _edge_note(results, c))
        lines.append(f"- {c.key} ({table}): {c.size()}, {c.n} seeds: **{c.words}** "
                     f"({'; '.join(n for n in notes if n)}).")
    return lines + slopes + [""]


def slope_lines(study: Study, sizes: Mapping[str, Mapping[str, dict]]) -> list[str]:
    """Per tied config of the trend: the least-squares slope of its paired gap to the baseline
    on log10 of its parameters, with a 95% interval, over every seed of every size and, from 3
    sizes, over the sizes' mean gaps (the seeds of one size share its rate and shape, so the
    per-seed interval understates the spread between sizes: "no trend shown" follows the
    means' interval where there is one); headed "interim:" while a size lacks planned seeds on
    either side."""
    lines = []
    for name in study.size_configs:
        if name == study.baseline:
            continue
        interim = any(by_name[n]["runs"] < study.size_seeds for by_name in sizes.values()
                      for n in (name, study.baseline))
        x, y, x_means, y_means = [], [], [], []
        for by_name in sizes.values():
            diffs = differences(by_name[name]["values"], by_name[study.baseline]["values"])
            if not diffs:
                continue
            at = math.log10(by_name[name]["params"])
            x, y = x + [at] * len(diffs), y + diffs
            x_means.append(at)
            y_means.append(statistics.mean(diffs))
        slope, means = slope_interval(x, y), slope_interval(x_means, y_means)
        if slope is None:
            continue
        line = (f"- {'interim: ' * interim}{name} − {study.baseline}: the gap changes by "
                f"{slope.mean:+.4f} [{slope.low:+.4f}, {slope.high:+.4f}] bits/byte per "
                f"tenfold parameters of {name} ({slope.n} paired seeds over {len(set(x))} "
                "sizes; least squares, 95% t-interval)")
        if means is not None:
            line += (f"; over the {means.n} sizes' mean gaps, {means.mean:+.4f} "
                     f"[{means.low:+.4f}, {means.high:+.4f}] (the seeds of one size share its "
                     "rate and shape: the per-seed interval understates the spread between "
                     "sizes)")
        shown = (means if means is not None else slope).separated
        lines.append(line + ("" if shown else ": no trend shown") + ".")
    return lines


def _size_of(study: Study, name: str) -> str:
    """The size of the trend that config `name` (a config, or one at a size) is at."""
    return next(size for size in study.sizes for config in study.size_configs
                if study.sized(config, size) == name)
