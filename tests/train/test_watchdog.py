"""The bound on a checkpoint save in flight (`cem_jax.train.watchdog.SaveWatch`): it grows with
the longest save that finished, and a save that never finishes ends the process in one line
with the retryable status 75."""

from __future__ import annotations

import subprocess
import sys
import time

from cem_jax.train import watchdog


def test_the_bound_is_three_times_the_longest_finished_save():
    finish_at = time.monotonic() + 0.4
    watch = watchdog.SaveWatch(lambda: time.monotonic() < finish_at, lambda step: True,
                               timeout_s=0.5, poll_s=0.01)
    watch.save(5, lambda: None)
    assert watch.bound() == 0.5
    watch.wait()
    assert 0.4 <= watch.longest < 5  # the save of step 5 took 0.4 s (and the poll's lag)
    assert watch.bound() == 3 * watch.longest  # 3 x that, more than timeout_s
    assert watchdog._State.checkpoint == 5  # told to the supervisor as done


def test_a_save_that_ended_incomplete_is_not_the_checkpoint_to_resume_from():
    """orbax ends a save whose write or peer failed as it ends one that succeeded: the
    supervisor is told a step only when its folder is complete."""
    finish_at = time.monotonic() + 0.2
    written = []
    watch = watchdog.SaveWatch(lambda: time.monotonic() < finish_at, lambda step: step != 10,
                               timeout_s=5, poll_s=0.01)
    watch.save(5, lambda: written.append(5))
    watch.save(10, lambda: written.append((10, watchdog._State.checkpoint)))
    watch.wait()
    assert written == [5, (10, 5)]  # step 10's write began after step 5 was known complete
    assert watchdog._State.checkpoint == 5 and watch.longest < 1  # 10 never finished well


def test_a_save_that_never_finishes_ends_the_process_in_one_line_status_75():
    code = ("import time; from cem_jax.train import watchdog; watchdog.started(1, 2); "
            "watchdog.saved(20); watchdog.enter('train step 31', 'step'); "
            "watchdog.SaveWatch(lambda: True, bool, timeout_s=0.5).save(30, lambda: None); "
            "time.sleep(30)")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 75 and time.monotonic() - start < 10
    assert result.stderr.splitlines() == [
        "cem-train: process 1 of 2 abandoned the checkpoint save of step 30, unfinished after "
        "1 s (run.save_timeout_s; its storage unreachable, or a peer lost) during train step "
        "31; the newest complete checkpoint is step 20: relaunch to resume from it (exit status "
        "75)"]
