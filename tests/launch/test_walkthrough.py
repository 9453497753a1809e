"""docs/pod_training.md's commands, run as written on a stand-in: Parquet files and a byte-level
BPE tokenizer.json this test builds, a storage emulator on 127.0.0.1 as the bucket, and the
command `launch/tpu_pod.sh` runs on each worker (its --dry-run prints it), on two processes
here, with the doc's run directory and overrides and a tiny model. The run reads the tokenized
dataset from gs://, writes its run directory there (checkpoints through orbax and TensorStore),
is preempted (SIGTERM at step 2: both processes stop at the step they agree on, save to the
bucket, status 75) and resumes from the bucket to its end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import portpicker
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from faults import fault_env
from helpers import train_byte_level_bpe

from cem_jax.checkpoint import complete_steps
from cem_jax.data import files, shards

pytestmark = pytest.mark.slow  # starts processes (make test-all)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "pod_training.md"
DOCUMENTS = 24_000
WORDS = "the school teaches reading writing science history students learn every day".split()
TINY = ["model.vocab_size=448", "model.d_model=32", "model.num_layers=2", "model.num_heads=2",
        "model.head_dim=16", "model.mlp_dim=64", "model.dtype=float32", "model.remat=none",
        "expected_params=null", "data.seq_len=16", "data.batch_size=8", "data.num_threads=1",
        "optimizer.warmup_steps=2", "run.steps=200", "run.log_every=50", "run.eval_every=1000",
        "run.eval_batches=null", "run.checkpoint_every=100", "run.sample_tokens=0"]
# 200 steps: the preemption notice reaches every process (through the coordinator) well before
# the last step, however slow the machine


def block(marker: str) -> str:
    """The shell block after `<!-- walkthrough: MARKER -->` in the doc."""
    found = re.search(rf"<!-- walkthrough: {marker} -->\n```bash\n(.*?)```", DOC.read_text(),
                      re.S)
    assert found, marker
    return found.group(1)


def stand_in_corpus(bucket: str, tmp_path: Path) -> None:
    """Step 1 of the doc, done here: three Parquet files and a tokenizer.json in the bucket."""
    rng = np.random.default_rng(0)  # enough documents for the doc's held-out fraction
    texts = [" ".join(rng.choice(WORDS, rng.integers(3, 12))) + "." for _ in range(DOCUMENTS)]
    for i in range(3):
        local = tmp_path / f"{i:03d}_00000.parquet"
        pq.write_table(pa.table({"text": texts[i::3], "id": range(i, DOCUMENTS, 3)}), local,
                       row_group_size=1000)
        files.write_bytes(f"{bucket}/fineweb-edu-10bt/{local.name}", local.read_bytes())
    train_byte_level_bpe(texts, 400, tmp_path / "tokenizer.json")
    files.write_bytes(f"{bucket}/tokenizer/tokenizer.json",
                      (tmp_path / "tokenizer.json").read_bytes())


def workers(overrides: list[str], run_dir: str,
            env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """What tpu_pod.sh runs on each of two workers, each a process of one CPU device, with
    `env` added to the environment."""
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cem_jax.cli.train", "--config", "configs/cem_full_100m.yaml",
         f"run.dir={run_dir}", "mesh.distributed=true", *overrides, *TINY,
         f"mesh.coordinator_address=localhost:{port}", "mesh.num_processes=2",
         f"mesh.process_id={i}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, **env}) for i in range(2)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate())
            for p in procs]


def test_the_pod_walkthrough_runs_on_a_stand_in(gcs_bucket, tmp_path):
    stand_in_corpus(gcs_bucket, tmp_path)
    env = {**os.environ, "BUCKET": gcs_bucket,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    tokenized = subprocess.run(["bash", "-euo", "pipefail", "-c", block("tokenize")], cwd=REPO,
                               env=env, capture_output=True, text=True, timeout=300)
    assert tokenized.returncode == 0, tokenized.stderr
    assert "every shard matches its manifest" in tokenized.stdout
    manifest = shards.read_manifest(f"{gcs_bucket}/tokens/fineweb-edu-10bt")
    assert manifest.tokenizer["kind"] == "huggingface" and manifest.held_out_fraction == 0.0005
    held_out = sum(s.documents for s in manifest.splits["held_out"])
    assert sum(s.documents for s in manifest.splits["documents"]) + held_out == DOCUMENTS
    assert 0 < held_out < 30  # 0.05% of them

    command = block("train").replace("\\\n", " ")
    options, overrides = (subprocess.run(
        ["bash", "-c", "printf '%s\\n' " + part], env=env, capture_output=True, text=True,
        check=True).stdout.split() for part in command.split(" -- ", 1))
    assert f"data.corpus={gcs_bucket}/tokens/fineweb-edu-10bt" in overrides
    assert "--config configs/cem_full_100m.yaml" in command  # what `workers` runs
    run_dir = options[options.index("--run-dir") + 1]
    assert run_dir == f"{gcs_bucket}/runs/cem-100m"
    # what the launcher would run on the workers: that run.dir, and no gcsfuse mount
    dry = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True,
                         env={**env, "DRY_RUN": "1", "REPO_URL": "https://example.invalid/x.git"},
                         timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert f"run.dir={run_dir}" in dry.stdout and "gcsfuse" not in dry.stdout

    preempted = workers([*overrides, "imports=[faults]"], run_dir,
                        fault_env(signal_step=2))  # the preemption notice after step 2
    assert [p.returncode for p in preempted] == [75, 75], [p.stderr for p in preempted]
    stopped = re.search(r"stopped by a signal \(SIGTERM\) at step (\d+)", preempted[0].stderr)
    assert stopped and 2 <= int(stopped.group(1)) < 200, preempted[0].stderr
    assert complete_steps(f"{run_dir}/checkpoints")[-1] == int(stopped.group(1))  # saved first
    assert not files.exists(f"{run_dir}/.lock.1")  # released at the stop
    resumed = workers(overrides, run_dir, fault_env())
    assert [p.returncode for p in resumed] == [0, 0], [p.stderr for p in resumed]
    assert f"resumed {run_dir} from step {stopped.group(1)}" in resumed[0].stdout
    assert "validation after 200 steps" in resumed[0].stdout
    assert complete_steps(f"{run_dir}/checkpoints")[-1] == 200
