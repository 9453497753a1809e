"""The study's report (`write_report`): a Markdown file regenerated from the records alone, with
its figures (`cem_jax.study.figures`) beside it. It opens with the scale the runs speak for;
every comparison states its direction and size first (bits per byte with its 95% interval, % of
the reference, per-token perplexity ratio), then its reading, with the same comparison on
Milton beside it. Every sentence of its reading is made from a number in its tables; the line
after PRIMARY (the study's primary comparison) is the one the README quotes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path

from cem_jax.fileio import atomic_file
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
    Results,
    compare,
    diverged,
    main_pairs,
    max_grad_norm,
    size_pairs,
    spike_steps,
    spikes,
)
from cem_jax.study.plan import RunKey, Study, figure_path, rate_text
from cem_jax.train_config import load_config

SUMMARY_START = "<!-- summary -->"
SUMMARY_END = "<!-- end of summary -->"
PRIMARY = "<!-- primary: the README quotes the next line -->"


def write_report(study: Study, results: Results, planned: list[RunKey],
                 flops_steps: Mapping[str, int]) -> None:
    """Write `study.report` and its PNGs. `planned`: every run the study asks for now
    (`cem_jax.study.plan.plan`); `flops_steps[name]`: a config's steps at equal FLOPs."""
    command = f"cem-study {study.path}"
    out = study.report
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = _sizes(results)
    flops_pairs = main_pairs(results, dict(flops_steps)) if flops_steps else []
    tables, tests = compare({"main": main_pairs(results), "flops": flops_pairs,
                             "sizes": size_pairs(results)}, study.margin, study.alpha)
    milton, milton_tests = compare({
        "main": main_pairs(results, split="milton"),
        "flops": main_pairs(results, dict(flops_steps), "milton") if flops_steps else [],
        "sizes": size_pairs(results, "milton")}, study.margin, study.alpha)
    main, flops, size_cmp = tables["main"], tables["flops"], tables["sizes"]
    lines = [f"# The CEM study: {', '.join(study.configs)}", ""]
    lines += _scale(study, results)
    lines += [f"Regenerated from the per-run files in `{study.records}` by", "", "```bash",
              command, "```", "",
              "which first trains every planned run that has no file there, so the study "
              "completes over as many invocations as it needs (`--report-only` regenerates the "
              "report without training).", ""]
    slopes = _slopes(study, sizes)
    lines += _summary(study, results, main, flops, size_cmp, slopes, milton)
    lines += _what_ran(study, results, planned, main, tests, milton_tests)
    lines += _sweep(study, results, out)
    lines += _table(study, results, f"## Equal steps ({study.steps:,} steps)", {}, main,
                    milton["main"], out, "curves")
    if flops_steps:
        title = (f"## Equal training FLOPs (those of {study.baseline} at {study.steps:,} "
                 "steps: a config's steps = round(steps · F_baseline / F_config), F the "
                 "analytic training FLOPs per step)")
        lines += _table(study, results, title, flops_steps, flops, milton["flops"], None, None)
    lines += _sizes_table(study, sizes, size_cmp, slopes, results, out)
    lines += _descent(study, results, out)
    lines += _reading(study, results, main, flops, size_cmp, slopes)
    with atomic_file(out) as f:  # a stopped or failed write leaves the old report
        f.write("\n".join(lines).encode())


def _scale(study: Study, results: Results) -> list[str]:
    """The caveat that opens the report: the sizes, tokens per parameter and epochs the runs
    speak for, and what they do not."""
    recs = [r for k, r in results.records.items() if k.steps == study.steps]
    if not recs:
        return []
    cfg = load_config(study.configs[study.baseline].file, list(study.overrides))
    tokens = study.steps * cfg.data.batch_size * cfg.data.seq_len
    params = sorted({r["params"] for r in recs})
    split = next((r["data"]["train"]["tokens"] for r in recs if "data" in r), study.train_tokens)
    epochs = (f", {tokens / split:.1f} passes over the {split / 1e6:.2f}M-token training split"
              if split else "")
    corpus = next((r["data"]["train"]["description"] for r in recs if "data" in r),
                  cfg.data.corpus)
    return [f"**Scale.** Models of {params[0] / 1e6:.2f}M to {params[-1] / 1e6:.2f}M parameters, "
            f"each trained {study.steps:,} steps of {cfg.data.batch_size} × "
            f"{cfg.data.seq_len} tokens ({tokens / 1e6:.1f}M tokens: "
            f"{tokens / params[-1]:.1f} to {tokens / params[0]:.1f} tokens per parameter"
            f"{epochs}), on one corpus: {corpus}. The paper's claims are about "
            "Transformers of ~100M parameters and more, trained on billions of tokens; nothing "
            "here speaks to that scale, where a gap seen here may grow, shrink or reverse.", ""]


def _what_ran(study: Study, results: Results, planned: list[RunKey],
              main: list[Comparison], tests: int, milton_tests: int) -> list[str]:
    recs = list(results.records.values())
    done = [k for k in planned if k in results.records]
    core = study.configs
    parts = {"the learning-rate sweep": lambda k: k.name in core and study.is_sweep(k),
             "the seeds at each config's best rate": lambda k: k.name in core
             and k.steps == study.steps and not study.is_sweep(k),
             "equal FLOPs": lambda k: k.name in core
             and k.steps not in (study.steps, study.sweep_steps),
             "the size trend (its sweeps included)": lambda k: k.name not in core}
    progress = "; ".join(f"{part} {sum(map(test, done))} of {sum(map(test, planned))}"
                         for part, test in parts.items() if any(map(test, planned)))
    ran = sorted({r["ran"]["date"] for r in recs})
    machines = sorted({f"{r['ran']['machine']} ({r['ran']['cores']} cores, "
                       f"{r['ran']['backend']}, jax {r['ran']['jax']})" for r in recs})
    commits = sorted({r["ran"]["commit"] for r in recs})
    dirty = sum(r["ran"]["commit"].endswith("-dirty") for r in recs)
    n_plan = seeds_for_equivalence(study.margin, study.planning_sd, study.alpha, study.power,
                                   study.assumed_delta)
    sds = [c.sd for c in main if c.n >= 3]
    complete = len(done) == len(planned)
    so_far = "" if complete else " so far"
    observed = ""
    if sds:
        sd = statistics.median(sds)
        reach = equivalence_margin(study.seeds, sd, study.alpha, study.power,
                                   study.assumed_delta)
        observed = ((f" The paired standard deviations observed{so_far}, in the {len(sds)} "
                     "comparisons of the equal-steps table with ≥ 3 seeds, range from "
                     f"{min(sds):.4f} to {max(sds):.4f} bits/byte (median {sd:.4f}); at the "
                     "median" if len(sds) > 1 else
                     f" The paired standard deviation observed{so_far}, in the one comparison of "
                     f"the equal-steps table with ≥ 3 seeds, is {sd:.4f} bits/byte; at that sd")
                    + f", {study.seeds} seeds give {study.power:.0%} power (at a true difference "
                    f"of {study.assumed_delta:g}) for a margin of ±{reach:.3f}.")
    status = ("The study is complete." if complete else
              f"**The study is not complete**: {_count(len(planned) - len(done), 'planned run')}"
              f" {'has' if len(planned) - len(done) == 1 else 'have'} no file yet, and later "
              "parts are planned only once the sweep they depend on is done; every table holds "
              "the runs recorded so far, and each comparison states its seeds.")
    records = (f" {dirty} of the {len(recs)} records name a commit with uncommitted changes "
               "(\"-dirty\"): their code is not exactly the commit's." if dirty else
               " Every record names the clean commit that trained it.") if recs else ""
    later = [r["completed"] for r in recs if "completed" in r]
    if later:
        when = sorted({c["date"] for c in later})
        records += (f" {_count(len(later), 'record')} of reported runs lacked the Milton "
                    "evaluation (and energy descent) of the runs' final checkpoints when "
                    "written; code "
                    f"{', '.join(sorted({c['commit'] for c in later}))} completed them from those "
                    f"checkpoints ({when[0]}{f' to {when[-1]}' if len(when) > 1 else ''}).")
    q = "₁₋β/₂" if study.assumed_delta == 0 else "₁₋β"
    return ["## What ran", "",
            f"Runs recorded: {len(done)} of the {len(planned)} planned now ({progress}). "
            + status, "", *([study.note, ""] if study.note else []),
            f"Trained {ran[0]} to {ran[-1]} ({sum(r['wall_s'] for r in recs) / 3600:.1f} hours "
            f"of training in all, the sum of the runs' wall times) on {'; '.join(machines)}, code "
            f"{', '.join(commits)}.{records} Tokens/s were measured on shared machines, whose "
            "speed may differ between sessions, and are indicative only "
            "(`benchmarks/train_step.py` times configs side by side)." if ran else
            "No run is recorded yet.", "",
            f"Stated before any run: the equivalence margin is ±{study.margin} bits/byte "
            f"({_margin_units(study, results)}) and the level α = {study.alpha}. "
            + (study.margin_reason + " " if study.margin_reason else "")
            + f"With a planning paired sd of {study.planning_sd} bits/byte and a true "
            f"difference of {study.assumed_delta:g}, a TOST shows equivalence with "
            f"{study.power:.0%} power from n = {n_plan} seeds (the first n with |Δ| + "
            f"(t₁₋α,ₙ₋₁ + t{q},ₙ₋₁)·sd/√n ≤ margin, Julious 2004); the study trains "
            f"{study.seeds} seeds per config (at least {study.min_seeds})." + observed, "",
            "Each run: `run.seed = data.seed = seed` (model init and data order). Validation "
            f"is {_validation(study)}, after the last step. Δ: row − reference paired by "
            "seed over the seeds both have that did not diverge, mean [95% t-interval, not "
            "adjusted], then as a percentage of the reference's bits per byte and as the ratio "
            "of per-token perplexities, 2^(Δ · bytes per token) (the split's bytes per token "
            "from the runs' loss and bits per byte). p: the two-sided paired t-test, raw and "
            f"(in parentheses) Holm-adjusted over the {tests} distinct in-domain comparisons of "
            f"this report (and over the {milton_tests} on Milton, a family of their own; a "
            "comparison shown in two tables on the same runs is one test and reads the same in "
            "both); TOST p: the larger of the two one-sided tests of "
            f"Δ ≤ −{study.margin} and Δ ≥ +{study.margin}, not adjusted: it is below α exactly "
            f"when the {1 - 2 * study.alpha:.0%} t-interval, shown beside the 95% one, lies "
            f"inside ±{study.margin}. Non-inferiority: that interval's upper bound is below "
            f"+{study.margin} (Δ < margin, one-sided at level α). Words, from the 95% interval "
            "first: **worse**/**better** whenever it excludes 0 (higher/lower bits per byte), "
            "with **, within the margin** added when TOST p < α too; **matches** only when it "
            "holds 0 and TOST p < α; **not separated** when it holds 0 and TOST p ≥ α (the "
            "data do not decide); headed **interim:** while a side lacks planned seeds (the "
            "reading may change as they come). A difference the raw interval shows may not "
            "survive Holm's adjustment: its adjusted p is beside it. Stability: a run diverges "
            "when its loss becomes non-finite or ends above its value at step 100 (the latter "
            "only for runs past step 100; a diverged run is left out of its comparisons, which "
            f"say so); spikes: how many times the logged loss rose more than {SPIKE_NATS} nats "
            "above its running minimum (a run of such steps counts once; every step is "
            "logged).", ""]


def _margin_units(study: Study, results: Results) -> str:
    """The margin as a percentage of the baseline's bits per byte and as a per-token perplexity
    ratio, where the baseline has runs."""
    values = results.values(study.baseline)
    per_token = results.bytes_per_token(study.baseline)
    if not values or per_token is None:
        return "its size relative to the baseline is given once the baseline has runs"
    mean = statistics.fmean(values.values())
    return (f"{100 * study.margin / mean:.1f}% of the baseline's {mean:.3f}; ×"
            f"{2 ** (study.margin * per_token):.3f} in per-token perplexity at the validation "
            f"split's {per_token:.2f} bytes per token")


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


def _summary(study: Study, results: Results, main: list[Comparison], flops: list[Comparison],
             size_cmp: list[Comparison], slopes: list[str],
             milton: Mapping[str, list[Comparison]]) -> list[str]:
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
            f"Margin ±{study.margin} bits/byte ({_margin_units(study, results)}). Each line: Δ "
            "= row − reference, its direction and size first, then its reading (defined under "
            "What ran), and the same comparison on Milton (out of domain) where the runs were "
            "evaluated there; a Holm-adjusted p is given where it does not confirm a difference "
            "the interval shows.", "", *primary, SUMMARY_START,
            *(lines or ["No comparison has two seeds yet."]), *slopes, SUMMARY_END, ""]


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


def _primary(study: Study, c: Comparison, ood: Comparison | None, caveat: str) -> str:
    """The primary comparison: its estimate and reading (bracketing `caveat`), then
    equivalence and non-inferiority at the margin, then Milton."""
    tost = "shown" if c.tost < study.alpha else "not shown"
    inferior = "shown" if c.high90 < study.margin else "not shown"
    pct = f"{1 - 2 * study.alpha:.0%}"
    return (f"{c.size()}, {c.n} seeds: **{c.words}**{_bracketed(caveat)}. At the "
            f"±{study.margin} margin, "
            f"equivalence is {tost} (TOST p {_p(c.tost)}; {pct} interval [{c.low90:+.4f}, "
            f"{c.high90:+.4f}]) and non-inferiority is {inferior} (its upper bound "
            f"{c.high90:+.4f} against +{study.margin})."
            + (f" On Milton: {ood.size()}, **{ood.words}**." if ood else ""))


def _sweep(study: Study, results: Results, out: Path) -> list[str]:
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
             "lie beyond them.", "", _row(head),
             _rule(head)]
    for name in names:
        recs = results.sweep_records(name)
        if not recs:
            continue
        cells = [("diverged" if diverged(recs[r]) else f"{recs[r]['val']['bits_per_byte']:.4f}")
                 if r in recs else "–" for r in rates]
        best = results.best_rate(name)
        edge = results.best_at_edge(name)
        bad = [rate_text(r) for r, rec in sorted(recs.items()) if diverged(rec)]
        lines.append(_row([name, *cells, (rate_text(best) + " (edge)" * edge) if best
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


def _table(study: Study, results: Results, title: str, steps: Mapping[str, int],
           comparisons: list[Comparison], milton: list[Comparison], out: Path | None,
           figure: str | None) -> list[str]:
    head = ["config", "params", "lr", "steps", "training FLOPs", "seeds", "val bits/byte",
            "Milton bits/byte", "diverged", "spikes", "max grad norm", "tokens/s (median)"]
    lines = [title, "", "Each config at its best rate; bits per byte as mean ± sd over the "
             "seeds that did not diverge; tokens/s the median over the seeds.", "",
             _row(head), _rule(head)]
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
    if milton:
        lines += ["The same comparisons on Milton (out of domain; Holm over their own family):",
                  "", *_comparisons(milton, study.alpha), ""]
    if out is not None and figure:
        png = figure_path(out, figure)
        if _drawn(figures.plot_curves(results, png), png):
            lines += [f"![validation curves]({png.name})", ""]
    return lines


def _comparisons(comparisons: list[Comparison], alpha: float) -> list[str]:
    if not comparisons:
        return ["No comparison has two seeds in common yet."]
    head = ["comparison", "seeds", "Δ bits/byte [95% CI]", "% of ref", "perplexity ratio",
            f"{1 - 2 * alpha:.0%} CI", "paired sd", "p, raw (Holm)", "TOST p", "reading"]
    return [_row(head), _rule(head), *(_row([
        c.key, str(c.n), f"{c.mean:+.4f} [{c.low:+.4f}, {c.high:+.4f}]", f"{c.percent:+.1f}%",
        "–" if c.perplexity_ratio is None else f"×{c.perplexity_ratio:.3f}",
        f"[{c.low90:+.4f}, {c.high90:+.4f}]", f"{c.sd:.4f}", f"{_p(c.p)} ({_p(c.p_holm)})",
        _p(c.tost), f"**{c.words}**"]) for c in comparisons)]


def _sizes(results: Results) -> dict[str, dict[str, dict]]:
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
    png = figure_path(out, "sizes")
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
    png = figure_path(out, "descent")
    if _drawn(figures.plot_descent(results, png), png):
        lines += [f"![energy ascent, trained and at initialization]({png.name})", ""]
    return lines


def _reading(study: Study, results: Results, main: list[Comparison], flops: list[Comparison],
             sizes: list[Comparison], slopes: list[str]) -> list[str]:
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
                         f"diverged, {_count(len(at), 'loss spike')}"
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
        notes = (f"Holm p {_p(c.p_holm)}, TOST p {_p(c.tost)}", _edge_note(results, c))
        lines.append(f"- {c.key} ({table}): {c.size()}, {c.n} seeds: **{c.words}** "
                     f"({'; '.join(n for n in notes if n)}).")
    return lines + slopes + [""]


def _size_of(study: Study, name: str) -> str:
    """The size of the trend that config `name` (a config, or one at a size) is at."""
    return next(size for size in study.sizes for config in study.size_configs
                if study.sized(config, size) == name)


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


def _p(value: float) -> str:
    """A p-value to 3 significant digits; "> 0.999" for one that would round to 1 without being
    1 (a Holm-adjusted p is capped at exactly 1)."""
    return "> 0.999" if 0.999 < value < 1 else f"{value:.3g}"


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

