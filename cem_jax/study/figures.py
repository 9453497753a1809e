"""The study's figures (PNGs beside its report), each readable alone: a title, axis labels with
units, one colour per config in every figure (`colours`; the baseline black and drawn thicker),
seed bands where there are seeds.

- curves: validation bits per byte against step and against training FLOPs, mean over the
  seeds with a min–max band;
- sweep: final bits per byte of the sweep (on the split it validates on) against the learning
  rate, diverged rates marked;
- sweep curves: each sweep run's curve on that split, a panel per config, so that the choice
  of rate can be audited;
- sizes: bits per byte against parameters per config, and the paired gap to the baseline
  against training FLOPs with its 95% interval;
- descent: the fraction of tokens whose energy went up across each CEM sub-layer's update, per
  layer, trained beside initialization (log scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from cem_jax.fileio import atomic_file
from cem_jax.stats import paired_interval
from cem_jax.study.analysis import Results, diverged
from cem_jax.study.plan import Study, rate_text

KINDS = ("attention", "mlp")


def colours(study: Study) -> dict[str, str]:
    """A colour per config of the study (its configs at other sizes share it): the baseline
    black, the others tab10 in the study's order."""
    palette = [c for i, c in enumerate(f"C{j}" for j in range(10)) if i != 7]  # C7 is grey
    found, others = {}, iter(palette)
    for name in study.configs:
        found[name] = "black" if name == study.baseline else next(others)
    for size in study.sizes:
        for name in study.size_configs:
            found[study.sized(name, size)] = found[name]
    return found


def _style(study: Study, name: str) -> dict:
    base = name == study.baseline
    return {"color": colours(study)[name], "linewidth": 2.4 if base else 1.4,
            "zorder": 3 if base else 2, "label": name + (" (baseline)" if base else "")}


def plot_curves(results: Results, path: Path) -> bool:
    """Validation bits per byte vs step and vs training FLOPs of every config's seeds at its
    best rate: mean line, min–max band. False (nothing written) without runs."""
    study, plt = results.study, _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), dpi=110, sharey=True)
    drawn = 0
    for name in study.configs:
        runs = [r for r in results.runs(name).values() if not diverged(r)]
        if not runs:
            continue
        curves = [dict(r["val_curve"]) for r in runs]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[s] for s in steps] for c in curves])
        flops_per_step = runs[0]["training_flops"] / runs[0]["steps"]
        for ax, x in zip(axes, (np.array(steps), np.array(steps) * flops_per_step), strict=True):
            style = _style(study, name)
            ax.plot(x, values.mean(0), **style)
            ax.fill_between(x, values.min(0), values.max(0), color=style["color"], alpha=0.15,
                            linewidth=0)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    seeds = max(len(results.runs(n)) for n in study.configs)
    axes[0].set_xlabel("training step")
    axes[1].set_xlabel("training FLOPs (analytic)")
    axes[1].ticklabel_format(axis="x", style="sci", scilimits=(0, 0))  # one ×10ⁿ for the axis
    axes[0].set_ylabel("validation bits per byte (lower is better)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Validation bits per byte during training, each config at its best learning "
                 f"rate (mean of up to {seeds} seed{'s' * (seeds > 1)}; band: min–max over the "
                 "seeds)", fontsize=10)
    return _save(fig, path)


def plot_sweep(results: Results, path: Path) -> bool:
    """Final bits per byte of each config's sweep (on its split) against the learning rate; a
    diverged rate is an × on the top edge. False without sweep runs."""
    study, plt = results.study, _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    finite = [v for n in study.configs for v in results.sweep(n).values() if v is not None]
    if not finite:
        plt.close(fig)
        return False
    top = max(finite) + 0.05 * (max(finite) - min(finite) + 0.01)
    for name in study.configs:
        sweep = dict(sorted(results.sweep(name).items()))
        if not sweep:
            continue
        style = _style(study, name)
        ok = {r: v for r, v in sweep.items() if v is not None}
        ax.plot(list(ok), list(ok.values()), marker="o", **style)
        bad = [r for r, v in sweep.items() if v is None]
        ax.scatter(bad, [top] * len(bad), marker="x", s=60, color=style["color"], zorder=4)
    ax.set_xscale("log", base=2)
    tried = sorted({r for n in study.configs for r in results.sweep(n)})
    ax.set_xticks(tried, [rate_text(r) for r in tried])
    ax.minorticks_off()
    ax.set_xlabel("peak learning rate (log scale; × on the top edge: diverged)")
    ax.set_ylabel(f"{results.sweep_split()} bits per byte (lower is better)")
    ax.set_title(f"Learning-rate sweep: {study.sweep_steps} steps, seed {study.sweep_seed}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_sweep_curves(results: Results, path: Path) -> bool:
    """Bits per byte on the sweep's split against step for each rate of each config's sweep, a
    panel per config (diverged runs: as far as they logged). False without sweep runs."""
    study, plt = results.study, _pyplot()
    names = [n for n in study.all_configs() if results.sweep_records(n)]
    if not names:
        return False
    columns = min(3, len(names))
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), dpi=110,
                             sharey=True, squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        records = dict(sorted(results.sweep_records(name).items()))
        best = results.best_rate(name)
        for i, (lr, rec) in enumerate(records.items()):
            steps, values = zip(*rec["val_curve"], strict=True) if rec["val_curve"] else ((), ())
            ax.plot(steps, values, marker=".", color=f"C{i}", linewidth=2.4 if lr == best else 1.2,
                    label=f"lr {rate_text(lr)}" + (" (best)" if lr == best else ""))
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"{results.sweep_split()} bits per byte")
    fig.suptitle(f"The learning-rate sweep's curves ({study.sweep_steps:,} steps, seed "
                 f"{study.sweep_seed}), on the split the rate is chosen on", fontsize=10)
    return _save(fig, path)


def plot_sizes(results: Results, sizes: Mapping[str, Mapping[str, dict]], path: Path) -> bool:
    """`sizes[size][name]`: {"params", "flops", "values"} of a config at a size. Left: mean bits
    per byte against parameters (sd error bars); middle and right: the paired gap of each tied
    config to the baseline (95% interval bars) against the tied config's parameters and
    against its training FLOPs. False when no size has a gap with an interval."""
    study, plt = results.study, _pyplot()
    if not any(paired_interval(by_name[n]["values"], by_name[study.baseline]["values"])
               for by_name in sizes.values() for n in study.size_configs if n != study.baseline):
        return False
    fig, (left, by_params, by_flops) = plt.subplots(1, 3, figsize=(15, 4.6), dpi=110)
    for name in study.size_configs:
        style = _style(study, name)
        points = sorted((by_name[name]["params"], list(by_name[name]["values"].values()))
                        for by_name in sizes.values() if by_name[name]["values"])
        if points:
            left.errorbar([p for p, _ in points], [np.mean(v) for _, v in points],
                          yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for _, v in points],
                          marker="o", capsize=3, **style)
        gaps = sorted((by_name[name]["params"], by_name[name]["flops"], interval)
                      for by_name in sizes.values() if name != study.baseline and (
                          interval := paired_interval(by_name[name]["values"],
                                                      by_name[study.baseline]["values"])))
        if gaps:
            mean = np.array([i.mean for *_, i in gaps])
            err = np.array([mean - [i.low for *_, i in gaps], [i.high for *_, i in gaps] - mean])
            for ax, x in ((by_params, [g[0] for g in gaps]), (by_flops, [g[1] for g in gaps])):
                ax.errorbar(x, mean, yerr=err, marker="o", capsize=3,
                            **style | {"label": f"{name} − {study.baseline}"})
    for ax in (by_params, by_flops):
        ax.axhline(0, color="black", linewidth=1)
        for band in (-study.margin, study.margin):
            ax.axhline(band, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("gap to the baseline, bits per byte (95% CI)")
        ax.set_title(f"dashed: the equivalence margin ±{study.margin}", fontsize=9)
    left.set_xlabel("parameters (log scale)")
    by_params.set_xlabel("parameters of the tied config (log scale)")
    by_flops.set_xlabel("training FLOPs of the tied config (log scale)")
    left.set_ylabel("validation bits per byte (mean ± sd over seeds)")
    for ax in (left, by_params, by_flops):
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(plt.LogLocator(subs=(2.0, 5.0)))  # labels that fit
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(f"The trend over model size ({study.steps:,} steps each, best rate each)",
                 fontsize=10)
    return _save(fig, path)


def plot_descent(results: Results, path: Path) -> bool:
    """Per tied sub-layer kind, the fraction of tokens whose energy went up across the update at
    each layer (step 1), mean over the seeds with a min–max band: trained (solid) and at
    initialization (dashed), log scale, a value below half a token's share (0 too) drawn
    there. False without descent statistics."""
    study, plt = results.study, _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), dpi=110, sharey=True)
    drawn, floor = False, 1.0
    for name in study.configs:
        runs = [r for r in results.runs(name).values() if "descent" in r]
        if not runs:
            continue
        floor = min(floor, 0.5 / runs[0]["descent_tokens"])
        for ax, kind in zip(axes, KINDS, strict=True):
            if kind not in runs[0]["descent"]:
                continue
            zero = 0.5 / runs[0]["descent_tokens"]
            for stats, line in (("descent", "-"), ("descent_init", "--")):
                up = 1 - np.array([np.asarray(r[stats][kind]["down"])[:, 0] for r in runs])
                style = _style(study, name)
                if line == "--":
                    style["label"] = None
                layers = np.arange(up.shape[1])
                ax.plot(layers, np.maximum(zero, up.mean(0)), linestyle=line, marker="o",
                        **style)
                ax.fill_between(layers, np.maximum(zero, up.min(0)),
                                np.maximum(zero, up.max(0)), color=style["color"], alpha=0.12,
                                linewidth=0)
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    for ax, kind in zip(axes, KINDS, strict=True):
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, 1)
        ax.set_xlabel("layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"{kind} sub-layers", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("fraction of tokens whose energy went up (log scale)")
    for ax in axes:
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle("Energy ascent across each CEM update, trained (solid) and at initialization "
                 "(dashed); mean over the seeds, band: min–max; a value below "
                 f"{floor:.1e} (0 too) drawn at it",
                 fontsize=10)
    return _save(fig, path)


def _save(fig, path: Path) -> bool:
    fig.tight_layout()
    with atomic_file(path) as f:  # a stopped or failed write leaves the old figure
        fig.savefig(f, format="png")
    _pyplot().close(fig)
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
