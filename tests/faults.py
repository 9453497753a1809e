"""Test-only faults for `cem-train`, from outside the product: neither the config nor the
compiled step knows of them.

In a subprocess, a config's `imports` loads this module (`imports=[faults]`, with tests/ on
PYTHONPATH: `fault_env`), and the environment chooses the fault:

  CEM_FAULT_NAN_STEP=N      the loss of optimizer step N is NaN (the loop stops the run as
                            diverged before anything of step N is saved)
  CEM_FAULT_SIGNAL_STEP=N   the process sends itself CEM_FAULT_SIGNAL (SIGTERM, the default,
                            SIGINT or SIGKILL) right after step N is dispatched, before the
                            loop's other hooks of that step
  CEM_FAULT_KILL_PHASE=P    the process SIGKILLs itself as it enters the first phase whose
                            name starts with P (`cem_jax.train.watchdog.enter`: "train step 11",
                            "the evaluation at step 20"): a host lost at that point
  CEM_FAULT_PAUSE_STEP=N    after the loop's other hooks of step N: waits for step N and every
  CEM_FAULT_PAUSE_FILE=F    checkpoint save started so far to finish, creates file F, and waits
                            until F is deleted (at most PAUSE_S), then goes on: a point at which
                            a test changes the world around the run (cuts its storage, say)

It adds them through cem-train's own seam, `cem_jax.train.run.register_setup_hook` (a module of
`imports:` may add loop hooks so). In-process tests call `arm(monkeypatch.setattr,
nan_step=...)`, or hand `setup_hook(...)` to `train(cfg, hooks=[...])`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import jax.numpy as jnp

from cem_jax.train import run, watchdog
from cem_jax.train.loop import Hook

HERE = Path(__file__).parent
PAUSE_S = 600.0  # at most, a pause waits for its file to be deleted


def fault_env(**faults: int | str) -> dict[str, str]:
    """The environment of a subprocess whose config names `imports=[faults]`: this folder on
    PYTHONPATH, and CEM_FAULT_<NAME> for each fault (nan_step=8, signal_step=10, signal=...)."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, **{f"CEM_FAULT_{k.upper()}": str(v) for k, v in faults.items()}}


def _nan_at(step_fn, step: int):
    def step_with_nan(state, batch):
        state, metrics = step_fn(state, batch)
        poison = jnp.where(state["step"] == step, jnp.nan, 0.0)
        return state, {**metrics, "loss": metrics["loss"] + poison}

    return step_with_nan


def _signal_at(step: int, name: str) -> Hook:
    def send(info):
        if info.step == step:
            os.kill(os.getpid(), getattr(signal, name))

    return Hook(send, step, reads="state")


def _pause_at(step: int, file: Path, checkpointer) -> Hook:
    def pause(info):
        if info.step != step:
            return
        info.finish()
        checkpointer.wait()
        file.touch()
        deadline = time.monotonic() + PAUSE_S
        while file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    return Hook(pause, step, reads="state")


def setup_hook(nan_step: int | None = None, signal_step: int | None = None,
               signal_name: str = "SIGTERM", pause_step: int | None = None,
               pause_file: str | Path | None = None) -> run.SetupHook:
    """A `train` setup hook (`cem_jax.train.run.SetupHook`) that gives the run's loop the
    faults: a NaN loss at `nan_step`, a signal right after `signal_step` is dispatched (before
    the loop's other hooks), a pause after `pause_step` (the module docstring)."""

    def setup(at: run.Setup) -> None:
        if nan_step is not None:
            at.loop.step_fn = _nan_at(at.loop.step_fn, nan_step)
        if signal_step is not None:
            at.loop.hooks.insert(0, _signal_at(signal_step, signal_name))
        if pause_step is not None:
            at.loop.hooks.append(_pause_at(pause_step, Path(pause_file), at.checkpointer))

    return setup


def arm(patch, **faults) -> None:
    """In-process: every `train` of the test (cem-train's `main` too) carries the faults of
    `setup_hook(**faults)`; `patch` is a monkeypatch's `setattr` (undone after the test)."""
    patch(run, "SETUP_HOOKS", (*run.SETUP_HOOKS, setup_hook(**faults)))


def kill_at_phase(prefix: str) -> None:
    """SIGKILL this process as it enters a phase whose name starts with `prefix`."""
    enter = watchdog.enter

    def enter_or_die(phase: str, kind: str) -> None:
        if phase.startswith(prefix):
            os.kill(os.getpid(), signal.SIGKILL)
        enter(phase, kind)

    watchdog.enter = enter_or_die


def _from_env() -> None:
    if prefix := os.environ.get("CEM_FAULT_KILL_PHASE"):
        kill_at_phase(prefix)
    nan, sig = os.environ.get("CEM_FAULT_NAN_STEP"), os.environ.get("CEM_FAULT_SIGNAL_STEP")
    pause = os.environ.get("CEM_FAULT_PAUSE_STEP")
    if nan or sig or pause:
        run.register_setup_hook(setup_hook(
            nan_step=int(nan) if nan else None, signal_step=int(sig) if sig else None,
            signal_name=os.environ.get("CEM_FAULT_SIGNAL", "SIGTERM"),
            pause_step=int(pause) if pause else None,
            pause_file=os.environ.get("CEM_FAULT_PAUSE_FILE")))


_from_env()
