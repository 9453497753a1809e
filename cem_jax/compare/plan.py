"""What a comparison trains: the steps of each config in each table (equal steps, or the
baseline's training FLOPs), the baseline row, and the runs the tables need, one per config,
steps and seed (`RunSpec`), a run two tables share trained once.

This module loads no JAX (the runs and the report do: the functions that need them import them),
so that `cem-compare` checks its arguments against `BUDGETS` at once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cem_jax.compare.runs import Key, RunSpec
    from cem_jax.config import ModelConfig
    from cem_jax.train_config import TrainConfig

BUDGETS = ("steps", "flops")


def tied(model: ModelConfig) -> bool:
    """Whether a sub-layer of `model` is tied (a CEM layer): any kinds but Llama's."""
    return model.kinds != ("llama_attention", "swiglu")


def default_baseline(cfgs: Mapping[str, TrainConfig]) -> str:
    """The first config whose attention and MLP are both untied (Llama), else the first."""
    return next((s for s, c in cfgs.items() if not tied(c.model)), next(iter(cfgs)))


def budget_steps(cfgs: Mapping[str, TrainConfig], baseline: str, steps: int, budget: str
                 ) -> dict[str, int]:
    """Training steps of each config under `budget`: "steps" gives every config `steps`;
    "flops" gives each the training FLOPs of `baseline` at `steps`, in whole steps:
    max(1, round(steps · F_baseline / F_config)), F = `flops_per_token` at the config's
    sequence length times its tokens per step (batch_size · seq_len)."""
    from cem_jax.compare.report import step_flops

    if budget == "steps":
        return dict.fromkeys(cfgs, steps)
    target = steps * step_flops(cfgs[baseline])
    return {stem: max(1, round(target / step_flops(cfg))) for stem, cfg in cfgs.items()}


def plan_tables(cfgs: Mapping[str, TrainConfig], baseline: str, steps: int,
                budgets: Sequence[str], flops_stems: Collection[str]
                ) -> dict[str, dict[str, int]]:
    """The plan of each table, {budget: {stem: steps}}, one for each of `budgets`
    (`budget_steps`); the equal-FLOPs table holds the configs of `flops_stems` and the
    baseline."""
    plans = {}
    for budget in budgets:
        chosen = [s for s in cfgs if budget == "steps" or s in flops_stems or s == baseline]
        plans[budget] = budget_steps({s: cfgs[s] for s in chosen}, baseline, steps, budget)
    return plans


def run_specs(plans: Mapping[str, Mapping[str, int]], paths: Mapping[str, str],
              seeds: Sequence[int], eval_every: int, runs_dir: str, overrides: Sequence[str]
              ) -> dict[Key, RunSpec]:
    """{(stem, steps, seed): RunSpec} of every run the tables' `plans` need, in training
    order: seed by seed, a run two tables share once. `paths[stem]` is a config's file; the
    rest as `RunSpec.make`, which raises as `load_config`."""
    from cem_jax.compare.runs import RunSpec

    runs = {}
    for seed in seeds:
        for plan in plans.values():
            for stem, steps in plan.items():
                if (stem, steps, seed) not in runs:
                    runs[stem, steps, seed] = RunSpec.make(stem, paths[stem], steps, seed,
                                                           eval_every, runs_dir, overrides)
    return runs
