"""`run.profile_start`: a `jax.profiler` trace of the chosen steps in the run's tensorboard/,
each step marked, the records unchanged; the window of a resumed run, a stop inside it."""

import contextlib
import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from cem_jax.train import load_config, train
from cem_jax.train.hooks import Profile
from cem_jax.train.loop import TrainLoop
from cem_jax.train.metrics import logged_records
from cem_jax.train_config import RunConfig


def traced_steps(tensorboard: Path) -> set[int]:
    """The step numbers of the "train" step annotations in the one trace under `tensorboard`
    (its `plugins/profile/<time>/<host>.trace.json.gz`, beside the .xplane.pb and Perfetto
    files)."""
    trace, = (tensorboard / "plugins" / "profile").glob("*/*.trace.json.gz")
    assert (trace.parent / "perfetto_trace.json.gz").is_file()
    assert list(trace.parent.glob("*.xplane.pb"))
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return {int(e["args"]["step_num"]) for e in events if e.get("name") == "train"}


def _values(run_dir: Path) -> list[dict]:
    """The train and eval records of metrics.jsonl without their times and speeds."""
    return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s", "mfu")}
            for r in logged_records(run_dir) if r["kind"] != "goodput"]


@pytest.mark.parametrize("field,value", [("profile_start", 0), ("profile_steps", 0)])
def test_a_profile_window_of_no_step_is_refused(field, value):
    with pytest.raises(ValueError, match=f"'run.{field}' = 0"):
        load_config(None, [f"run.{field}={value}"])


def test_a_profile_traces_exactly_its_steps_and_changes_no_record(tiny_overrides, tmp_path):
    args = [*tiny_overrides, "run.steps=8", "run.sample_tokens=0"]
    train(load_config(None, [*args, f"run.dir={tmp_path / 'plain'}"]))
    train(load_config(None, [*args, f"run.dir={tmp_path / 'profiled'}", "run.profile_start=3",
                             "run.profile_steps=3"]))
    assert traced_steps(tmp_path / "profiled" / "tensorboard") == {3, 4, 5}
    assert not (tmp_path / "plain" / "tensorboard" / "plugins").exists()
    records = _values(tmp_path / "profiled")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))
    assert records == _values(tmp_path / "plain")


def _profiled_loop(run_dir: Path, first: int, last: int, start: int, steps: int,
                   fail_at: int | None = None) -> Profile:
    """Steps `first`+1 … `last` of a counter with the Profile hook, as `make_loop` wires it;
    the step `fail_at` raises RuntimeError. Returns the hook after the loop (trace stopped)."""
    run = RunConfig(dir=str(run_dir), steps=last, profile_start=start, profile_steps=steps)
    count = jax.jit(lambda n: (n + 1, {"loss": n.astype(jnp.float32)}))

    def step(n, batch):
        if batch == fail_at:
            raise RuntimeError(f"step {batch} fails")
        return count(n)

    with contextlib.ExitStack() as closing:
        profile = Profile(run, first)
        closing.callback(profile.close)
        loop = TrainLoop(step, jnp.int32(first), iter(range(first + 1, last + 1)),
                         first_step=first, last_step=last)
        loop.add_hook(profile, reads="state")
        loop.run()
        assert profile.traced_to is None  # stopped by the hook, at its last step
    return profile


def test_a_resumed_loop_traces_what_is_left_of_the_window(tmp_path):
    _profiled_loop(tmp_path / "part", first=4, last=8, start=3, steps=3)  # starts at once
    assert traced_steps(tmp_path / "part" / "tensorboard") == {5}
    _profiled_loop(tmp_path / "past", first=5, last=8, start=3, steps=3)
    assert not (tmp_path / "past").exists()
    _profiled_loop(tmp_path / "cut", first=0, last=8, start=7, steps=5)  # ends at run.steps
    assert traced_steps(tmp_path / "cut" / "tensorboard") == {7, 8}


def test_a_failure_inside_the_window_still_writes_the_trace(tmp_path):
    with pytest.raises(RuntimeError, match="step 4 fails"):
        _profiled_loop(tmp_path, first=0, last=8, start=2, steps=4, fail_at=4)
    assert traced_steps(tmp_path / "tensorboard") == {2, 3, 4}


def test_a_profile_of_a_run_on_a_bucket_is_uploaded_there(tiny_overrides, gcs_bucket,
                                                          tmp_path):
    """A run directory on a bucket: the trace is written to a local folder and uploaded to
    RUN_DIR/tensorboard/plugins/profile/<time>/ when it stops, its steps marked as locally."""
    from cem_jax.data import files

    run_dir = f"{gcs_bucket}/runs/profiled"
    train(load_config(None, [*tiny_overrides, "run.steps=4", "run.sample_tokens=0",
                             f"run.dir={run_dir}", "run.profile_start=2",
                             "run.profile_steps=2"]))
    profiles = files.join(run_dir, "tensorboard", "plugins", "profile")
    run, = files.names(profiles)
    local = tmp_path / "tensorboard" / "plugins" / "profile" / run
    local.mkdir(parents=True)
    for name in files.names(files.join(profiles, run)):
        (local / name).write_bytes(files.read_bytes(files.join(profiles, run, name)))
    assert traced_steps(tmp_path / "tensorboard") == {2, 3}
