"""The report of a comparison (`cem-compare`): the Markdown tables (validation bits per byte
by budget with paired 95% t-intervals to the baseline, parameters by part, energy descent and
learned preconditioners, test-time recursion) and the PNGs beside them (validation curves,
descent heatmaps)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cem_jax.evaluate import bits_per_byte_of
from cem_jax.model import param_counts as abstract_param_counts
from cem_jax.stats import Interval, paired_interval
from cem_jax.train.metrics import flops_per_token
from cem_jax.train_config import TrainConfig

PARTS = ("embedding", "attention", "mlp", "norm", "preconditioner", "head", "total")
KINDS = ("attention", "mlp")
SHORT = {"attention": "attn", "mlp": "mlp"}
END = "<!-- end of cem-compare output: text below this line is kept on rewrite -->"


def step_flops(cfg: TrainConfig) -> float:
    """Training FLOPs of one optimizer step: `flops_per_token` × batch_size × seq_len."""
    tokens = cfg.data.batch_size * cfg.data.seq_len
    return flops_per_token(cfg.model, cfg.data.seq_len) * tokens


def param_counts(cfg: TrainConfig) -> dict[str, int]:
    """The config's parameter counts by part (every part of `PARTS`, 0 when absent)."""
    counts = abstract_param_counts(cfg.model)
    return {part: counts.get(part, 0) for part in PARTS}


def figure_path(out: Path, name: str) -> Path:
    """A PNG next to the Markdown file: results.md, "descent" → results_descent.png."""
    return out.with_name(f"{out.stem}_{name}.png")


def figure_names(budgets: Sequence[str]) -> list[str]:
    """The PNGs a report with these budgets writes (names for `figure_path`)."""
    return [*(f"curves_{b}" for b in budgets), "descent"]


@dataclasses.dataclass
class Report:
    """Everything `cem-compare` writes: `results[(stem, steps, seed)]` are the rows of
    `cem_jax.compare.runs.train_one` with `cem_jax.compare.analysis.analyze`'s additions;
    `plans[budget]` maps each config of a table to its steps
    (`cem_jax.compare.plan.plan_tables`)."""

    command: str
    cfgs: dict[str, TrainConfig]
    baseline: str
    seeds: list[int]
    plans: dict[str, dict[str, int]]
    results: dict[tuple[str, int, int], dict]
    ood: str
    descent_batches: int
    counts: dict[str, dict[str, int]] = dataclasses.field(init=False)

    def __post_init__(self):
        self.counts = {stem: param_counts(cfg) for stem, cfg in self.cfgs.items()}

    def rows(self, stem: str, steps: int) -> dict[int, dict]:
        """{seed: result} of a config's runs at `steps`."""
        return {seed: self.results[stem, steps, seed] for seed in self.seeds
                if (stem, steps, seed) in self.results}

    def per_seed(self, stem: str, steps: int, key: Callable[[dict], float | None] = None
            ) -> dict[int, float]:
        """{seed: figure} over the finished runs (default figure: validation bits per byte)."""
        key = key or (lambda r: bits_per_byte_of(r["eval"]))
        return {s: v for s, r in self.rows(stem, steps).items()
                if r["ok"] and (v := key(r)) is not None}

    def write(self, out: Path) -> None:
        """Write the Markdown file (keeping any text after END in an existing one) and PNGs."""
        lines = ["# cem-compare results", "", "Produced by", "", "```bash", self.command, "```",
                 "", self._intro(), ""]
        for budget, plan in self.plans.items():
            lines += self._table(budget, plan, out)
        lines += self._params_table()
        first = next(iter(self.plans.values()))
        lines += self._descent(first, out)
        lines += self._recursion(first)
        notes = [f"- {stem} seed {seed} ({steps} steps): {r['note']}"
                 for (stem, steps, seed), r in self.results.items() if r["note"]]
        lines += (["## Failed runs", "", *notes, ""] if notes else []) + [END, ""]
        kept = out.read_text().split(END, 1)[1].lstrip("\n") \
            if out.is_file() and END in out.read_text() else ""
        out.write_text("\n".join(lines) + kept)

    def _intro(self) -> str:
        wall = sum(r.get("wall_s", 0.0) for r in self.results.values())
        ood = "" if self.ood == "none" else (
            f" The out-of-domain column is bits per byte on {self.ood!r} (whole text).")
        return (f"Seeds {', '.join(map(str, self.seeds))}: each config trains once per seed, "
                "with run.seed = data.seed = the seed (model init and data order). Validation "
                "bits per byte after the last step (the whole validation split; with "
                "run.eval_batches, its first batches and an estimate), as mean ± standard "
                f"deviation over the seeds. Δ: the difference to the baseline "
                f"({self.baseline}) paired by seed, mean [95% t-interval]; \"not separated\" "
                f"when the interval contains 0.{ood} tokens/s: median over the training log "
                "windows after the first tenth of the steps (compilation and evaluation "
                "excluded); wall time: of one `cem-train` process (start-up, compilation, "
                f"evaluations, checkpoints and the sample included). Runs: {len(self.results)}, "
                f"{wall / 60:.0f} min of training in all.")

    def _table(self, budget: str, plan: dict[str, int], out: Path) -> list[str]:
        base_steps = plan[self.baseline]
        if budget == "steps":
            title = f"## Equal steps ({base_steps} steps)"
        else:
            flops = base_steps * step_flops(self.cfgs[self.baseline])
            title = (f"## Equal training FLOPs ({flops:.3g} FLOPs per run: {self.baseline} at "
                     f"{base_steps} steps; analytic `flops_per_token`)")
        ood = [] if self.ood == "none" else [
            f"{'Milton' if self.ood == 'milton' else 'out-of-domain'} bits/byte"]
        head = ["config", "params", "steps", "training FLOPs", "seeds", "val bits/byte",
                f"Δ vs {self.baseline} (95% CI)", *ood, "tokens/s", "wall time"]
        lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        base = self.per_seed(self.baseline, base_steps)
        for stem, steps in plan.items():
            rows, values = self.rows(stem, steps), self.per_seed(stem, steps)
            ok = [r for r in rows.values() if r["ok"]]
            name = stem if len(ok) == len(rows) else f"{stem} ({len(rows) - len(ok)} failed)"
            delta = "baseline" if stem == self.baseline else _delta(paired_interval(values, base))
            cells = [name, f"{self.counts[stem]['total']:,}", str(steps),
                     f"{steps * step_flops(self.cfgs[stem]):.3g}", str(len(values)),
                     _mean_sd(values.values()), delta]
            if ood:
                cells.append(_mean_sd(self.per_seed(stem, steps, lambda r: bits_per_byte_of(
                    r["ood"]) if "ood" in r else None).values()))
            cells += [_num(_mean(r.get("tokens_per_s") for r in ok), 0, ","),
                      _num(_mean(r["wall_s"] for r in ok) / 60, 1) + " min" if ok else "–"]
            lines.append("| " + " | ".join(cells) + " |")
        png = figure_path(out, f"curves_{budget}")
        self._plot_curves(budget, plan, png)
        return lines + ["", f"![validation bits per byte, mean over the seeds]({png.name})", ""]

    def _params_table(self) -> list[str]:
        base = self.counts[self.baseline]["total"]
        head = ["config", *PARTS, f"vs {self.baseline}"]
        lines = ["## Parameters by part (`count_params`)", "", "| " + " | ".join(head) + " |",
                 "|" + "---|" * len(head)]
        for stem, counts in self.counts.items():
            lines.append("| " + " | ".join([stem, *(f"{counts[p]:,}" for p in PARTS),
                                            f"{counts['total'] / base - 1:+.1%}"]) + " |")
        return lines + [""]

    def _descent(self, plan: dict[str, int], out: Path) -> list[str]:
        stats = {stem: [r["descent"] for r in self.rows(stem, steps).values() if "descent" in r]
                 for stem, steps in plan.items()}
        stats = {stem: s for stem, s in stats.items() if s}
        if not stats:
            return []
        tokens = next(iter(stats.values()))[0]["tokens"]
        L = max(len(s[0][k]["down"]) for s in stats.values() for k in KINDS if k in s[0])
        head = ["config", "sub-layer", "step", *(f"layer {i}" for i in range(L))]
        lines = ["## Energy descent in the trained CEM layers", "",
                 f"On the first {self.descent_batches} validation batches ({tokens:,} tokens), "
                 "per layer and step: the fraction of tokens whose energy went down across the "
                 "update / the mean energy change (after − before, in the energy's units), "
                 "mean over the seeds. The default update applies the y-gradient to x "
                 "(DESIGN.md §1), so descent is not guaranteed: the cells listed below the "
                 "table are where it does not hold for every token.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        up = []
        for stem, per_seed in stats.items():
            for kind in KINDS:
                if kind not in per_seed[0]:
                    continue
                down, change = (np.mean([s[kind][k] for s in per_seed], axis=0)
                                for k in ("down", "change"))
                for k in range(down.shape[1]):
                    cells = [f"{down[i, k]:.0%} / {change[i, k]:+.3g}" for i in range(len(down))]
                    lines.append("| " + " | ".join([stem, kind, str(k + 1), *cells]) + " |")
                    up += [f"{stem} {kind} layer {i} step {k + 1} ({1 - down[i, k]:.1%} of "
                           f"the tokens{', mean energy up' if change[i, k] > 0 else ''})"
                           for i in range(len(down)) if down[i, k] < 0.995 or change[i, k] > 0]
        png = figure_path(out, "descent")
        _plot_descent(stats, png)
        lines += ["", "Where the energy went up for more than 0.5% of the tokens (or on "
                  "average): " + ("; ".join(up) if up else "nowhere") + ".", "",
                  f"![fraction of tokens whose energy went down]({png.name})", ""]
        return lines + self._precond_table(plan, L)

    def _precond_table(self, plan: dict[str, int], L: int) -> list[str]:
        head = ["config", "sub-layer", *(f"layer {i}" for i in range(L))]
        lines = ["### Learned preconditioner P (first seed's run)", "",
                 "softplus(ρ), P's diagonal: mean [min, max] over its entries (one for a scalar "
                 "P); ‖U‖: Frobenius norm of the low-rank part of a dplr P.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for stem, steps in plan.items():
            precond = next((r["precond"] for r in self.rows(stem, steps).values()
                            if r.get("precond")), None)
            for kind, p in (precond or {}).items():
                cells = [f"{p['mean'][i]:.3f}" + (f" [{p['min'][i]:.3f}, {p['max'][i]:.3f}]"
                                                  if p["min"][i] != p["max"][i] else "")
                         + (f", ‖U‖ {p['u_norm'][i]:.3f}" if "u_norm" in p else "")
                         for i in range(len(p["mean"]))]
                lines.append("| " + " | ".join([stem, kind, *cells]) + " |")
        return lines + [""]

    def _recursion(self, plan: dict[str, int]) -> list[str]:
        stems = [s for s, steps in plan.items()
                 if any("recursion" in r for r in self.rows(s, steps).values())]
        if not stems:
            return []
        head = ["config", "trained steps", "N", "seeds", "val bits/byte",
                "Δ vs N = trained (95% CI)", "attention energy: before → after each step",
                "MLP energy: before → after each step"]
        lines = ["## Test-time recursion", "",
                 "Each run evaluated with every sub-layer run for N CEM steps (its weights "
                 "unchanged: the steps share them): validation bits per byte over the whole "
                 "split, and the energy before step 1 and after steps 1…N (mean over layers, "
                 "the tokens of the descent sample, and seeds).", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for stem in stems:
            trained = self.cfgs[stem].model.steps
            runs = {s: r for s, r in self.rows(stem, plan[stem]).items() if "recursion" in r}
            ns = next(iter(runs.values()))["recursion"]
            for n in ns:
                values = {s: r["recursion"][n]["bits_per_byte"] for s, r in runs.items()}
                ref = {s: r["recursion"][trained]["bits_per_byte"] for s, r in runs.items()
                       if trained in r["recursion"]}
                delta = "–" if n == trained or not ref else _delta(paired_interval(values, ref))
                energies, samples = [], [r["recursion"][n]["descent"] for r in runs.values()]
                for kind in KINDS:  # per run, means over the layers: E before step 1, after each
                    chains = [[np.mean(np.asarray(d[kind]["before"])[:, 0]),
                               *np.mean(d[kind]["after"], axis=0)] for d in samples if kind in d]
                    energies.append(" → ".join(f"{e:.3f}" for e in np.mean(chains, axis=0))
                                    if chains else "–")
                lines.append("| " + " | ".join([stem, str(trained), str(n), str(len(values)),
                                                _mean_sd(values.values()), delta, *energies])
                             + " |")
        return lines + [""]

    def _plot_curves(self, budget: str, plan: dict[str, int], path: Path) -> None:
        """Validation bits per byte (mean over the seeds) vs step, or vs training FLOPs."""
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for stem, steps in plan.items():
            curves = [dict(r["curve"]) for r in self.rows(stem, steps).values()
                      if r["ok"] and r.get("curve")]
            ticks = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if ticks:
                x = np.array(ticks, float) * (step_flops(self.cfgs[stem]) if budget == "flops"
                                              else 1)
                ax.plot(x, [np.mean([c[t] for c in curves]) for t in ticks], marker="o",
                        markersize=3, label=stem)
        ax.set_xlabel("training FLOPs" if budget == "flops" else "step")
        ax.set_ylabel("validation bits per byte")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _plot_descent(stats: dict[str, list[dict]], path: Path) -> None:
    """One heatmap per config: layers (rows) × (sub-layer, step) in order of execution
    (columns), coloured by the fraction of tokens whose energy went down."""
    plt = _pyplot()
    cols = min(3, len(stats))
    rows = -(-len(stats) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1, 3 * rows), dpi=110,
                             squeeze=False, layout="constrained")
    for ax, (stem, per_seed) in zip(axes.flat, stats.items(), strict=False):
        kinds = [k for k in KINDS if k in per_seed[0]]
        down = {k: np.mean([s[k]["down"] for s in per_seed], axis=0) for k in kinds}
        steps = down[kinds[0]].shape[1]
        grid = np.stack([down[k][:, j] for j in range(steps) for k in kinds], axis=1)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(grid.shape[1]),
                      [f"{SHORT[k]} {j + 1}" for j in range(steps) for k in kinds], fontsize=7)
        ax.set_yticks(range(grid.shape[0]), [f"layer {i}" for i in range(grid.shape[0])],
                      fontsize=7)
        ax.set_title(stem, fontsize=8)
    for ax in list(axes.flat)[len(stats):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="fraction of tokens whose energy went down")
    fig.savefig(path)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def _mean_sd(values) -> str:
    """'2.1758 ± 0.0123' (mean ± sample standard deviation), '2.1758' for one, '–' for none."""
    values = list(values)
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def _delta(interval: Interval | None) -> str:
    if interval is None:
        return "– (needs 2 seeds)"
    text = f"{interval.mean:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]"
    return text if interval.separated else text + " not separated"


def _num(value, digits: int, sep: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:{sep}.{digits}f}"
