"""The step loop (`cem_jax.train.loop.TrainLoop`) with stub steps that record the order of
events: the host never reads the step it has just dispatched, hooks run when due, a non-finite
step stops the run before any later save, the speed meter's clock leaves out hook time and
gives every step, the last one too, its own dispatch and device time."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from cem_jax.train import hooks
from cem_jax.train import loop as loop_module
from cem_jax.train.loop import TrainingDiverged, TrainLoop


class Probe:
    """A metric whose read (`float`) is recorded in the event log and runs `on_read` (a wait
    for the device)."""

    def __init__(self, log: list, step: int, value: float, on_read=lambda: None):
        self.log, self.step, self.value, self.on_read = log, step, value, on_read

    def __float__(self) -> float:
        self.log.append(("read", self.step))
        self.on_read()
        return self.value


def make_loop(log: list, last_step: int = 6, losses: dict | None = None,
              first_step: int = 0, on_read=lambda: None) -> TrainLoop:
    def step_fn(state, batch):
        step = state + 1
        log.append(("dispatch", step))
        loss = (losses or {}).get(step, 1.0 / step)
        return step, {"loss": Probe(log, step, loss, on_read)}

    return TrainLoop(step_fn, first_step, iter(range(100)), first_step=first_step,
                     last_step=last_step)


def test_metrics_are_read_a_step_late_and_hooks_run_when_due():
    log: list = []
    loop = make_loop(log)
    loop.add_hook(lambda info: log.append(("log", info.step, info.host_metrics()["loss"])),
                  every=2, at_last=True)
    loop.add_hook(lambda info: log.append(("eval", info.step, info.state)), every=3,
                  reads="state")
    state, step, stopped = loop.run()
    assert (state, step, stopped) == (6, 6, False)
    assert log == [
        ("dispatch", 1), ("dispatch", 2), ("read", 1), ("dispatch", 3), ("read", 2),
        ("log", 2, 0.5), ("eval", 3, 3), ("dispatch", 4), ("read", 3), ("dispatch", 5),
        ("read", 4), ("log", 4, 0.25), ("dispatch", 6), ("read", 5), ("eval", 6, 6),
        ("read", 6), ("log", 6, 1 / 6)]
    for i, event in enumerate(log):  # never a read of the step dispatched last
        if event[0] == "read":
            last_dispatch = max(e[1] for e in log[:i] if e[0] == "dispatch")
            assert event[1] < last_dispatch or event[1] == 6, (i, event)


def test_a_state_hook_can_finish_its_step_first():
    """A checkpoint needs its step's metrics checked and logged before it saves."""
    log: list = []
    loop = make_loop(log, last_step=4)
    loop.add_hook(lambda info: log.append(("log", info.step)), every=1)

    def save(info):
        info.finish()
        log.append(("save", info.step))

    loop.add_hook(save, every=2, reads="state", at_last=True)
    loop.run()
    assert log.index(("save", 2)) == log.index(("log", 2)) + 1
    assert log.count(("log", 2)) == 1 and log.count(("read", 2)) == 1
    assert log[-3:] == [("read", 4), ("log", 4), ("save", 4)]


@pytest.mark.parametrize("bad_step", [3, 4])
def test_a_non_finite_step_is_never_saved(bad_step):
    log: list = []
    loop = make_loop(log, losses={bad_step: math.nan})
    loop.add_hook(lambda info: (info.finish(), log.append(("save", info.step))), every=2,
                  reads="state", at_last=True)
    with pytest.raises(TrainingDiverged, match=f"non-finite training metrics at step "
                                               f"{bad_step}: loss nan"):
        loop.run()
    assert [e[1] for e in log if e[0] == "save"] == [2]


def test_a_hook_stops_the_run_and_later_hooks_see_the_last_step():
    log: list = []
    loop = make_loop(log, last_step=10, first_step=2)
    loop.add_hook(lambda info: info.step == 5 and info.request_stop(), reads="state")
    loop.add_hook(lambda info: log.append(("save", info.step)), every=4, reads="state",
                  at_last=True)
    state, step, stopped = loop.run()
    assert (state, step, stopped) == (5, 5, True)
    assert [e[1] for e in log if e[0] == "save"] == [4, 5]
    assert ("dispatch", 6) not in log and ("dispatch", 3) in log


def test_a_step_s_time_is_its_wait_for_the_device_and_not_the_hooks(monkeypatch):
    """Each step costs 1 s of device wait (at its read); validation at step 2 and checkpoints at
    steps 3 and 6 cost 10 s each after finishing their step. Every step's time is the 1 s of
    its own wait: none is left empty by a hook's wait, none includes a hook."""
    now = [0.0]
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def wait(seconds: float) -> None:
        now[0] += seconds

    log: list = []
    loop = make_loop(log, on_read=lambda: wait(1.0))
    seconds = []
    loop.add_hook(lambda info: seconds.append((info.step, info.seconds)))

    def hook(info):
        info.finish()
        wait(10.0)

    loop.add_hook(hook, every=2, reads="state")
    loop.add_hook(hook, every=3, reads="state", at_last=True)
    loop.run()
    assert seconds == [(step, 1.0) for step in range(1, 7)]
    assert now[0] == 6 * 1.0 + 4 * 10.0 + 10.0  # steps 2, 3, 4, 6 and 6 again


def test_a_step_s_time_is_right_when_processes_agree_on_a_stop(monkeypatch):
    """On several processes `StopOnSignal` agrees every 2 steps by an all-gather, which waits
    for the step in flight (1 s of device time, spent once whoever waits first): every step's
    time is still its 1 s (a wait inside the hook, uncounted, left steps of 0 s: MFU 17,690%
    on 2 processes)."""
    now, done, dispatched, found_done = [0.0], set(), [], []
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def wait_for(step: int) -> None:
        if step not in done:
            done.add(step)
            now[0] += 1.0

    def step_fn(state, batch):
        dispatched.append(state + 1)
        return state + 1, {"loss": Probe([], state + 1, 1.0, lambda: wait_for(state + 1))}

    def all_gather(flag):
        found_done.append(dispatched[-1] in done)
        wait_for(dispatched[-1])
        return np.array([flag])

    monkeypatch.setattr(hooks.multihost_utils, "process_allgather", all_gather)
    loop = TrainLoop(step_fn, 0, iter(range(100)), first_step=0, last_step=6)
    seconds = []
    loop.add_hook(lambda info: seconds.append(info.seconds))
    stop = hooks.StopOnSignal(agree_every=2, first_step=0)
    stop.multihost, stop.preemption_service = True, False
    loop.add_hook(stop, reads="state")
    loop.run()
    assert found_done == [True, True, True]  # steps 2, 4, 6: finished (counted) before
    assert seconds == [1.0] * 6


@pytest.mark.parametrize("log_every", [1, 2, 3])
def test_every_speed_record_covers_its_steps_when_a_dispatch_computes_its_step(monkeypatch,
                                                                              log_every):
    """On the CPU a dispatch computes much of its step (1 s here) and the read is at once: the
    last record covered no step and read 38.7x the median when a step's time ran from read to
    read (each after the next dispatch). Every record, the last one too, is its steps' own."""
    now = [0.0]
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def step_fn(state, batch):
        now[0] += 1.0
        return state + 1, {"loss": Probe([], state + 1, 1.0)}

    loop = TrainLoop(step_fn, 0, iter(range(100)), first_step=0, last_step=7)
    progress = hooks.Progress(0, 7, tokens_per_step=100, show=False)
    speeds = []

    def record(info):
        speeds.append((info.step, progress.tokens_per_s()))
        progress.reset()

    loop.add_hook(progress)
    loop.add_hook(record, every=log_every, at_last=True)
    loop.run()
    timed = [step for step in range(1, 8) if step % log_every == 0 or step == 7]
    assert [step for step, _ in speeds] == timed and speeds[-1][0] == 7
    assert all(speed == 100.0 for step, speed in speeds if step > 1)  # 100 tokens in 1 s
    assert log_every > 1 or math.isnan(speeds[0][1])  # step 1 alone: compilation, untimed


def test_hook_every_must_be_positive():
    with pytest.raises(ValueError, match="every 0 steps"):
        make_loop([]).add_hook(print, every=0)
