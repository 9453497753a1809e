"""Two processes on localhost (`jax.distributed`, gloo CPU collectives, one device each) train
with the same losses as one process holding the whole batch, with the parameters split across
them (fsdp: the end-of-training sample decodes from split parameters too), stop together on a
preemption notice, and resume on another process count."""

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
    assert not (tmp_path / "two" / "checkpoints" / "6" / "data").exists()  # the step is all
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


def _two_processes(args: list[str], timeout: float = 300) -> list[str]:
    """`cem-train ARGS` on two processes (one CPU device each) over jax.distributed; returns
    their outputs (AssertionError unless both exit 0)."""
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.train", *args, "mesh.distributed=true",
         f"mesh.coordinator_address=localhost:{port}", "mesh.num_processes=2",
         f"mesh.process_id={i}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs


def test_a_run_resumes_on_another_process_count(tiny_overrides, tmp_path):
    """2 processes to step 3, then 1 to step 6; and 1 to step 3, then 2 to step 6: both log the
    uninterrupted single process's losses (the batch of a step depends on the step alone), and
    the two processes tokenized the corpus together, into a fresh cache, once."""
    common = [*tiny_overrides, "run.checkpoint_every=3", "run.sample_tokens=0",
              "run.eval_batches=1"]
    whole = run_cli([*common, "run.steps=6", f"run.dir={tmp_path / 'whole'}"])
    assert whole.returncode == 0, whole.stderr
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    outputs = _two_processes([*common, "run.steps=3", f"run.dir={tmp_path / 'a'}", cache])
    tokenized = list((tmp_path / "cache" / "tokens").iterdir())
    assert len(tokenized) == 2  # the training corpus and the validation one
    units = sorted(p.name for p in (tokenized[0] / "units").iterdir())
    assert len(units) >= 1 and (tokenized[0] / "manifest.json").is_file()
    one = run_cli([*common, "run.steps=6", f"run.dir={tmp_path / 'a'}", cache])
    assert one.returncode == 0 and "resumed" in one.stdout, one.stderr
    first = run_cli([*common, "run.steps=3", f"run.dir={tmp_path / 'b'}", cache])
    assert first.returncode == 0, first.stderr
    outputs = _two_processes([*common, "run.steps=6", f"run.dir={tmp_path / 'b'}", cache])
    assert "resumed" in outputs[0]
    reference = train_losses(tmp_path / "whole")
    for name in ("a", "b"):
        losses = train_losses(tmp_path / name)
        assert sorted(losses) == list(range(1, 7)), name
        for step, loss in reference.items():
            assert abs(loss - losses[step]) <= 1e-5 * abs(loss), (name, step)


def test_an_imported_llama_fine_tunes_on_two_processes(tiny_overrides, tmp_path):
    """cem-import's run directory (checkpoint 0, written by one process) trains on two."""
    from helpers import random_params

    from cem_jax.data import load_tokenizer
    from cem_jax.export.hf_llama import export_hf_llama
    from cem_jax.export.importer import import_llama
    from cem_jax.train import load_config

    baseline = ["model.tie_attention=false", "model.tie_mlp=false", "model.preconditioner=none"]
    cfg = load_config(None, [*tiny_overrides, *baseline])
    tokenizer = next(o.split("=", 1)[1] for o in tiny_overrides if o.startswith("data.tokenizer="))
    export_hf_llama(random_params(cfg.model), cfg.model, load_tokenizer(tokenizer),
                    tmp_path / "hf")
    data = [o for o in tiny_overrides if o.startswith(("data.", "optimizer.", "run."))]
    import_llama(tmp_path / "hf", tmp_path / "run", overrides=[*data, "run.steps=2",
                                                               "run.sample_tokens=0"])
    outputs = _two_processes(["--config", str(tmp_path / "run" / "config.yaml")])
    assert "resumed" in outputs[0] and "validation after 2 steps" in outputs[0]
    assert sorted(train_losses(tmp_path / "run")) == [1, 2]
