"""SIGINT and SIGTERM during cem-train's start-up, sent by the process to itself at each point
where the start spends its time (tests/train/signal_at.py; deterministic, not by timing): one
line, exit status 75, no traceback, and a run directory the start created is gone again, with
nothing half-written left in the data cache and the next start unhindered. A second SIGINT
leaves at once (in-process, in a notebook, it is a KeyboardInterrupt)."""

import fcntl
import os
import signal

import pytest
from train_helpers import run_cli, signal_at

from cem_jax import exits

STOPPED = ("cem-train: stopped by a signal (SIGINT) before the first step; nothing was trained "
           "(exit status 75)")


def _datasets(cache) -> list[str]:
    """"complete" or "partial" for each tokenized dataset folder of the cache holding a file."""
    tokens = cache / "tokens"
    folders = [p for p in tokens.iterdir() if any(f.is_file() for f in p.rglob("*"))] \
        if tokens.is_dir() else []
    return sorted("complete" if (p / "manifest.json").is_file() else "partial" for p in folders)


BOTH = ["complete", "complete"]  # the training and the validation corpus


@pytest.mark.slow
@pytest.mark.parametrize("point, extra, cached", [
    ("import", [], []),  # JAX is being imported
    ("documents", ["data.tokenizer=null"], []),  # the tokenizer's training reads the text
    ("documents", [], []),  # the training split is being tokenized: it stops after one document
    pytest.param("peak-flops", [], BOTH, marks=pytest.mark.slow),  # the probe's compile and runs
    ("first-step", [], BOTH),  # the first step's compilation
], ids=["import", "tokenizer-training", "tokenizing", "peak-flops", "first-step"])
def test_a_signal_during_start_up_is_one_line_and_leaves_nothing(tiny_overrides, tmp_path, point,
                                                                 extra, cached):
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    result = signal_at(point, "SIGINT", [*tiny_overrides, f"run.dir={runs / 'new'}",
                                         f"data.cache_dir={cache}", *extra])
    assert result.returncode == 75, result.stderr
    assert result.stderr.splitlines() == [STOPPED]
    assert "Traceback" not in result.stdout
    assert not runs.exists()  # created by this start, holding nothing: removed
    assert _datasets(cache) == cached  # a unit stopped midway leaves no file


@pytest.mark.slow
def test_the_start_after_a_stopped_one_trains(tiny_overrides, tmp_path):
    args = [*tiny_overrides, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path}",
            "run.steps=1", "run.sample_tokens=0"]
    assert signal_at("documents", "SIGINT", args).returncode == 75
    again = run_cli(args)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()


@pytest.mark.slow
def test_a_second_sigint_leaves_at_once(tiny_overrides, tmp_path):
    result = signal_at("peak-flops", "SIGINTx2", [*tiny_overrides, f"run.dir={tmp_path}"])
    assert result.returncode == 75, result.stderr
    assert result.stderr.splitlines() == [
        "cem-train: stopped at once by a second SIGINT, without saving the step in progress; "
        "start it again to resume from its newest checkpoint (exit status 75)"]
    with open(tmp_path / ".lock") as lock:  # the lock went with the process
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_in_process_a_signal_is_a_flag_and_a_second_sigint_a_keyboard_interrupt():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), exits.caught():  # as train() called in a notebook
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits.received() == signal.SIGTERM  # noted, nothing raised
        with pytest.raises(exits.StoppedBySignal, match=r"^stopped by a signal \(SIGTERM\)$"):
            exits.check()
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # put back
