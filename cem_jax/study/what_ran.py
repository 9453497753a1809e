"""The study report's account of its runs: the scale they speak for (`scale_caveat`, the caveat
that opens the report) and its "What ran" section (`what_ran_section`): how much of the plan is
recorded, when, where and by which code; the margin, level and seed count stated before any run,
beside the paired sd observed; and what every column and word of the tables means. The margin
in the reader's units (`margin_units`) is the Summary's too.
"""

from __future__ import annotations

import statistics

from cem_jax.stats import equivalence_margin, seeds_for_equivalence
from cem_jax.study.analysis import SPIKE_NATS, Comparison, Results
from cem_jax.study.plan import RunKey, Study
from cem_jax.study.text import count_text
from cem_jax.train_config import load_config


def scale_caveat(study: Study, results: Results) -> list[str]:
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


def what_ran_section(study: Study, results: Results, planned: list[RunKey],
                     main: list[Comparison], tests: int, milton_tests: int) -> list[str]:
    """The "What ran" section: `main` the equal-steps comparisons (their paired sds), `tests`
    and `milton_tests` the sizes of the two Holm families."""
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
    left = len(planned) - len(done)
    status = ("The study is complete." if complete else
              f"**The study is not complete**: {count_text(left, 'planned run')}"
              f" {'has' if left == 1 else 'have'} no file yet, and later "
              "parts are planned only once the sweep they depend on is done; every table holds "
              "the runs recorded so far, and each comparison states its seeds.")
    records = (f" {dirty} of the {len(recs)} records name a commit with uncommitted changes "
               "(\"-dirty\"): their code is not exactly the commit's." if dirty else
               " Every record names the clean commit that trained it.") if recs else ""
    later = [r["completed"] for r in recs if "completed" in r]
    if later:
        when = sorted({c["date"] for c in later})
        records += (f" {count_text(len(later), 'record')} of reported runs lacked the Milton "
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
            f"({margin_units(study, results)}) and the level α = {study.alpha}. "
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


def margin_units(study: Study, results: Results) -> str:
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


def _validation(study: Study) -> str:
    """What the runs validate on: the whole held-out split, or its first `data.val_tokens`."""
    cfg = load_config(study.configs[study.baseline].file, list(study.overrides))
    return ("the whole held-out split" if cfg.data.val_tokens is None else
            f"the held-out split's first whole documents up to {cfg.data.val_tokens:,} tokens "
            "(data.val_tokens)")
