"""Goodput: the share of a run's wall time since its first launch that went to productive train
steps (MaxText's goodput), and where the rest went, across every relaunch.

Each launch's process 0 logs "goodput" records to metrics.jsonl (and so to TensorBoard and W&B
as `goodput/...`) every `run.log_every` steps, at each checkpoint and at the end. Unlike the
steps' own records, a resumed run keeps those of the launches before it. A record holds what
the launch's main thread did so far, in seconds (`cem_jax.train.watchdog` times its phases):

    startup_s     from cem-train's start to the first step: imports, jax.distributed, the data,
                  the restore
    compile_s     the first step of the launch (mostly its compilation)
    step_s        the other train steps
    evaluation_s  the periodic and the final validations
    checkpoint_s  the checkpoints' starts (the metrics flush, the copy off the device) and the
                  wait for the last one

and, for the run so far: `wall_s` (since the first launch), `recompute_s` and `steps_recomputed`
(steps a launch took after the checkpoint the next one resumed from: taken again), `fault_s`
(from a launch's last record to the next launch's start: its time after that record, its exit
and the relaunch), `launches`, and `goodput` = productive step seconds (`step_s` of every
launch, less `recompute_s`) / `wall_s`. A run that had finished and is trained further (a
higher `run.steps`) does not count the time between: its last record says `ended`.
"""

from __future__ import annotations

import dataclasses
import time

from cem_jax.train import watchdog

KINDS = ("startup", "compile", "step", "evaluation", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Goodput:
    """The run's goodput so far (see the module docstring)."""

    goodput: float
    wall_s: float
    productive_s: float
    recompute_s: float
    steps_recomputed: int
    fault_s: float
    launches: int
    spent: dict[str, float]  # by kind, every launch together

    def describe(self) -> str:
        """"goodput 91.2% of 442 s since the first of 2 launches: steps 403 s, start-up and
        compilation 21 s, ..."."""
        s = self.spent
        parts = [f"steps {self.productive_s:.0f} s",
                 f"start-up and compilation {s['startup'] + s['compile']:.0f} s",
                 f"checkpoints {s['checkpoint']:.0f} s", f"validation {s['evaluation']:.0f} s"]
        if self.launches > 1:
            parts += [f"recomputed steps {self.recompute_s:.0f} s ({self.steps_recomputed} "
                      f"steps)", f"lost to faults and relaunches {self.fault_s:.0f} s"]
        since = "since its launch" if self.launches == 1 else \
            f"since the first of {self.launches} launches"
        return f"goodput {self.goodput:.1%} of {self.wall_s:.0f} s {since}: " + ", ".join(parts)


class Ledger:
    """This launch's goodput records, given the "goodput" records of the run's earlier launches
    (`past`, from metrics.jsonl; [] on processes other than 0, which log none) and the step
    this launch starts after (`first_step`). `run`: the run's `Goodput` at the last record."""

    def __init__(self, past: list[dict], first_step: int):
        self.past = [r for r in past if r["launch"] != watchdog.launched()]
        self.first_step = first_step
        self.run: Goodput | None = None

    def record(self, step: int, ended: bool = False) -> dict[str, float]:
        """The values of this launch's record at step `step` (`ended`: the run's last step and
        validation are done): its seconds by kind, and the run's goodput so far (`Goodput`'s
        fields)."""
        now = time.time()
        spent = watchdog.spent(now)
        own = {"launch": watchdog.launched(), "first_step": self.first_step, "time": now,
               "step": step, **{f"{kind}_s": spent.get(kind, 0.0) for kind in KINDS},
               **({"ended": 1.0} if ended else {})}
        self.run = run = summarize([*self.past, own], now)
        return {k: v for k, v in own.items() if k not in ("time", "step")} | {
            "goodput": run.goodput, "wall_s": run.wall_s, "recompute_s": run.recompute_s,
            "steps_recomputed": run.steps_recomputed, "fault_s": run.fault_s,
            "launches": run.launches}


def summarize(records: list[dict], now: float) -> Goodput:
    """The run's `Goodput` at time `now` (s since the epoch) from its "goodput" records
    ({"launch", "first_step", "time", "step", "<kind>_s"}, any order)."""
    launches: dict[float, list[dict]] = {}
    for r in sorted(records, key=lambda r: (r["launch"], r["time"])):
        launches.setdefault(r["launch"], []).append(r)
    runs = list(launches.values())
    spent = {kind: sum(run[-1][f"{kind}_s"] for run in runs) for kind in KINDS}
    recompute = fault = idle = 0.0
    recomputed = 0
    for run, following in zip(runs, runs[1:], strict=False):
        gap = following[0]["launch"] - run[-1]["time"]
        if run[-1].get("ended"):  # the run had finished: trained further later, not a fault
            idle += gap
            continue
        resumed_at = following[0]["first_step"]
        kept = [r for r in run if r["step"] <= resumed_at]
        recompute += run[-1]["step_s"] - (kept[-1]["step_s"] if kept else 0.0)
        recomputed += max(0, int(run[-1]["step"]) - int(resumed_at))
        fault += gap
    wall = now - runs[0][0]["launch"] - idle if runs else 0.0
    productive = spent["step"] - recompute
    return Goodput(goodput=productive / wall if wall > 0 else 0.0, wall_s=wall,
                   productive_s=productive, recompute_s=recompute, steps_recomputed=recomputed,
                   fault_s=max(fault, 0.0), launches=len(runs), spent=spent)
