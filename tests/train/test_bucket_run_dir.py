"""A run directory on a bucket (`run.dir=gs://...`), against the storage emulator on 127.0.0.1
(`gcs_bucket`, tests/conftest.py): orbax writes the checkpoints there through TensorStore and
everything else goes through `cem_jax.data.files`. A run stopped by SIGTERM resumes with the
losses of a straight run, on one process or after two; a fresh process reads the run back
(`load_run`, cem-eval, cem-sample, cem-export)."""

import json
import subprocess
import sys

import numpy as np
import portpicker
import pytest
from faults import fault_env
from train_helpers import REPO, run_cli, train_losses

from cem_jax.checkpoint import complete_steps
from cem_jax.data import files
from cem_jax.train.metrics import logged_records

STEPS = 6


def _bucket_losses(run_dir: str) -> dict[int, float]:
    records = [r for r in logged_records(run_dir) if r["kind"] == "train"]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def _assert_same_losses(reference: dict[int, float], losses: dict[int, float]) -> None:
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert abs(loss - losses[step]) <= 1e-5 * abs(loss), (step, loss, losses[step])


@pytest.fixture(scope="module")
def straight_losses(tiny_overrides, tmp_path_factory) -> dict[int, float]:
    """The losses of the run trained straight through on a local disk."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_cli([*tiny_overrides, f"run.steps={STEPS}", "run.checkpoint_every=2",
                      f"run.dir={run_dir}", "run.sample_tokens=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    return train_losses(run_dir)


def test_a_run_on_a_bucket_stopped_by_sigterm_resumes_as_a_straight_run(
        tiny_overrides, gcs_bucket, straight_losses):
    """SIGTERM after step 3: exit 75 with step 3's checkpoint complete on the bucket (its
    commit marker), the metrics of steps 1-3 there, no lock left; started again, it resumes
    from step 3 with the straight run's losses, and keeps its TensorBoard events and config."""
    run_dir = f"{gcs_bucket}/runs/cem"
    args = [*tiny_overrides, f"run.steps={STEPS}", "run.checkpoint_every=2",
            f"run.dir={run_dir}", "imports=[faults]"]
    stopped = run_cli(args, env=fault_env(signal_step=3))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert complete_steps(files.join(run_dir, "checkpoints")) == [2, 3]
    assert files.is_file(files.join(run_dir, "checkpoints", "3", "commit_success.txt"))
    assert sorted(_bucket_losses(run_dir)) == [1, 2, 3]
    assert not [n for n in files.names(run_dir) if n.startswith(".lock")]
    resumed = run_cli(args, env=fault_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stdout and "from step 3" in resumed.stdout
    _assert_same_losses(straight_losses, _bucket_losses(run_dir))
    assert complete_steps(files.join(run_dir, "checkpoints")) == [3, 4, 6]  # the newest 3
    events = files.names(files.join(run_dir, "tensorboard"))
    assert len(events) == 2 and all(n.startswith("events.out.tfevents.") for n in events)
    assert "run:" in files.read_text(files.join(run_dir, "config.yaml"))


def test_two_processes_train_into_a_bucket_and_one_resumes(tiny_overrides, gcs_bucket,
                                                           straight_losses, tmp_path):
    """Two processes (jax.distributed) train steps 1-3 into the bucket; one process resumes
    there to step 6 with the straight run's losses (a checkpoint holds nothing per process)."""
    run_dir = f"{gcs_bucket}/runs/two"
    port = portpicker.pick_unused_port()
    common = [*tiny_overrides, "run.checkpoint_every=2", "run.sample_tokens=0",
              f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.cli.train", *common, "run.steps=3",
         "mesh.distributed=true", f"mesh.coordinator_address=localhost:{port}",
         "mesh.num_processes=2", f"mesh.process_id={i}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert complete_steps(files.join(run_dir, "checkpoints")) == [2, 3]
    one = run_cli([*common, f"run.steps={STEPS}"])
    assert one.returncode == 0 and "from step 3" in one.stdout, one.stderr[-3000:]
    _assert_same_losses(straight_losses, _bucket_losses(run_dir))


def test_a_fresh_process_reads_a_run_on_a_bucket(tiny_overrides, gcs_bucket, tmp_path):
    """`load_run`, cem-eval, cem-sample and cem-export read a run directory on the bucket,
    each in a fresh process: the same parameters as the checkpoint's, the validation the run
    logged, a sample, and an export whose weights are those parameters."""
    run_dir = f"{gcs_bucket}/runs/read"
    trained = run_cli([*tiny_overrides, "run.steps=3", "run.sample_tokens=0",
                       "run.eval_batches=null", f"run.dir={run_dir}"])  # the whole split
    assert trained.returncode == 0, trained.stderr[-3000:]
    logged = [r for r in logged_records(run_dir) if r["kind"] == "eval" and r["step"] == 3][-1]
    script = (f"import json, numpy as np; from cem_jax.rundir import load_run; "
              f"run = load_run({run_dir!r}); "
              f"print(json.dumps({{'step': run.step, 'embed': float(np.abs("
              f"run.params['embed']).sum()), 'sha': run.tokenizer.sha256}}))")
    loaded = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    read = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert read["step"] == 3 and read["embed"] > 0
    assert read["sha"] == _local_tokenizer_sha(tiny_overrides)
    evaluated = subprocess.run([sys.executable, "-m", "cem_jax.cli.evaluate", "--run", run_dir,
                                "--no-progress"], cwd=REPO, capture_output=True, text=True,
                               timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"{logged['loss']:.4f}" in evaluated.stdout  # the loss the run logged at its end
    sampled = subprocess.run([sys.executable, "-m", "cem_jax.cli.sample", "--run", run_dir,
                              "--max-new-tokens", "8", "--prompt", "the king"], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0 and "the king" in sampled.stdout, sampled.stderr[-3000:]
    out = tmp_path / "export"
    exported = subprocess.run([sys.executable, "-c", "import sys; from cem_jax.cli.export "
                               "import main; sys.exit(main())", "--run", run_dir, "--format",
                               "safetensors", "--out", str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0 and "wrote safetensors" in exported.stdout, \
        exported.stderr[-3000:]
    from safetensors.numpy import load_file
    weights = load_file(str(out / "model.safetensors"))
    embed = weights["embed"]
    assert float(np.abs(embed).sum()) == pytest.approx(read["embed"], rel=1e-6)


def _local_tokenizer_sha(overrides: list[str]) -> str:
    from cem_jax.data import load_tokenizer
    path = next(o.split("=", 1)[1] for o in overrides if o.startswith("data.tokenizer="))
    return load_tokenizer(path).sha256


def test_a_second_launcher_is_refused_and_a_lapsed_lock_is_taken_over(gcs_bucket,
                                                                      monkeypatch):
    """The bucket lock: while one holder has `.lock.1`, a second launcher gets RunDirInUse
    (the emulator honours the generation precondition); released, the next one takes `.lock.1`
    again; a lock not refreshed for LEASE_S seconds is taken over as `.lock.2`."""
    from cem_jax.train import lock

    run_dir = f"{gcs_bucket}/runs/locked"
    with lock.run_dir_lock(run_dir, lead=True):
        assert [n for n in files.names(run_dir) if n.startswith(".lock")] == [".lock.1"]
        with pytest.raises(lock.RunDirInUse, match="in use by another cem-train"):
            with lock.run_dir_lock(run_dir, lead=True):
                pass
        assert not files.create_new(files.join(run_dir, ".lock.1"), b"x")  # the precondition
    assert [n for n in files.names(run_dir) if n.startswith(".lock")] == []
    files.write_text(files.join(run_dir, ".lock.1"), "pid 1 on a deleted slice, token t")
    monkeypatch.setattr(lock, "LEASE_S", 0.0)  # that holder is long gone
    with lock.run_dir_lock(run_dir, lead=True):
        assert [n for n in files.names(run_dir) if n.startswith(".lock")] == [".lock.2"]
    assert [n for n in files.names(run_dir) if n.startswith(".lock")] == []


def test_cem_compare_and_cem_study_train_into_a_runs_dir_on_a_bucket(tiny_overrides,
                                                                     gcs_bucket):
    """`train_one` (cem-compare's and cem-study's runner) with a runs directory on the bucket:
    the run trains there, its log and wall-time book land beside it, and a second call reuses
    the finished run instead of training it again."""
    from cem_jax.compare.runs import RunSpec, train_one

    config = REPO / "configs" / "shakespeare_cem.yaml"
    spec = RunSpec.make("cem", str(config), 3, 0, 3, f"{gcs_bucket}/study", tiny_overrides)
    assert spec.cfg.run.dir == f"{gcs_bucket}/study/cem/steps3_seed0"
    row = train_one(spec, "cem-study")
    assert row["ok"] and row["status"] == 0, row
    assert sorted(_bucket_losses(spec.cfg.run.dir)) == [1, 2, 3]
    assert "validation after 3 steps" in files.read_text(files.join(spec.cfg.run.dir,
                                                                    "train.log"))
    wall = json.loads(files.read_text(files.join(spec.cfg.run.dir, "compare.json")))["wall_s"]
    again = train_one(spec, "cem-study")
    assert again["ok"] and again["wall_s"] == wall and again["eval"] == row["eval"]


def test_a_step_without_its_commit_marker_is_never_restored_and_is_cleaned_up(
        tiny_overrides, gcs_bucket, straight_losses):
    """On a bucket a step is complete once orbax wrote `N/commit_success.txt` last: a step
    without it (a save cut by a kill or an outage) is no checkpoint to `complete_steps`,
    `available_steps` or a resume, which starts from the step before it; that start removes the
    partial step and writes it again, with the straight run's losses."""
    from cem_jax.checkpoint import partial_checkpoints
    from cem_jax.rundir import available_steps

    run_dir = f"{gcs_bucket}/runs/torn"
    args = [*tiny_overrides, "run.checkpoint_every=2", "run.sample_tokens=0",
            f"run.dir={run_dir}"]
    first = run_cli([*args, "run.steps=4"])
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = files.join(run_dir, "checkpoints")
    files.remove(files.join(checkpoints, "4", "commit_success.txt"))  # as if cut mid-save
    assert complete_steps(checkpoints) == [2] == available_steps(run_dir)
    assert partial_checkpoints(checkpoints) == [files.join(checkpoints, "4")]
    resumed = run_cli([*args, f"run.steps={STEPS}"])
    assert resumed.returncode == 0 and "from step 2" in resumed.stdout, resumed.stderr[-3000:]
    assert complete_steps(checkpoints) == [2, 4, 6] and partial_checkpoints(checkpoints) == []
    _assert_same_losses(straight_losses, _bucket_losses(run_dir))


@pytest.mark.parametrize("args,message", [
    (["run.dir=gs://no-such-bucket-here/runs/x"],
     "the bucket gs://no-such-bucket-here does not exist"),
    (["run.dir=s3://b/runs/x"], "'run.dir' = 's3://b/runs/x' is invalid: it must be a local "
     "path or a gs:// URL"),
])
def test_a_run_dir_that_cannot_be_is_one_line_status_2(tiny_overrides, gcs_bucket, args,
                                                       message):
    """A bucket that does not exist, or a URL of storage other than gs://: status 2 (no
    retry helps), one line that says what is wrong."""
    result = run_cli([*tiny_overrides, "run.steps=2", *args])
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert len([line for line in result.stderr.splitlines() if "cem-train" in line]) == 1


def test_gcs_is_read_as_gs_and_an_export_to_a_url_is_refused(tiny_overrides, gcs_bucket,
                                                              tmp_path):
    """`gcs://` (gcsfs's other name) trains into the same run as `gs://`; cem-export's --out
    is a local directory: a URL is refused in one line, nothing written."""
    name = gcs_bucket.removeprefix("gs://")
    trained = run_cli([*tiny_overrides, "run.steps=2", "run.sample_tokens=0",
                       f"run.dir=gcs://{name}/runs/g"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert complete_steps(f"{gcs_bucket}/runs/g/checkpoints") == [2]
    exported = subprocess.run([sys.executable, "-c", "import sys; from cem_jax.cli.export "
                               "import main; sys.exit(main())", "--run", f"{gcs_bucket}/runs/g",
                               "--format", "safetensors", "--out", f"{gcs_bucket}/export"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 2 and "is a URL" in exported.stderr, exported.stderr
    assert not list(tmp_path.iterdir()) and not files.exists(f"{gcs_bucket}/export")
