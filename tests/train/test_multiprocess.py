"""Two processes on localhost (`jax.distributed`, gloo CPU collectives, one device each) train
with the same losses as one process holding the whole batch, with the parameters split across
them (fsdp: the end-of-training sample decodes from split parameters too), and stop together
on a preemption notice."""

import re
import subprocess
import sys

import portpicker
from train_helpers import REPO, run_cli, train_losses

STEPS = 6


def test_two_processes_match_one(tiny_overrides, tmp_path):
    common = [*tiny_overrides, f"run.steps={STEPS}", "run.checkpoint_every=3"]
    single = run_cli([*common, f"run.dir={tmp_path / 'one'}"])
    assert single.returncode == 0, single.stderr
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.train", *common, f"run.dir={tmp_path / 'two'}",
         "mesh.distributed=true", f"mesh.coordinator_address=localhost:{port}",
         "mesh.num_processes=2", f"mesh.process_id={i}", "mesh.data=1", "mesh.fsdp=2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "'fsdp': 2" in outputs[0]  # one mesh over both processes' devices
    assert "sample:" in outputs[0]
    assert "validation after" in outputs[0] and "validation after" not in outputs[1]
    assert sorted((tmp_path / "two" / "checkpoints" / "6" / "data").glob("*.json")) == [
        tmp_path / "two" / "checkpoints" / "6" / "data" / f"process_{i}-of-2.json"
        for i in range(2)]
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5 * abs(one[step]), step


def test_sigterm_stops_every_process_at_one_step_through_the_preemption_service(
        tiny_overrides, tmp_path):
    """Several processes: SIGTERM (a preemption notice) reaches JAX's preemption service, and
    every process stops after the same sync step and saves it, without a collective per step."""
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.train", *tiny_overrides, f"run.dir={tmp_path}",
         "run.steps=200", "run.checkpoint_every=100", "run.debug_signal_step=3",
         "run.debug_signal=SIGTERM", "mesh.distributed=true",
         f"mesh.coordinator_address=localhost:{port}", "mesh.num_processes=2",
         f"mesh.process_id={i}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [75, 75], outputs  # stopped: relaunch to resume
    stopped = re.search(r"stopped by a signal \(SIGTERM\) at step (\d+)", outputs[0])
    assert stopped, outputs[0]
    step = int(stopped.group(1))
    assert 3 < step < 200  # the sync step comes after the notice
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(step)]
    assert max(train_losses(tmp_path)) == step
