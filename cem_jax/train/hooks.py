"""The hooks of `cem-train`'s loop (`cem_jax.train.loop.TrainLoop`): the progress bar and the
speed meter, metric records, validation, checkpoints, stopping on a signal or a preemption, and
profiles.

Each is a callable `hook(info)` registered with `TrainLoop.add_hook`; `cem_jax.train.run` wires
them up in this order: metrics hooks `Progress` (every step), `LogMetrics` and `LogGoodput`
(`run.log_every`); state hooks `StopOnSignal` (every step), `Validate` (`run.eval_every`),
`LogGoodput` and `SaveCheckpoint` (`run.checkpoint_every` and the last step) and `Profile`
(every step).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from cem_jax import exits
from cem_jax.data import files
from cem_jax.evaluate import describe
from cem_jax.exits import StoppedBySignal
from cem_jax.train import watchdog
from cem_jax.train.goodput import Ledger
from cem_jax.train.loop import StepInfo
from cem_jax.train.metrics import MetricsWriter
from cem_jax.train_config import RunConfig

logger = logging.getLogger(__name__)


class Progress:
    """Every step (a metrics hook): the tqdm bar (on process 0, when `show` and stderr is a
    terminal: a redirected log gets no carriage-return lines) and the speed meter behind the
    logged tokens/s: the steps' tokens over their own time (`StepInfo.seconds`: each step whole,
    dispatch included, the last one too; not the time of state hooks). The first step's time
    (mostly compilation) is left out."""

    def __init__(self, first_step: int, last_step: int, tokens_per_step: int, show: bool):
        self.tokens_per_step = tokens_per_step
        self.shown = show and jax.process_index() == 0 and sys.stderr.isatty()
        self.bar = tqdm(total=last_step, initial=first_step, unit="step", dynamic_ncols=True,
                        mininterval=1.0, disable=not self.shown)
        self.timed = False  # the first step is not
        self.steps, self.seconds = 0, 0.0

    def __call__(self, info: StepInfo) -> None:
        if self.timed:
            self.steps, self.seconds = self.steps + 1, self.seconds + info.seconds
        self.timed = True
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{info.host_metrics()['loss']:.3f}",
                             tok_s=f"{self.tokens_per_s():,.0f}", refresh=False)

    def tokens_per_s(self) -> float:
        """Training tokens per second since the last `reset` (nan before a timed step)."""
        if not self.steps or self.seconds <= 0:
            return math.nan
        return self.steps * self.tokens_per_step / self.seconds

    def reset(self) -> None:
        """Start a new speed window at this step."""
        self.steps, self.seconds = 0, 0.0

    def close(self) -> None:
        self.bar.close()


class LogMetrics:
    """A "train" record of the step's metrics (a metrics hook): loss, grad_norm, param_norm,
    the learning rate it used (lr), and tokens/s and MFU over the steps since the previous record;
    also a log line when no progress bar shows them (a log file, `run.progress=false`)."""

    def __init__(self, writer: MetricsWriter, progress: Progress, flops_per_token: float,
                 peak_flops: float):
        self.writer, self.progress = writer, progress
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops

    def __call__(self, info: StepInfo) -> None:
        tokens_per_s = self.progress.tokens_per_s()
        speed = {} if math.isnan(tokens_per_s) else {
            "tokens_per_s": tokens_per_s, "mfu": self.flops_per_token * tokens_per_s /
            self.peak_flops}
        metrics = info.host_metrics()
        self.writer.write(info.step, "train", {**metrics, **speed})
        if not self.progress.shown:
            rate = f", {tokens_per_s:,.0f} tokens/s, MFU {speed['mfu']:.1%}" if speed else ""
            logger.info("step %d: loss %.4f%s", info.step, metrics["loss"], rate)
        self.progress.reset()


class LogGoodput:
    """A "goodput" record of the run so far (`cem_jax.train.goodput.Ledger`): a metrics hook
    every `run.log_every` steps, and a state hook at each checkpoint, before it (which first
    finishes its step): the record of a checkpoint's step is what a later launch resumed from
    it reads as the time its steps kept."""

    def __init__(self, writer: MetricsWriter, ledger: Ledger):
        self.writer, self.ledger = writer, ledger
        self.recorded = -1  # the step of the last record: one per step

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.recorded:
            return
        if info.state is not None:
            info.finish()
        self.writer.write(info.step, "goodput", self.ledger.record(info.step))
        self.recorded = info.step


class Validate:
    """Validation of the step's parameters (a state hook, which first finishes its step),
    logged as an "eval" record; none at the last step (the run evaluates after its loop). A
    signal that stops the validation between batches (StoppedBySignal) stops the run after
    this step: the step is saved, and validated when the run is started again."""

    def __init__(self, validate: Callable[[dict], dict[str, float]], writer: MetricsWriter):
        self.validate, self.writer = validate, writer

    def __call__(self, info: StepInfo) -> None:
        if info.last:
            return
        info.finish()
        watchdog.enter(f"the evaluation at step {info.step}", "evaluation")
        try:
            result = self.validate(info.state["params"])
        except StoppedBySignal:
            info.request_stop()
            return
        self.writer.write(info.step, "eval", result)
        logger.info("step %d: validation %s", info.step, describe(result))


class SaveCheckpoint:
    """A checkpoint of the step (a state hook; orbax saves it in the background). Only a finite
    state is saved, with every step it covers in the logs: `StepInfo.finish` first checks the
    step's metrics (and runs its metrics hooks), then the logs are flushed to the operating
    system, then the save starts."""

    def __init__(self, save: Callable[[int, dict], None], writer: MetricsWriter):
        self.save, self.writer = save, writer

    def __call__(self, info: StepInfo) -> None:
        info.finish()
        watchdog.enter(f"the metrics flush before the checkpoint of step {info.step}",
                       "checkpoint")
        self.writer.flush()
        watchdog.enter(f"the start of the checkpoint save of step {info.step}", "checkpoint")
        self.save(info.step, info.state)


class StopOnSignal:
    """Stop the run after a step, every process at the same one, on SIGINT or SIGTERM (a state
    hook, every step; `cem_jax.exits` catches the signals, and a second SIGINT leaves at
    once, without a final checkpoint). A stop due at the first step after `first_step` (the
    signal came while that step was dispatched: mostly its compilation) drops the step: raises
    StoppedBySignal, and nothing is saved.

    One process: the flag of `exits.received`, read at every step. Several (`jax.distributed`):
    SIGTERM, the preemption notice of TPU pods and SLURM, is JAX's preemption service's
    (`multihost_utils.reached_preemption_sync_point`: no collective per step; every host stops
    at the sync step it agrees on), when that service is enabled; SIGINT (and SIGTERM without
    the service) sets the flag, which the processes agree on every `agree_every` steps (one
    small all-gather then, a device computation queued behind the step in flight: those steps
    are finished first, `StepInfo.finish`, so the wait counts as training time).
    """

    def __init__(self, agree_every: int, first_step: int):
        self.agree_every, self.first_step = agree_every, first_step
        self.multihost = jax.process_count() > 1
        self.preemption_service = self.multihost and jax.config.jax_enable_preemption_service

    def __call__(self, info: StepInfo) -> None:
        if not self._stop(info):
            return
        if info.step == self.first_step + 1:
            raise StoppedBySignal(exits.received() or signal.SIGTERM)  # SIGTERM: the service's
        info.request_stop()

    def _stop(self, info: StepInfo) -> bool:
        raised = exits.received() is not None
        if not self.multihost:
            return raised
        if self.preemption_service and multihost_utils.reached_preemption_sync_point(info.step):
            return True
        if info.step % self.agree_every:
            return False
        info.finish()  # the all-gather waits for this step: that wait is training time
        return bool(np.any(multihost_utils.process_allgather(np.int32(raised))))


class Profile:
    """A `jax.profiler` trace of steps `run.profile_start` … `run.profile_start +
    run.profile_steps - 1` (a state hook, every step, added after the others), in
    `run.dir`/tensorboard, where TensorBoard's profile tab (with xprof) shows it beside the
    scalars: `plugins/profile/<time>/<host>.xplane.pb`, `<host>.trace.json.gz` and
    `perfetto_trace.json.gz` (for ui.perfetto.dev); a run directory on a bucket gets the
    trace written to a local temporary folder first and uploaded when it stops. The loop marks
    each step in it (`StepTraceAnnotation` "train", `step_num`). Traced on process 0, or on
    every process with `run.profile_all_processes`; nothing without `run.profile_start`.

    The trace starts just before its first step is dispatched: in this hook at the step before,
    or here, at once, when that is the loop's first step (`first_step + 1`); steps up to
    `first_step` (a resumed run's) are not traced again, so a window partly past starts at
    `first_step + 1` and one wholly past traces nothing. It stops at its last step (at most
    `run.steps`), once that step has finished on the device (`StepInfo.finish`, then its state),
    after the step's other state hooks; one log line names the trace's directory. `close` stops
    a trace still running (the loop stopped or raised inside the window)."""

    def __init__(self, run: RunConfig, first_step: int):
        self.upload_to = files.join(run.dir, "tensorboard") if files.is_url(run.dir) else None
        self.log_dir = Path(tempfile.mkdtemp(prefix="cem_jax-profile-")) if self.upload_to \
            else Path(run.dir) / "tensorboard"
        start = run.profile_start or 0
        self.first = max(start, first_step + 1)
        self.last = min(start + run.profile_steps - 1, run.steps)
        self.due = run.profile_start is not None and self.first <= self.last and (
            run.profile_all_processes or jax.process_index() == 0)
        self.traced_to: int | None = None  # while tracing: the last step its hook saw
        if self.due and self.first == first_step + 1:
            self._start(first_step)

    def __call__(self, info: StepInfo) -> None:
        if not self.due:
            return
        if self.traced_to is not None:
            self.traced_to = info.step
        if info.step == self.first - 1:
            self._start(info.step)
        elif info.step == self.last:
            info.finish()
            jax.block_until_ready(info.state)
            self.close()

    def _start(self, step: int) -> None:
        jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
        self.traced_to = step

    def close(self) -> None:
        """Stop the trace, if one is running, and say where it is."""
        if self.traced_to is None:
            return
        jax.profiler.stop_trace()
        newest = max((self.log_dir / "plugins" / "profile").iterdir(), key=os.path.getmtime)
        if self.upload_to is not None:
            for path in sorted(p for p in newest.rglob("*") if p.is_file()):
                files.write_bytes(files.join(self.upload_to, *path.relative_to(
                    self.log_dir).parts), path.read_bytes())
            shutil.rmtree(self.log_dir, ignore_errors=True)
            newest = files.join(self.upload_to, *newest.relative_to(self.log_dir).parts)
        logger.info("profile of steps %d-%d: %s", self.first, max(self.first, self.traced_to),
                    newest)
        self.traced_to = None
