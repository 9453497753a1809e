"""Resuming: a run killed (SIGKILL) or preempted (SIGTERM, exit status 75) at step 10 and resumed
to step 20 logs the same records as a run of 20 steps straight (the fp32 losses step for step,
every validation), and TensorBoard shows every logged value once; so does a run stopped during a
validation, periodic or final; every optimizer setting may change on resume (a real resume with
clipping and weight decay turned off: tests/train/test_train_loop.py); a checkpoint of another
state structure is refused by name; a killed save's temporary folder is removed before the
checkpointer is used; a full disk leaves the newest checkpoint as it was; a
finished run started again reports what it logged and writes nothing."""

import dataclasses
import fcntl
import json
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from faults import fault_env
from tensorboardX.proto.event_pb2 import Event, SessionLog
from train_helpers import REPO, run_cli, signal_at, train_losses

from cem_jax.checkpoint import Checkpointer, CheckpointError, complete_steps
from cem_jax.config import ModelConfig
from cem_jax.data import load_tokenizer
from cem_jax.optim import decay_mask, learning_rate, make_optimizer
from cem_jax.rundir import load_run
from cem_jax.sharding import make_mesh, replicated
from cem_jax.train import load_config, train
from cem_jax.train.logs import log_to_stdout
from cem_jax.train.metrics import MetricsWriter, logged_records, logged_values
from cem_jax.train.step import Trainer
from cem_jax.train_config import MeshConfig, OptimizerConfig

STEPS = 20
EVERY = [f"run.steps={STEPS}", "run.checkpoint_every=4", "run.eval_every=5"]
VARYING = ("kind", "step", "time", "tokens_per_s", "mfu")  # differ between runs, or keyed on
# A changed value of every OptimizerConfig field (defaults: lr 3e-3, warmup 100, min ratio 0.1,
# b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1, clip 1.0, accumulation 1).
CHANGED = {"lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 0.0, "b1": 0.0, "b2": 0.999,
           "eps": 1e-6, "weight_decay": 0.0, "clip_norm": 0.0, "accumulation_steps": 2}


def tensorboard_scalars(run_dir) -> dict[tuple[str, int], float]:
    """{(tag, step): value} as TensorBoard shows the run's event files: files in name order,
    each `SessionLog.START` event hiding the steps >= its step read before it (TensorBoard's
    purge for event files of version 2); AssertionError if a (tag, step) is shown twice."""
    shown = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, i, events = path.read_bytes(), 0, []
        while i + 12 <= len(data):  # TFRecord: length u64, crc u32, data, crc u32
            n = struct.unpack("<Q", data[i:i + 8])[0]
            if i + 16 + n > len(data):  # torn by a kill: TensorBoard stops there too
                break
            events.append(Event.FromString(data[i + 12:i + 12 + n]))
            i += 16 + n
        if not events:  # a process killed before its first flush: TensorBoard skips it
            continue
        assert events[0].file_version == "brain.Event:2", path  # purges by SessionLog.START
        for event in events:
            if event.session_log.status == SessionLog.START:
                shown = [s for s in shown if s[1] < event.step]
            shown += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    shown = [s for s in shown if not s[0].startswith("goodput/")]
    keys = [(tag, step) for tag, step, _ in shown]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    return {(tag, step): value for tag, step, value in shown}


def logged_scalars(run_dir) -> dict[tuple[str, int], float]:
    """metrics.jsonl's train and eval records as {("kind/name", step): value rounded to
    float32} (TensorBoard's precision); AssertionError if a (kind, step) is logged twice."""
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if r["kind"] != "goodput"]  # every launch's: test_resume_after_signal_is_exact
    kinds = [(r["kind"], r["step"]) for r in records]
    assert len(kinds) == len(set(kinds)), kinds
    return {(f"{r['kind']}/{k}", r["step"]): float(np.float32(v))
            for r in records for k, v in r.items() if k not in ("step", "kind", "time")}


def logged(run_dir) -> list[tuple[str, int, dict[str, float]]]:
    """metrics.jsonl's train and eval records in order as (kind, step, values), without the
    values that differ between two runs of the same steps (time, tokens/s, MFU)."""
    return [(r["kind"], r["step"], {k: v for k, v in r.items() if k not in VARYING})
            for r in logged_records(run_dir) if r["kind"] != "goodput"]


@pytest.fixture(scope="module")
def straight(tiny_overrides, tmp_path_factory):
    """The run directory of 20 steps straight, validated every 5."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_cli([*tiny_overrides, f"run.dir={run_dir}", *EVERY])
    assert result.returncode == 0, result.stderr
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5  # it learns
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("sig,returncode", [
    ("SIGKILL", 1),  # a kill of the training process: test_train_loop.py too
    ("SIGTERM", 75)])
def test_resume_after_signal_is_exact(straight, tiny_overrides, tmp_path, sig, returncode):
    common = [*tiny_overrides, f"run.dir={tmp_path}", *EVERY]
    first = run_cli([*common, "imports=[faults]"], env=fault_env(signal_step=10, signal=sig))
    assert first.returncode == returncode, first.stderr
    if sig == "SIGKILL":  # cem-train's supervisor says how its training process ended
        [line] = first.stderr.splitlines()
        assert line.startswith("cem-train: crashed: the training process died of SIGKILL "
                               "during train step 10; the newest complete checkpoint is "), line
    if sig == "SIGTERM":  # a clean stop saves the step it stopped at, and says so
        assert first.stderr.splitlines() == [
            f"cem-train: stopped by a signal (SIGTERM) at step 10; checkpoint saved in "
            f"{tmp_path / 'checkpoints'}: start it again to resume (exit status 75)"]
        assert (tmp_path / "checkpoints" / "10").is_dir()
        assert logged_values(tmp_path, 10, "eval") is None  # due, not done: the stop is prompt
    # metrics are read a step late: a hard kill right after dispatching step 10 loses its
    # record (the resumed run logs it); a clean stop finishes the step first
    assert max(train_losses(tmp_path)) == (10 if sig == "SIGTERM" else 9)
    second = run_cli(common, env=fault_env())  # config.yaml names faults: importable, no fault
    assert second.returncode == 0, second.stderr
    output = second.stdout + second.stderr
    resumed_from = int(output.split("from step ")[1].split()[0])
    assert resumed_from == 10 if sig == "SIGTERM" else 4 <= resumed_from <= 10
    assert train_losses(tmp_path) == train_losses(straight)  # every step, bit for bit
    assert logged(tmp_path) == logged(straight)  # the validation due at step 10 too
    # The killed process's records up to its checkpoint were flushed with it: TensorBoard shows
    # every step once, with the values of metrics.jsonl.
    shown = tensorboard_scalars(tmp_path)
    assert shown == logged_scalars(tmp_path)
    assert sorted(step for tag, step in shown if tag == "train/loss") == \
        list(range(1, STEPS + 1))
    # Goodput counts both launches: the steps the first took after step `resumed_from` were
    # taken again, and its time from its last record to the relaunch was lost.
    records = [r for r in logged_records(tmp_path) if r["kind"] == "goodput"]
    [killed, relaunched] = sorted({r["launch"] for r in records})
    last_killed = [r for r in records if r["launch"] == killed][-1]
    kept = [r for r in records if r["launch"] == killed and r["step"] <= resumed_from][-1]
    final = records[-1]
    assert final["ended"] == 1 and final["launch"] == relaunched and final["launches"] == 2
    assert final["first_step"] == resumed_from and final["step"] == STEPS
    assert final["steps_recomputed"] == last_killed["step"] - resumed_from
    assert final["recompute_s"] == pytest.approx(last_killed["step_s"] - kept["step_s"])
    assert final["fault_s"] == pytest.approx(relaunched - last_killed["time"], abs=0.01)
    assert final["fault_s"] > 0
    assert final["wall_s"] == pytest.approx(final["time"] - killed, abs=0.01)
    productive = last_killed["step_s"] + final["step_s"] - final["recompute_s"]
    assert final["goodput"] == pytest.approx(productive / final["wall_s"])
    assert f"goodput {final['goodput']:.1%} of " in second.stdout


@pytest.mark.slow  # ~40 s: three runs
def test_a_run_stopped_during_a_validation_does_it_when_started_again(straight, tiny_overrides,
                                                                      tmp_path):
    common = [*tiny_overrides, f"run.dir={tmp_path}", *EVERY]
    checkpoints = tmp_path / "checkpoints"
    first = signal_at("eval-1", "SIGTERM", common)  # during the validation of step 5
    assert first.returncode == 75, first.stderr
    assert first.stderr.splitlines() == [
        f"cem-train: stopped by a signal (SIGTERM) at step 5; checkpoint saved in {checkpoints}: "
        f"start it again to resume (exit status 75)"]
    assert logged_values(tmp_path, 5, "eval") is None
    # Started again, it validates step 5 first, then 10 and 15; its 4th validation is the final
    second = signal_at("eval-4", "SIGTERM", common)
    assert second.returncode == 75, second.stderr
    assert second.stderr.splitlines() == [
        f"cem-train: stopped by a signal (SIGTERM) during the final validation; the checkpoint "
        f"of step {STEPS} is kept in {checkpoints}: start it again to validate (exit status 75)"]
    assert (checkpoints / str(STEPS)).is_dir() and logged_values(tmp_path, STEPS, "eval") is None
    third = run_cli(common)
    assert third.returncode == 0, third.stderr
    assert "nothing to train" not in third.stdout and "step 21" not in third.stdout
    assert logged(tmp_path) == logged(straight)


def test_a_run_resumed_and_stopped_before_its_first_step_keeps_what_it_had(
        straight, tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    result = signal_at("peak-flops", "SIGTERM", [*tiny_overrides, f"run.dir={run_dir}",
                                                 *EVERY, "run.steps=24"])
    assert result.returncode == 75, result.stderr
    assert result.stderr.splitlines() == [
        f"cem-train: stopped by a signal (SIGTERM) before its first step; the run stays at step "
        f"{STEPS} ({run_dir / 'checkpoints'}): start it again to resume (exit status 75)"]
    assert complete_steps(run_dir / "checkpoints") == [12, 16, 20]
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    with open(run_dir / ".lock") as lock:  # released
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_full_disk_is_one_line_and_keeps_the_newest_checkpoint(straight, tiny_overrides,
                                                                 tmp_path):
    """A real failed write: the resumed run may write files of at most 64 KiB (RLIMIT_FSIZE;
    a write past it fails with EFBIG, SIGXFSZ ignored), and its checkpoint's arrays take more,
    so its save at step 24 fails inside orbax/TensorStore."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    limited = ("import resource, runpy, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)); "
               "runpy.run_module('cem_jax.cli.train', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", limited, *tiny_overrides, f"run.dir={run_dir}",
                             *EVERY, "run.steps=24"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"cem-train: error: cannot write {run_dir / 'checkpoints'}: File too large; raise the "
        f"file size limit (ulimit -f) or give another run.dir (the newest checkpoint, step 20, "
        f"is kept) (exit status 2)"]
    assert "Traceback" not in result.stdout and "ERROR" not in result.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["12", "16", "20"]
    assert load_run(run_dir).step == STEPS  # the newest checkpoint reads as it did


def test_a_new_or_resumed_writer_leaves_each_step_logged_once(tmp_path):
    first = MetricsWriter(tmp_path)  # a new run, killed at step 5 after a checkpoint at 3
    for step in range(1, 6):
        first.write(step, "train", {"loss": 1.0 / step})
    first.close()
    again = MetricsWriter(tmp_path, resume_step=3)
    for step in (4, 5, 6):
        again.write(step, "train", {"loss": 2.0 / step})
    again.close()
    expected = {("train/loss", s): float(np.float32((1.0 if s <= 3 else 2.0) / s))
                for s in range(1, 7)}
    assert tensorboard_scalars(tmp_path) == logged_scalars(tmp_path) == expected
    fresh = MetricsWriter(tmp_path)  # killed before its first checkpoint: it starts over
    fresh.write(1, "train", {"loss": 3.0})
    fresh.close()
    assert tensorboard_scalars(tmp_path) == logged_scalars(tmp_path) == {("train/loss", 1): 3.0}
    MetricsWriter(tmp_path, resume_step=1).close()  # nothing logged: no new event file
    assert len(list((tmp_path / "tensorboard").iterdir())) == 3


def _restored_as(opt: OptimizerConfig, total_steps: int = 10):
    """The structure, shapes and dtypes of the train state a run restores its checkpoint as."""
    model = ModelConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
    abstract = Trainer(model, opt, total_steps, make_mesh(MeshConfig())).abstract_state()
    return jax.tree.structure(abstract), [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]


def test_every_optimizer_field_has_a_changed_value_below():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(OptimizerConfig)}


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_changing_an_optimizer_field_keeps_the_state_structure(field):
    assert getattr(OptimizerConfig(), field) != CHANGED[field]
    changed = dataclasses.replace(OptimizerConfig(), **{field: CHANGED[field]})
    assert _restored_as(changed, total_steps=30) == _restored_as(OptimizerConfig())


def test_a_checkpoint_of_another_structure_is_refused_by_name(tiny_overrides, tmp_path):
    # Before the optimizer was always one chain, clip_norm=0 saved AdamW's state alone.
    tokenizer_path = next(o.split("=", 1)[1] for o in tiny_overrides
                          if o.startswith("data.tokenizer="))
    params = {"embed": jnp.ones((4, 2))}
    adamw = optax.adamw(learning_rate(OptimizerConfig(), 10), mask=decay_mask)
    saved = {"params": params, "opt_state": adamw.init(params), "step": jnp.int32(2)}
    checkpointer = Checkpointer(tmp_path, keep=1)
    checkpointer.save(2, saved, {}, load_tokenizer(tokenizer_path))
    checkpointer.wait()
    built = {**saved, "opt_state": make_optimizer(OptimizerConfig(clip_norm=0), 10).init(params)}
    sharding = replicated(make_mesh(MeshConfig()))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            built)
    with pytest.raises(CheckpointError) as err:
        checkpointer.restore(2, abstract)
    checkpointer.close()
    message = str(err.value)
    assert "8 arrays differ, first opt_state.0.count: saved ((), 'int32'), built none" in message
    assert "delete" not in message and str(tmp_path / "checkpoints" / "2") in message


def test_a_killed_save_s_folder_is_gone_when_the_checkpointer_is_made(tmp_path):
    """orbax removes a killed save's temporary folder in a thread that `close` does not wait
    for: a start stopped at once removed the run directory under it (a 42-line traceback after
    the one-line message, under load). The folder (2,000 files) is gone when `Checkpointer`
    returns; the complete checkpoint beside it stays."""
    partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1733000000"
    (partial / "state").mkdir(parents=True)
    for i in range(2000):
        (partial / "state" / f"chunk{i}").write_bytes(b"0" * 64)
    complete = tmp_path / "checkpoints" / "2" / "state"
    complete.mkdir(parents=True)
    checkpointer = Checkpointer(tmp_path, keep=1)
    assert not partial.exists()
    checkpointer.close()
    assert complete.is_dir()


@pytest.mark.slow
def test_a_finished_run_started_again_reports_its_result_and_writes_nothing(
        straight, tiny_overrides, capsys):
    def files():
        return {p: p.read_bytes() for p in straight.rglob("*") if p.is_file() and
                p.name != ".lock"}

    before = files()
    *_, last, goodput = map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())
    assert last["kind"] == "eval" and last["step"] == STEPS
    assert goodput["kind"] == "goodput" and goodput["ended"] == 1
    log_to_stdout()  # what cem-train prints
    summary = train(load_config(None, [*tiny_overrides, f"run.dir={straight}", *EVERY,
                                       "optimizer.lr=0.5"]))  # nothing runs with it
    out = capsys.readouterr().out
    assert "changed settings" not in out  # and config.yaml keeps what ran (files below)
    assert summary["step"] == STEPS
    assert summary["eval"] == {k: last[k] for k in ("loss", "perplexity", "bits_per_byte_est")}
    assert f"validation after {STEPS} steps: loss {last['loss']:.4f} nats/token" in out
    assert summary["sample"] and "sample:" in out
    assert files() == before  # no metrics row, event file, checkpoint or anything else
