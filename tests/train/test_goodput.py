"""Goodput across relaunches (`cem_jax.train.goodput.summarize`), from records as cem-train logs
them: a launch killed after its checkpoint of step 10, relaunched from it, then finished and
trained further later. The figures are worked out by hand below; the records of a real killed
and relaunched run: tests/train/test_resume.py."""

import pytest

from cem_jax.train import goodput, watchdog


def rec(launch, time, step, first_step, step_s, startup=5.0, compile_s=2.0, evaluation=1.0,
        checkpoint=0.5, **more):
    return {"launch": launch, "time": time, "step": step, "first_step": first_step,
            "startup_s": startup, "compile_s": compile_s, "step_s": step_s,
            "evaluation_s": evaluation, "checkpoint_s": checkpoint, **more}


def test_a_killed_launch_s_steps_after_the_checkpoint_resumed_from_are_recomputed():
    records = [
        rec(1000, 1020, 5, 0, 8.0), rec(1000, 1030, 10, 0, 16.0),  # the checkpoint of step 10
        rec(1000, 1038, 15, 0, 24.0),  # its last record: then it was killed
        rec(1050, 1080, 20, 10, 14.0),  # relaunched 12 s after that record, from step 10
    ]
    run = goodput.summarize(records, now=1100)
    assert run.launches == 2 and run.wall_s == 100  # since the first launch
    assert run.steps_recomputed == 5 and run.recompute_s == 8.0  # steps 11-15: 24 - 16 s
    assert run.fault_s == 12  # from the last record (1038) to the relaunch (1050)
    assert run.productive_s == 24.0 + 14.0 - 8.0
    assert run.goodput == pytest.approx(30.0 / 100)
    assert run.spent == {"startup": 10.0, "compile": 4.0, "step": 38.0, "evaluation": 2.0,
                         "checkpoint": 1.0}
    assert run.describe() == (
        "goodput 30.0% of 100 s since the first of 2 launches: steps 30 s, start-up and "
        "compilation 14 s, checkpoints 1 s, validation 2 s, recomputed steps 8 s (5 steps), "
        "lost to faults and relaunches 12 s")


def test_a_launch_killed_before_its_first_checkpoint_recomputes_all_its_steps():
    records = [rec(0, 25, 12, 10, 3.0), rec(0, 40, 14, 10, 6.0),  # resumed from step 10
               rec(60, 90, 20, 10, 12.0)]  # and again from step 10
    run = goodput.summarize(list(reversed(records)), now=90)  # sorted by launch, then time
    assert run.steps_recomputed == 4 and run.recompute_s == 6.0  # all it took
    assert run.fault_s == 20 and run.launches == 2 and run.productive_s == 12.0


def test_the_time_after_a_finished_run_before_it_is_trained_further_is_not_counted():
    records = [rec(0, 50, 100, 0, 40.0, ended=1.0),  # finished at run.steps=100
               rec(10_000, 10_050, 200, 100, 45.0)]  # days later: run.steps=200
    run = goodput.summarize(records, now=10_050)
    assert run.wall_s == 100 and run.fault_s == 0 and run.steps_recomputed == 0
    assert run.goodput == pytest.approx(85 / 100)


def test_the_ledger_records_this_launch_s_phases_beside_the_earlier_launches():
    watchdog.started(0, 1)
    watchdog.enter("train step 1 (the first of this start: its compilation)", "compile")
    watchdog.enter("train step 2", "step")
    past = [rec(watchdog.launched() - 100, watchdog.launched() - 40, 8, 0, 30.0)]
    ledger = goodput.Ledger(past, first_step=8)
    values = ledger.record(9)
    assert values["launch"] == watchdog.launched() and values["first_step"] == 8
    assert values["launches"] == 2 and values["fault_s"] == pytest.approx(40, abs=0.01)
    assert values["step_s"] >= 0 and values["compile_s"] >= 0 and values["startup_s"] >= 0
    assert ledger.run.spent["step"] == pytest.approx(30.0 + values["step_s"])
    assert 100 <= values["wall_s"] < 160
