"""Two processes on localhost (`jax.distributed`, gloo CPU collectives, one device each) train
with the same losses as one process holding the whole batch, with the parameters split across
them (fsdp: the end-of-training sample decodes from split parameters too), stop together on a
preemption notice, and resume on another process count."""

import os
import re
import subprocess
import sys

import portpicker
import pytest
from faults import fault_env
from train_helpers import REPO, run_cli, train_losses

pytestmark = pytest.mark.slow  # starts processes (make test-all)

STEPS = 6


def test_sigterm_stops_every_process_at_one_step_through_the_preemption_service(
        tiny_overrides, tmp_path):
    """Several processes: SIGTERM (a preemption notice) reaches JAX's preemption service, and
    every process stops after the same sync step and saves it, without a collective per step."""
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.cli.train", *tiny_overrides, f"run.dir={tmp_path}",
         "run.steps=200", "run.checkpoint_every=100", "imports=[faults]",
         "mesh.distributed=true",
         f"mesh.coordinator_address=localhost:{port}", "mesh.num_processes=2",
         f"mesh.process_id={i}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **fault_env(signal_step=3)})
        for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [75, 75], outputs  # stopped: relaunch to resume
    stopped = re.search(r"stopped by a signal \(SIGTERM\) at step (\d+)", outputs[0])
    assert stopped, outputs[0]
    step = int(stopped.group(1))
    assert 3 < step < 200  # the sync step comes after the notice
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(step)]
    assert max(train_losses(tmp_path)) == step


def _two_processes(args: list[str], timeout: float = 300, own: tuple[list, list] = ([], []),
                   returncodes: tuple[int, int] = (0, 0)) -> list[str]:
    """`cem-train ARGS` on two processes (one CPU device each) over jax.distributed, process i
    also given the arguments `own[i]`; returns their outputs (AssertionError unless they exit
    with `returncodes`)."""
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.cli.train", *args, *own[i], "mesh.distributed=true",
         f"mesh.coordinator_address=localhost:{port}", "mesh.num_processes=2",
         f"mesh.process_id={i}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert tuple(p.returncode for p in procs) == returncodes, outputs
    return outputs


def _one_process_alone(common: list[str], run_dir) -> dict[int, float]:
    """The losses of one process training all STEPS steps alone."""
    whole = run_cli([*common, f"run.steps={STEPS}", f"run.dir={run_dir}"])
    assert whole.returncode == 0, whole.stderr
    return train_losses(run_dir)


def _assert_losses_match(reference: dict[int, float], run_dir) -> None:
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)), run_dir
    for step, loss in reference.items():
        assert abs(loss - losses[step]) <= 1e-5 * abs(loss), (run_dir, step)


def test_two_processes_match_one_and_resume_on_one(tiny_overrides, tmp_path):
    """The losses of one process training 6 steps alone are those of two processes to step 3
    (tokenizing the corpus together, into a fresh cache, once), then one to step 6: the batch
    of a step depends on the step alone; a checkpoint holds nothing per process."""
    common = [*tiny_overrides, "run.checkpoint_every=3", "run.eval_batches=1"]
    reference = _one_process_alone(common, tmp_path / "whole")
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    _two_processes([*common, "run.steps=3", "run.sample_tokens=0", f"run.dir={tmp_path / 'a'}",
                    cache])
    tokenized = list((tmp_path / "cache" / "tokens").iterdir())
    assert len(tokenized) == 2 and all((t / "manifest.json").is_file() for t in tokenized)
    assert not (tmp_path / "a" / "checkpoints" / "3" / "data").exists()  # the step is all
    one = run_cli([*common, f"run.steps={STEPS}", f"run.dir={tmp_path / 'a'}", cache])
    assert one.returncode == 0 and "resumed" in one.stdout, one.stderr
    _assert_losses_match(reference, tmp_path / "a")


def test_one_process_resumes_on_two_with_the_parameters_split_across_them(tiny_overrides,
                                                                          tmp_path):
    """One process to step 3, then two to step 6 with the parameters split across them (fsdp:
    the end-of-training sample decodes from split parameters too), as one process alone."""
    common = [*tiny_overrides, "run.checkpoint_every=3", "run.eval_batches=1"]
    reference = _one_process_alone(common, tmp_path / "whole")
    first = run_cli([*common, "run.steps=3", "run.sample_tokens=0", f"run.dir={tmp_path / 'b'}"])
    assert first.returncode == 0, first.stderr
    outputs = _two_processes([*common, f"run.steps={STEPS}", f"run.dir={tmp_path / 'b'}",
                              "mesh.data=1", "mesh.fsdp=2"])
    assert "resumed" in outputs[0] and "'fsdp': 2" in outputs[0]  # a mesh over both processes
    assert "sample:" in outputs[0]
    assert "validation after" in outputs[0] and "validation after" not in outputs[1]
    _assert_losses_match(reference, tmp_path / "b")


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
    assert "from its imported parameters (checkpoint 0)" in outputs[0]
    assert "validation after 2 steps" in outputs[0]
    assert sorted(train_losses(tmp_path / "run")) == [1, 2]


def test_processes_that_see_other_data_or_no_shared_cache_stop_before_any_work(tiny_overrides,
                                                                              tmp_path):
    """Each process tokenizes its share of a raw corpus only once they agree on it and share the
    cache folder it goes to: otherwise every process stops at once (status 2) naming those
    that differ; a process whose share fails says so to the others, which stop with it."""
    (tmp_path / "other.txt").write_text("another corpus entirely " * 50)
    common = [*tiny_overrides, "run.steps=1", f"run.dir={tmp_path / 'run'}",
              f"data.cache_dir={tmp_path / 'cache'}"]
    outputs = _two_processes(common, own=([], [f"data.corpus={tmp_path / 'other.txt'}"]),
                             returncodes=(2, 2))
    assert "processes [1] see a corpus, a tokenizer or a held-out fraction other than process " \
           "0's" in outputs[0]
    outputs = _two_processes(common, own=([], [f"data.cache_dir={tmp_path / 'elsewhere'}"]),
                             returncodes=(2, 2))
    assert "processes [1] do not see the cache folder" in outputs[0]
    assert "Run `cem-data tokenize --out DIR` once" in outputs[0]
    (tmp_path / "empty.txt").write_text("")  # no text: process 0, writing the manifest, says so
    outputs = _two_processes([*common, f"data.corpus={tmp_path / 'empty.txt'}"],
                             returncodes=(2, 2))
    assert "holds no text" in outputs[0], outputs[0]
    assert "processes [0] could not tokenize the corpus (process 0: " in outputs[1], outputs[1]
    assert not (tmp_path / "run").exists()
