"""The study's report (`write_report`): a Markdown file regenerated from the records alone, with
its figures (`cem_jax.study.figures`) beside it. Every sentence of its reading is made from a
number in its tables; its summary (between SUMMARY_START and SUMMARY_END) is the one the README
quotes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path

from cem_jax.stats import (
    differences,
    equivalence_margin,
    seeds_for_equivalence,
    slope_interval,
)
from cem_jax.study import figures
from cem_jax.study.analysis import (
    SPIKE_NATS,
    Comparison,
    Pair,
    Results,
    compare,
    diverged,
    main_pairs,
    max_grad_norm,
    spike_steps,
    spikes,
)
from cem_jax.study.plan import RunKey, Study, rate_text
from cem_jax.train_config import load_config

SUMMARY_START = "<!-- summary: the README quotes the lines up to the end marker -->"
SUMMARY_END = "<!-- end of summary -->"


def write_report(study: Study, results: Results, planned: list[RunKey],
                 flops_steps: Mapping[str, int]) -> None:
    """Write `study.report` and its PNGs. `planned`: every run the study asks for now
    (`cem_jax.study.plan.plan`); `flops_steps[name]`: a config's steps at equal FLOPs."""
    command = f"cem-study {study.path}"
    out = study.report
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = _sizes(results)
    tables, tests = compare({
        "main": main_pairs(results),
        "flops": main_pairs(results, dict(flops_steps)) if flops_steps else [],
        "sizes": [Pair(study.sized(n, size), by_name[n]["values"],
                       study.sized(study.baseline, size), by_name[study.baseline]["values"],
                       by_name[n]["diverged"] | by_name[study.baseline]["diverged"],
                       max(0, study.size_seeds - min(by_name[n]["runs"],
                                                     by_name[study.baseline]["runs"])))
                  for size, by_name in sizes.items() for n in study.size_configs
                  if n != study.baseline]}, study.margin, study.alpha)
    main, flops, size_cmp = tables["main"], tables["flops"], tables["sizes"]
    lines = [f"# The CEM study: {', '.join(study.configs)}", "",
             f"Regenerated from the per-run files in `{study.records}` by", "", "```bash",
             command, "```", "",
             "which first trains every planned run that has no file there, so the study "
             "completes over as many invocations as it needs (`--report-only` regenerates the "
             "report without training).", ""]
    lines += _what_ran(study, results, planned, main, tests)
    slopes = _slopes(study, sizes)
    lines += _summary(study, main, flops, size_cmp, slopes)
    lines += _sweep(study, results, out)
    lines += _table(study, results, f"## Equal steps ({study.steps:,} steps)", {}, main, out,
                    "curves")
    if flops_steps:
        title = (f"## Equal training FLOPs (those of {study.baseline} at {study.steps:,} "
                 "steps: a config's steps = round(steps · F_baseline / F_config), F the "
                 "analytic training FLOPs per step)")
        lines += _table(study, results, title, flops_steps, flops, None, None)
    lines += _sizes_table(study, sizes, size_cmp, slopes, results, out)
    lines += _descent(study, results, out)
    lines += _reading(study, results, main, flops, size_cmp, slopes)
    out.write_text("\n".join(lines))


def _what_ran(study: Study, results: Results, planned: list[RunKey],
              main: list[Comparison], tests: int) -> list[str]:
    recs = list(results.records.values())
    done = [k for k in planned if k in results.records]
    core = study.configs
    parts = {"the learning-rate sweep": lambda k: k.name in core and k.steps == study.sweep_steps,
             "the seeds at each config's best rate": lambda k: k.name in core
             and k.steps == study.steps,
             "equal FLOPs": lambda k: k.name in core
             and k.steps not in (study.steps, study.sweep_steps),
             "the size trend (its sweeps included)": lambda k: k.name not in core}
    progress = "; ".join(f"{part} {sum(map(test, done))} of {sum(map(test, planned))}"
                         for part, test in parts.items())
    ran = sorted({r["ran"]["date"] for r in recs})
    machines = sorted({f"{r['ran']['machine']} ({r['ran']['cores']} cores, "
                       f"{r['ran']['backend']}, jax {r['ran']['jax']})" for r in recs})
    commits = sorted({r["ran"]["commit"] for r in recs})
    n_plan = seeds_for_equivalence(study.margin, study.planning_sd, study.alpha, study.power)
    sds = [statistics.stdev(differences(results.values(c.row), results.values(c.ref)))
           for c in main if c.n >= 3]
    complete = len(done) == len(planned)
    so_far = "" if complete else " so far"
    observed = ""
    if sds:
        sd = statistics.median(sds)
        observed = ((f" The paired standard deviations observed{so_far}, in the {len(sds)} "
                     "comparisons of the equal-steps table with ≥ 3 seeds, range from "
                     f"{min(sds):.4f} to {max(sds):.4f} bits/byte (median {sd:.4f}); at the "
                     "median" if len(sds) > 1 else
                     f" The paired standard deviation observed{so_far}, in the one comparison of "
                     f"the equal-steps table with ≥ 3 seeds, is {sd:.4f} bits/byte; at that sd")
                    + f", {study.seeds} seeds give {study.power:.0%} power for a margin of "
                    f"±{equivalence_margin(study.seeds, sd, study.alpha, study.power):.3f}.")
    status = ("The study is complete." if complete else
              f"**The study is not complete**: {_count(len(planned) - len(done), 'planned run')}"
              f" {'has' if len(planned) - len(done) == 1 else 'have'} no file yet, and later "
              "parts are planned only once the sweep they depend on is done; every table holds "
              "the runs recorded so far, and each comparison states its seeds.")
    return ["## What ran", "",
            f"Runs recorded: {len(done)} of the {len(planned)} planned now ({progress}). "
            + status, "", *([study.note, ""] if study.note else []),
            f"Trained {ran[0]} to {ran[-1]} ({sum(r['wall_s'] for r in recs) / 3600:.1f} hours "
            f"of training in all, the sum of the runs' wall times) on {'; '.join(machines)}, code "
            f"{', '.join(commits)}. Tokens/s were measured on shared machines, whose speed may "
            "differ between sessions, and are indicative only (`benchmarks/train_step.py` "
            "times configs side by side)." if ran else "No run is recorded yet.", "",
            f"Stated before any run: the equivalence margin is ±{study.margin} bits/byte and "
            f"the level α = {study.alpha}. "
            + (study.margin_reason + " " if study.margin_reason else "")
            + f"With a planning paired sd of {study.planning_sd} "
            f"bits/byte, a TOST shows equivalence at a true difference of 0 with "
            f"{study.power:.0%} power from n = {n_plan} seeds (the first n with "
            "(t₁₋α,ₙ₋₁ + t₁₋β/₂,ₙ₋₁)·sd/√n ≤ margin, Julious 2004); the study trains "
            f"{study.seeds} seeds per config (at least {study.min_seeds})." + observed, "",
            "Each run: `run.seed = data.seed = seed` (model init and data order). Validation "
            f"is {_validation(study)}, after the last step. Δ: row − reference paired by "
            "seed over the seeds both have that did not diverge, mean [95% t-interval, not "
            "adjusted]. p: the two-sided paired t-test, raw and (in parentheses) "
            f"Holm-adjusted over the {tests} distinct comparisons of this report (a comparison "
            "shown in two tables on the same runs is one test and reads the same in both; an "
            "interval that excludes 0 may still read not separated); TOST p: the larger of "
            f"the two one-sided tests of Δ ≤ −{study.margin} and Δ ≥ +{study.margin}, not "
            "adjusted (each equivalence is a claim about its own pair at level α, the level "
            f"the seed count is planned for): it is below α exactly when the "
            f"{1 - 2 * study.alpha:.0%} t-interval, shown beside the 95% one, lies inside "
            f"±{study.margin}. Words: **matches** "
            "when TOST p < α and the adjusted p ≥ α; **matches (within the margin, though "
            "lower/higher)** when both are < α; **better**/**worse** when only the adjusted p "
            "is < α (lower bits per byte is better); **not separated** when neither is (the "
            "data do not decide); headed **interim:** while a side lacks planned seeds (the "
            "reading may change as they come). Stability: a run diverges when its loss "
            "becomes non-finite or ends above its value at step 100 (the latter only for runs "
            "past step 100; a diverged run is left out of its comparisons, which say so); "
            f"spikes: how many times the logged loss rose more than {SPIKE_NATS} nats "
            "above its running minimum (a run of such steps counts once; every step is "
            "logged).", ""]


def _summary(study: Study, main: list[Comparison], flops: list[Comparison],
             size_cmp: list[Comparison], slopes: list[str]) -> list[str]:
    lines = [SUMMARY_START]
    trend = f"the size trend ({study.steps:,} steps, seeds 0–{study.size_seeds - 1})"
    wanted = [(c, f"{study.steps:,} steps") for c in main]
    wanted += [(c, "equal training FLOPs") for c in flops if c.ref == study.baseline
               and c not in main]  # a config whose FLOPs are the baseline's: its line is above
    wanted += [(c, trend) for c in size_cmp]
    if not wanted:
        lines.append("No comparison has two seeds yet.")
    for c, budget in wanted:
        lines.append(f"- {c.key}, {budget}: **{c.words}**, Δ {c.mean:+.4f} bits/byte, 95% "
                     f"[{c.low:+.4f}, {c.high:+.4f}], {1 - 2 * study.alpha:.0%} "
                     f"[{c.low90:+.4f}, {c.high90:+.4f}], over {c.n} seeds.")
    lines += slopes
    return ["## Summary", "", f"Margin ±{study.margin} bits/byte; Δ: row − reference with its "
            f"95% and {1 - 2 * study.alpha:.0%} intervals (the latter inside the margin: "
            "equivalence); words as defined above.", "", *lines, SUMMARY_END, ""]


def _sweep(study: Study, results: Results, out: Path) -> list[str]:
    names = list(study.all_configs())
    rates = sorted({lr for n in names for lr in results.sweep(n)})
    if not rates:
        return []
    head = ["config", *(f"lr {rate_text(r)}" for r in rates), "best rate", "diverged rates",
            "spikes"]
    lines = [f"## Learning-rate sweep ({study.sweep_steps} steps, seed {study.sweep_seed})", "",
             "Final validation bits per byte at each peak rate (the schedule: warmup, cosine "
             "decay to the config's min_lr_ratio). The best rate is picked on one seed and on "
             "the same validation split the study reports, at this shorter budget: the "
             "reported numbers favour each config's own rate a little (every config alike); "
             "seed 0 of the main runs shares that seed."
             + (f" A rate beyond an edge of the grid is added while the best is at that edge, "
                f"or below the grid while every rate diverged (up to {study.extend} in all)."
                if study.extend else "")
             + " \"(edge)\": the best is at an edge of the rates tried, so the optimum may "
             "lie beyond them.", "", _row(head),
             _rule(head)]
    for name in names:
        recs = results.sweep_records(name)
        if not recs:
            continue
        cells = [("diverged" if diverged(recs[r]) else f"{recs[r]['val']['bits_per_byte']:.4f}")
                 if r in recs else "–" for r in rates]
        best = results.best_rate(name)
        edge = best is not None and best in (min(recs), max(recs))
        bad = [rate_text(r) for r, rec in sorted(recs.items()) if diverged(rec)]
        lines.append(_row([name, *cells, (rate_text(best) + " (edge)" * edge) if best
                           else "none: every rate diverged" if results.all_diverged(name)
                           else "(sweep not done)",
                           ", ".join(bad) or "none",
                           str(sum(spikes(rec) for rec in recs.values()))]))
    png = out.with_name(f"{out.stem}_sweep.png")
    if _drawn(figures.plot_sweep(results, png), png):
        lines += ["", f"![learning-rate sweep]({png.name})"]
    return lines + [""]


def _table(study: Study, results: Results, title: str, steps: Mapping[str, int],
           comparisons: list[Comparison], out: Path | None, figure: str | None) -> list[str]:
    head = ["config", "params", "lr", "steps", "training FLOPs", "seeds", "val bits/byte",
            "Milton bits/byte", "diverged", "spikes", "max grad norm", "tokens/s"]
    lines = [title, "", "Each config at its best rate; bits per byte as mean ± sd over the "
             "seeds that did not diverge.", "", _row(head), _rule(head)]
    for name in study.configs:
        if steps and name not in steps and name not in (study.baseline, study.control):
            continue
        runs = results.runs(name, steps.get(name))
        if not runs:
            continue
        ok = [r for r in runs.values() if not diverged(r)]
        first = next(iter(runs.values()))
        lines.append(_row([
            name, f"{first['params']:,}", rate_text(first["lr"]), f"{first['steps']:,}",
            f"{first['training_flops']:.3g}", str(len(runs)),
            _mean_sd([r["val"]["bits_per_byte"] for r in ok]),
            _mean_sd([r["ood_bits_per_byte"] for r in ok if "ood_bits_per_byte" in r]),
            f"{len(runs) - len(ok)} of {len(runs)}", str(sum(spikes(r) for r in runs.values())),
            f"{max(max_grad_norm(r) for r in runs.values()):.3g}",
            _tokens_per_s(runs.values())]))
    lines += ["", *_comparisons(comparisons, study.alpha), ""]
    if out is not None and figure:
        png = out.with_name(f"{out.stem}_{figure}.png")
        if _drawn(figures.plot_curves(results, png), png):
            lines += [f"![validation curves]({png.name})", ""]
    return lines


def _comparisons(comparisons: list[Comparison], alpha: float) -> list[str]:
    if not comparisons:
        return ["No comparison has two seeds in common yet."]
    head = ["comparison", "seeds", "Δ bits/byte [95% CI]", f"{1 - 2 * alpha:.0%} CI",
            "p, raw (Holm)", "TOST p", "reading"]
    return [_row(head), _rule(head), *(_row([
        c.key, str(c.n), f"{c.mean:+.4f} [{c.low:+.4f}, {c.high:+.4f}]",
        f"[{c.low90:+.4f}, {c.high90:+.4f}]", f"{c.p:.3g} ({c.p_holm:.3g})", f"{c.tost:.3g}",
        f"**{c.words}**"]) for c in comparisons)]


def _sizes(results: Results) -> dict[str, dict[str, dict]]:
    """{size: {config: {"params", "flops", "values", "diverged", "runs"}}} of the trend's configs at
    each size, over its first `sizes.seeds` seeds (at the configs' own size too)."""
    study, found = results.study, {}
    for size in study.sizes:
        by_name = {}
        for name in study.size_configs:
            sized = study.sized(name, size)
            first = next(iter(results.runs(sized).values()), None)
            by_name[name] = {"params": first["params"] if first else None,
                             "flops": first["training_flops"] if first else None,
                             "values": results.values(sized, seeds=study.size_seeds),
                             "diverged": results.diverged(sized, seeds=study.size_seeds),
                             "runs": sum(s < study.size_seeds for s in results.runs(sized))}
        found[size] = by_name
    return found


def _slopes(study: Study, sizes: Mapping[str, Mapping[str, dict]]) -> list[str]:
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


def _sizes_table(study: Study, sizes: Mapping[str, Mapping[str, dict]],
                 comparisons: list[Comparison], slopes: list[str], results: Results,
                 out: Path) -> list[str]:
    head = ["size", "config", "params", "training FLOPs", "seeds", "val bits/byte"]
    lines = [f"## Trend over model size ({study.steps:,} steps, seeds 0–{study.size_seeds - 1}, "
             "best rate each)", "",
             "Sizes: " + "; ".join(f"{size or 'as configured'}: "
                                  f"{' '.join(o) if o else 'the configs as they are'}"
                                  for size, o in study.sizes.items()) + ".", "",
             _row(head), _rule(head)]
    for size, by_name in sizes.items():
        for name, v in by_name.items():
            lines.append(_row([size, study.sized(name, size),
                               f"{v['params']:,}" if v["params"] else "–",
                               f"{v['flops']:.3g}" if v["flops"] else "–", str(len(v["values"])),
                               _mean_sd(list(v["values"].values()))]))
    lines += ["", *_comparisons(comparisons, study.alpha), ""]
    lines += [*slopes, ""] if slopes else []
    png = out.with_name(f"{out.stem}_sizes.png")
    if _drawn(figures.plot_sizes(results, sizes, png), png):
        lines += [f"![trend over size]({png.name})", ""]
    return lines


def _descent(study: Study, results: Results, out: Path) -> list[str]:
    rows = []
    for name in study.configs:
        runs = [r for r in results.runs(name).values() if "descent" in r]
        for kind in figures.KINDS:
            if not runs or kind not in runs[0]["descent"]:
                continue
            for layer in range(len(runs[0]["descent"][kind]["down"])):
                up, init = (statistics.fmean(1 - r[s][kind]["down"][layer][0] for r in runs)
                            for s in ("descent", "descent_init"))
                rows.append(_row([name, kind, str(layer), str(len(runs)), f"{up:.3%}",
                                  f"{init:.3%}"]))
    if not rows:
        return []
    head = ["config", "sub-layer", "layer", "seeds", "energy up: trained", "at initialization"]
    tokens = next(r["descent_tokens"] for n in study.configs for r in results.runs(n).values()
                  if "descent" in r)
    lines = ["## Energy descent", "",
             f"The fraction of the first {tokens:,} validation tokens whose energy went up "
             "(did not go down: an unchanged energy counts as up) across each CEM sub-layer's "
             "update (step 1; the update applies the y-gradient to "
             "x, DESIGN.md §1, so descent is not guaranteed), mean over the seeds, for the "
             "trained parameters and for the same seeds' initial ones.", "", _row(head),
             _rule(head), *rows, ""]
    png = out.with_name(f"{out.stem}_descent.png")
    if _drawn(figures.plot_descent(results, png), png):
        lines += [f"![energy ascent, trained and at initialization]({png.name})", ""]
    return lines


def _reading(study: Study, results: Results, main: list[Comparison], flops: list[Comparison],
             sizes: list[Comparison], slopes: list[str]) -> list[str]:
    lines = ["## Reading", "", "Each sentence restates a number of the tables above.", ""]
    for name in study.configs:
        best = results.best_rate(name)
        if best is not None:
            bad = [rate_text(r) for r, rec in sorted(results.sweep_records(name).items())
                   if diverged(rec)]
            runs = results.runs(name)
            at = [f"seed {seed} at step {step}" for seed, r in runs.items()
                  for step in spike_steps(r)]
            stability = (f"; at it, {len(results.diverged(name))} of {len(runs)} seeds "
                         f"diverged, {_count(len(at), 'loss spike')}"
                         + (f" ({', '.join(at)})" if at else "")) if runs else ""
            lines.append(f"- {name}: best rate {rate_text(best)} of the sweep"
                         + (f" (diverged at {', '.join(bad)})" if bad else " (no rate diverged)")
                         + stability + ".")
        elif results.all_diverged(name):
            rates = ", ".join(rate_text(r) for r in sorted(results.sweep_records(name)))
            lines.append(f"- {name}: every rate of its sweep diverged ({rates}); no seeds "
                         "were trained, so it has no comparison.")
    for table, comparisons in (("equal steps", main), ("equal FLOPs", flops),
                               ("the size trend", sizes)):
        for c in comparisons:
            lines.append(f"- {c.key} ({table}, {c.n} seeds): **{c.words}** "
                         f"(Δ {c.mean:+.4f} [{c.low:+.4f}, {c.high:+.4f}], Holm p {c.p_holm:.3g},"
                         f" TOST p {c.tost:.3g}).")
    return lines + slopes + [""]


def _drawn(drawn: bool, png: Path) -> bool:
    """Whether a figure was drawn; a PNG of an earlier report that it does not replace goes."""
    if not drawn:
        png.unlink(missing_ok=True)
    return drawn


def _validation(study: Study) -> str:
    """What the runs validate on: the whole held-out split, or its first `data.val_tokens`."""
    cfg = load_config(study.configs[study.baseline].file, list(study.overrides))
    return ("the whole held-out split" if cfg.data.val_tokens is None else
            f"the held-out split's first whole documents up to {cfg.data.val_tokens:,} tokens "
            "(data.val_tokens)")


def _count(n: int, thing: str) -> str:
    """"1 loss spike", "2 loss spikes"."""
    return f"{n} {thing}{'s' * (n != 1)}"


def _tokens_per_s(runs) -> str:
    speeds = [r["tokens_per_s"] for r in runs if r["tokens_per_s"] is not None]
    return f"{statistics.median(speeds):,.0f}" if speeds else "–"


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _rule(head: list[str]) -> str:
    return "|" + "---|" * len(head)

