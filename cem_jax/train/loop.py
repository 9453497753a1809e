"""The step loop: a step iterator with hooks (levanter's `Trainer.add_hook`) that never waits
for the step it has just dispatched.

    loop = TrainLoop(trainer.train_step, state, batches, first_step=0, last_step=1000)
    loop.add_hook(log, every=10)                               # host metrics, one step late
    loop.add_hook(save, every=500, reads="state", at_last=True)  # the step's state, at its step
    state, step = loop.run()

JAX dispatches a step and returns at once; reading its results waits for the device. After
dispatching step N the loop finishes step N-1 (MaxText's `metric_logger` writes one step late
for the same reason): it reads that step's metrics, which the device has computed or is about
to while step N runs, raises `TrainingDiverged` if they are not all finite, and calls the
"metrics" hooks due at N-1. Then it calls the "state" hooks due at step N with step N's state:
checkpoints and evaluations need the step's values, every so many steps; before the next
dispatch, since the train step donates the state. A state hook that reads step N's values
first calls `StepInfo.finish()`, which does for step N now what the loop would do after the
next dispatch: a checkpoint saves only a finite state, with every step it covers logged. A
hook ends the run after this step with `StepInfo.request_stop()` (later hooks of the step then
see `info.last`).

Speed meters read `StepInfo.seconds`, each step's own time: its dispatch (the batch fetched and
the step called, which on the CPU computes much of the step), the loop's work until the next
dispatch, and the wait for its results wherever it happens (after the next dispatch, or early
in a state hook's `finish`); the time of "state" hooks (checkpoints, evaluations) is no step's.
So every step, the last one too, is timed whole, whether dispatch is asynchronous or not.

Each step's dispatch (its batch fetched, the step called) runs inside
`jax.profiler.StepTraceAnnotation("train", step_num=step)`, so a profiler trace
(`cem_jax.train.hooks.Profile`) marks the steps; without an active trace the annotation only
checks that none is active and records nothing.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax

from cem_jax.train import watchdog

# How `TrainingDiverged` names the train step's metrics.
_NAMES = {"grad_norm": "gradient norm", "param_norm": "norm of the updated parameters"}


class TrainingDiverged(RuntimeError):
    """The loss, the gradient norm or the updated parameters became NaN or infinite."""


@dataclasses.dataclass(eq=False)
class StepInfo:
    """What a hook sees of step `step` (the count of optimizer steps taken, from 1).

    state: the train state after the step ("state" hooks; None for "metrics" hooks, since the
      next step has consumed it by then). metrics: the step's device scalars ("loss",
      "grad_norm", "param_norm", "lr"). last: no step follows (the last step, or a stop was
      requested). seconds: the step's own time so far (see the module docstring), whole once
      its "metrics" hooks run.
    """

    step: int
    state: dict | None
    metrics: dict[str, jax.Array]
    last: bool
    _loop: TrainLoop = dataclasses.field(repr=False)
    seconds: float = 0.0
    _host: dict[str, float] | None = dataclasses.field(default=None, repr=False)
    _finished: bool = dataclasses.field(default=False, repr=False)

    def host_metrics(self) -> dict[str, float]:
        """The metrics as Python floats (fetched once; waits for the step to finish)."""
        if self._host is None:
            self._host = {k: float(v) for k, v in jax.device_get(self.metrics).items()}
        return self._host

    def finish(self) -> dict[str, float]:
        """Check this step's metrics and run its "metrics" hooks now (once; the loop then skips
        them); returns the host metrics. Raises TrainingDiverged if they are not finite. Called
        from a "state" hook, the wait for the device is still the step's time (`seconds`)."""
        if not self._finished:
            self._finished = True
            loop = self._loop
            paused = loop.paused_at is not None
            if paused:
                loop.resume_clock()
            try:
                loop._finish(self)
            finally:
                if paused:
                    loop.pause_clock()
        return self.host_metrics()

    def request_stop(self) -> None:
        """End the run after this step: the remaining hooks of the step see `last`."""
        self.last = True
        self._loop.stopped = True


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(info)` at every step divisible by `every`, and at the last step if `at_last`;
    `reads` "metrics" (called once the step's metrics are on the host: a step late, without
    waiting for the device) or "state" (called right after the step's dispatch, with its state).
    """

    fn: Callable[[StepInfo], None]
    every: int
    reads: Literal["metrics", "state"] = "metrics"
    at_last: bool = False

    def due(self, info: StepInfo) -> bool:
        return info.step % self.every == 0 or (self.at_last and info.last)


class TrainLoop:
    """Steps `first_step + 1` … `last_step` of `step_fn(state, batch) -> (state, metrics)` over
    `batches` (an iterator of device-ready batches), with hooks (see the module docstring)."""

    def __init__(self, step_fn: Callable[[Any, Any], tuple[Any, dict]], state: Any,
                 batches: Iterator, *, first_step: int, last_step: int):
        self.step_fn, self.state, self.batches = step_fn, state, batches
        self.step, self.last_step = first_step, last_step
        self.hooks: list[Hook] = []
        self.stopped = False
        self.paused_seconds, self.paused_at = 0.0, None  # the clock stops in "state" hooks
        self._current: StepInfo | None = None  # the step the loop's time is charged to
        self._charged = 0.0  # the clock up to which it is

    def add_hook(self, fn: Callable[[StepInfo], None], every: int = 1, *,
                 reads: Literal["metrics", "state"] = "metrics", at_last: bool = False) -> None:
        """Call `fn` as `Hook(fn, every, reads, at_last)` says; hooks of a kind run in the order
        they were added."""
        if every < 1:
            raise ValueError(f"a hook runs every {every} steps: give a positive number")
        self.hooks.append(Hook(fn, every, reads, at_last))

    def run(self) -> tuple[Any, int, bool]:
        """Take the steps; returns (final state, steps taken, whether a hook requested the
        stop). Raises TrainingDiverged and whatever a hook raises."""
        pending: StepInfo | None = None
        first = self.step + 1
        while self.step < self.last_step:
            if self.step + 1 > first:
                watchdog.enter(f"train step {self.step + 1}", "step")
            else:
                watchdog.enter(f"train step {first} (the first of this start: its compilation)",
                               "compile")
            self._charged = self.train_clock()
            with jax.profiler.StepTraceAnnotation("train", step_num=self.step + 1):
                self.state, metrics = self.step_fn(self.state, next(self.batches))
            self.step += 1
            info = StepInfo(self.step, self.state, metrics, self.step == self.last_step, self)
            self._current = info
            if pending is not None and pending.step == first:  # its wait: the compile's
                with watchdog.spending("compile"):
                    pending.finish()
            elif pending is not None:
                pending.finish()
            for hook in self.hooks:
                if hook.reads == "state" and hook.due(info):
                    self.pause_clock()
                    try:
                        hook.fn(info)
                    finally:
                        self.resume_clock()
            self._charge()
            info.state, pending = None, info  # donated to the next step
            if info.last:
                break
        if pending is not None:
            pending.finish()
        return self.state, self.step, self.stopped

    def train_clock(self) -> float:
        """Seconds of wall time outside "state" hooks (a hook's `StepInfo.finish` counts)."""
        now = time.perf_counter() if self.paused_at is None else self.paused_at
        return now - self.paused_seconds

    def _charge(self) -> None:
        """Add the loop's time since the last charge to the step being dispatched."""
        now = self.train_clock()
        self._current.seconds += now - self._charged
        self._charged = now

    def pause_clock(self) -> None:
        self.paused_at = time.perf_counter()

    def resume_clock(self) -> None:
        self.paused_seconds += time.perf_counter() - self.paused_at
        self.paused_at = None

    def _finish(self, info: StepInfo) -> None:
        self._charge()
        metrics = info.host_metrics()  # the wait for the device: the step's own time
        now = self.train_clock()
        info.seconds += now - self._charged
        self._charged = now
        if not all(math.isfinite(v) for v in metrics.values()):
            raise TrainingDiverged(f"non-finite training metrics at step {info.step}: " +
                                   ", ".join(f"{_NAMES.get(k, k)} {v}" for k, v in metrics.items()))
        for hook in self.hooks:
            if hook.reads == "metrics" and hook.due(info):
                hook.fn(info)
