"""The study report's tables, with their figures (`cem_jax.study.figures`) below them: the
learning-rate sweep, the runs at equal steps and at equal training FLOPs, the trend over model
size (its configs at each size: `by_size`), and the energy descent of the CEM sub-layers; each
comparison table lists Δ with its 95% and 90% intervals, raw and Holm-adjusted p, TOST p and
its reading.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path

from cem_jax.study import figures
from cem_jax.study.analysis import Comparison, Results, diverged, max_grad_norm, spikes
from cem_jax.study.plan import Study, figure_path, rate_text
from cem_jax.study.text import mean_sd, p_text, table_row, table_rule


def sweep_section(study: Study, results: Results, out: Path) -> list[str]:
    """The sweep: each config's final bits per byte at each rate, its best rate and diverged
    rates, and the figures of the sweep and of its curves."""
    names = list(study.all_configs())
    rates = sorted({lr for n in names for lr in results.sweep(n)})
    if not rates:
        return []
    head = ["config", *(f"lr {rate_text(r)}" for r in rates), "best rate", "diverged rates",
            "spikes"]
    split = results.sweep_split()
    where = ("the selection works (`data.selection=validation`: macbeth, "
             "much_ado_about_nothing, passionate_pilgrim; every run of the study trains without "
             "them), not the split the study reports" if split == "selection" else
             "the same validation split the study reports, so the reported numbers favour each "
             "config's own rate a little")
    budget = ("the study's own budget" if study.sweep_steps == study.steps else
              f"a shorter budget than the study's {study.steps:,} steps: a rate best at "
              f"{study.sweep_steps} steps need not be best at {study.steps:,}, nor alike for "
              "every config")
    seed = (f"seed {study.sweep_seed}, none of the reported runs' seeds"
            if study.sweep_seed >= study.seeds else
            f"seed {study.sweep_seed}, which the reported runs of that seed share")
    lines = [f"## Learning-rate sweep ({study.sweep_steps:,} steps, seed {study.sweep_seed})",
             "", f"Final {split} bits per byte at each peak rate (the schedule: warmup, cosine "
             f"decay to the config's min_lr_ratio). The best rate is picked on one run per rate "
             f"({seed}), on {where}, at {budget}."
             + (f" A rate beyond an edge of the grid (by the grid's ratio there) is added while "
                f"the best is at that edge, or below the grid while every rate diverged (up to "
                f"{study.extend} in all)." if study.extend else "")
             + " \"(edge)\": the best is at an edge of the rates tried, so the optimum may "
             "lie beyond them.", "", table_row(head), table_rule(head)]
    for name in names:
        recs = results.sweep_records(name)
        if not recs:
            continue
        cells = [("diverged" if diverged(recs[r]) else f"{recs[r]['val']['bits_per_byte']:.4f}")
                 if r in recs else "–" for r in rates]
        best = results.best_rate(name)
        edge = results.best_at_edge(name)
        bad = [rate_text(r) for r, rec in sorted(recs.items()) if diverged(rec)]
        lines.append(table_row([name, *cells, (rate_text(best) + " (edge)" * edge) if best
                                else "none: every rate diverged" if results.all_diverged(name)
                                else "(sweep not done)",
                                ", ".join(bad) or "none",
                                str(sum(spikes(rec) for rec in recs.values()))]))
    png = figure_path(out, "sweep")
    if _drawn(figures.plot_sweep(results, png), png):
        lines += ["", f"![learning-rate sweep]({png.name})"]
    png = figure_path(out, "sweep_curves")
    if _drawn(figures.plot_sweep_curves(results, png), png):
        lines += ["", f"![the sweep's curves]({png.name})"]
    return lines + [""]


def runs_section(study: Study, results: Results, title: str, steps: Mapping[str, int],
                 comparisons: list[Comparison], milton: list[Comparison], out: Path | None,
                 figure: str | None) -> list[str]:
    """A table of the configs' runs (at `steps[name]`, or at the study's steps where `steps` is
    empty) under `title`, its `comparisons` and their `milton` twins, and the figure of the
    runs' curves as `figure` beside `out` (none where `out` is None)."""
    head = ["config", "params", "lr", "steps", "training FLOPs", "seeds", "val bits/byte",
            "Milton bits/byte", "diverged", "spikes", "max grad norm", "tokens/s (median)"]
    lines = [title, "", "Each config at its best rate; bits per byte as mean ± sd over the "
             "seeds that did not diverge; tokens/s the median over the seeds.", "",
             table_row(head), table_rule(head)]
    for name in study.configs:
        if steps and name not in steps and name not in (study.baseline, study.control):
            continue
        runs = results.runs(name, steps.get(name))
        if not runs:
            continue
        ok = [r for r in runs.values() if not diverged(r)]
        first = next(iter(runs.values()))
        lines.append(table_row([
            name, f"{first['params']:,}", rate_text(first["lr"]), f"{first['steps']:,}",
            f"{first['training_flops']:.3g}", str(len(runs)),
            mean_sd([r["val"]["bits_per_byte"] for r in ok]),
            mean_sd([r["ood_bits_per_byte"] for r in ok if "ood_bits_per_byte" in r]),
            f"{len(runs) - len(ok)} of {len(runs)}", str(sum(spikes(r) for r in runs.values())),
            f"{max(max_grad_norm(r) for r in runs.values()):.3g}",
            _tokens_per_s(runs.values())]))
    lines += ["", *_comparisons(comparisons, study.alpha), ""]
    if milton:
        lines += ["The same comparisons on Milton (out of domain; Holm over their own family):",
                  "", *_comparisons(milton, study.alpha), ""]
    if out is not None and figure:
        png = figure_path(out, figure)
        if _drawn(figures.plot_curves(results, png), png):
            lines += [f"![validation curves]({png.name})", ""]
    return lines


def _comparisons(comparisons: list[Comparison], alpha: float) -> list[str]:
    """The table of `comparisons`: Δ, its intervals, its p-values and its words."""
    if not comparisons:
        return ["No comparison has two seeds in common yet."]
    head = ["comparison", "seeds", "Δ bits/byte [95% CI]", "% of ref", "perplexity ratio",
            f"{1 - 2 * alpha:.0%} CI", "paired sd", "p, raw (Holm)", "TOST p", "reading"]
    return [table_row(head), table_rule(head), *(table_row([
        c.key, str(c.n), f"{c.mean:+.4f} [{c.low:+.4f}, {c.high:+.4f}]", f"{c.percent:+.1f}%",
        "–" if c.perplexity_ratio is None else f"×{c.perplexity_ratio:.3f}",
        f"[{c.low90:+.4f}, {c.high90:+.4f}]", f"{c.sd:.4f}",
        f"{p_text(c.p)} ({p_text(c.p_holm)})", p_text(c.tost), f"**{c.words}**"])
        for c in comparisons)]


def by_size(results: Results) -> dict[str, dict[str, dict]]:
    """{size: {config: {"params", "flops", "values", "runs"}}} of the trend's configs at
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
                             "runs": sum(s < study.size_seeds for s in results.runs(sized))}
        found[size] = by_name
    return found


def sizes_section(study: Study, sizes: Mapping[str, Mapping[str, dict]],
                  comparisons: list[Comparison], slopes: list[str], results: Results,
                  out: Path) -> list[str]:
    """The trend over model size: `sizes` (`by_size`) as a table, its `comparisons`, the
    `slopes` and its figure."""
    head = ["size", "config", "params", "training FLOPs", "seeds", "val bits/byte"]
    lines = [f"## Trend over model size ({study.steps:,} steps, seeds 0–{study.size_seeds - 1}, "
             "best rate each)", "",
             "Sizes: " + "; ".join(f"{size or 'as configured'}: "
                                  f"{' '.join(o) if o else 'the configs as they are'}"
                                  for size, o in study.sizes.items()) + ".", "",
             table_row(head), table_rule(head)]
    for size, by_name in sizes.items():
        for name, v in by_name.items():
            lines.append(table_row([size, study.sized(name, size),
                                    f"{v['params']:,}" if v["params"] else "–",
                                    f"{v['flops']:.3g}" if v["flops"] else "–",
                                    str(len(v["values"])),
                                    mean_sd(list(v["values"].values()))]))
    lines += ["", *_comparisons(comparisons, study.alpha), ""]
    lines += [*slopes, ""] if slopes else []
    png = figure_path(out, "sizes")
    if _drawn(figures.plot_sizes(results, sizes, png), png):
        lines += [f"![trend over size]({png.name})", ""]
    return lines


def descent_section(study: Study, results: Results, out: Path) -> list[str]:
    """The energy descent of each CEM sub-layer and layer, trained and at initialization, and
    its figure; nothing where no run measured it."""
    rows = []
    for name in study.configs:
        runs = [r for r in results.runs(name).values() if "descent" in r]
        for kind in figures.KINDS:
            if not runs or kind not in runs[0]["descent"]:
                continue
            for layer in range(len(runs[0]["descent"][kind]["down"])):
                up, init = (statistics.fmean(1 - r[s][kind]["down"][layer][0] for r in runs)
                            for s in ("descent", "descent_init"))
                rows.append(table_row([name, kind, str(layer), str(len(runs)), f"{up:.3%}",
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
             "trained parameters and for the same seeds' initial ones.", "", table_row(head),
             table_rule(head), *rows, ""]
    png = figure_path(out, "descent")
    if _drawn(figures.plot_descent(results, png), png):
        lines += [f"![energy ascent, trained and at initialization]({png.name})", ""]
    return lines


def _drawn(drawn: bool, png: Path) -> bool:
    """Whether a figure was drawn; a PNG of an earlier report that it does not replace goes."""
    if not drawn:
        png.unlink(missing_ok=True)
    return drawn


def _tokens_per_s(runs) -> str:
    """The median of the runs' tokens/s, "–" where none was measured."""
    speeds = [r["tokens_per_s"] for r in runs if r["tokens_per_s"] is not None]
    return f"{statistics.median(speeds):,.0f}" if speeds else "–"
