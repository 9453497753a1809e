"""The study's report (`write_report`): a Markdown file regenerated from the records alone, with
its figures (`cem_jax.study.figures`) beside it. It opens with the scale the runs speak for;
every comparison states its direction and size first (bits per byte with its 95% interval, % of
the reference, per-token perplexity ratio), then its reading, with the same comparison on
Milton beside it. Every sentence of its reading is made from a number in its tables.

`write_report` makes the comparisons and assembles the sections in their order: the opening and
"What ran" (`what_ran`), the Summary and the Reading (`sentences`, whose PRIMARY marks the line
the README quotes), the tables and their figures (`tables`); `text` holds the small formatting
helpers they share.
"""

from __future__ import annotations

from collections.abc import Mapping

from cem_jax.fileio import atomic_file
from cem_jax.study.analysis import Results, compare, main_pairs, size_pairs
from cem_jax.study.plan import RunKey, Study
from cem_jax.study.sentences import reading_section, slope_lines, summary_section
from cem_jax.study.tables import (
    by_size,
    descent_section,
    runs_section,
    sizes_section,
    sweep_section,
)
from cem_jax.study.what_ran import scale_caveat, what_ran_section


def write_report(study: Study, results: Results, planned: list[RunKey],
                 flops_steps: Mapping[str, int]) -> None:
    """Write `study.report` and its PNGs. `planned`: every run the study asks for now
    (`cem_jax.study.plan.plan`); `flops_steps[name]`: a config's steps at equal FLOPs."""
    command = f"cem-study {study.path}"
    out = study.report
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = by_size(results)
    flops_pairs = main_pairs(results, dict(flops_steps)) if flops_steps else []
    tables, tests = compare({"main": main_pairs(results), "flops": flops_pairs,
                             "sizes": size_pairs(results)}, study.margin, study.alpha)
    milton, milton_tests = compare({
        "main": main_pairs(results, split="milton"),
        "flops": main_pairs(results, dict(flops_steps), "milton") if flops_steps else [],
        "sizes": size_pairs(results, "milton")}, study.margin, study.alpha)
    main, flops, size_cmp = tables["main"], tables["flops"], tables["sizes"]
    lines = [f"# The CEM study: {', '.join(study.configs)}", ""]
    lines += scale_caveat(study, results)
    lines += [f"Regenerated from the per-run files in `{study.records}` by", "", "```bash",
              command, "```", "",
              "which first trains every planned run that has no file there, so the study "
              "completes over as many invocations as it needs (`--report-only` regenerates the "
              "report without training).", ""]
    slopes = slope_lines(study, sizes)
    lines += summary_section(study, results, main, flops, size_cmp, slopes, milton)
    lines += what_ran_section(study, results, planned, main, tests, milton_tests)
    lines += sweep_section(study, results, out)
    lines += runs_section(study, results, f"## Equal steps ({study.steps:,} steps)", {}, main,
                          milton["main"], out, "curves")
    if flops_steps:
        title = (f"## Equal training FLOPs (those of {study.baseline} at {study.steps:,} "
                 "steps: a config's steps = round(steps · F_baseline / F_config), F the "
                 "analytic training FLOPs per step)")
        lines += runs_section(study, results, title, flops_steps, flops, milton["flops"], None,
                              None)
    lines += sizes_section(study, sizes, size_cmp, slopes, results, out)
    lines += descent_section(study, results, out)
    lines += reading_section(study, results, main, flops, size_cmp, slopes)
    with atomic_file(out) as f:  # a stopped or failed write leaves the old report
        f.write("\n".join(lines).encode())
