"""The runs of a comparison (and of the study): each config trained for its steps with one seed
(`RunSpec`) in its own `python -m cem_jax.cli.train` process, in
RUNS_DIR/<config stem>/steps<N>_seed<s> (its output in train.log there), reused when finished
and resumed when not (`train_one`), the runs in order until a signal stops one (`train_all`);
a signal that cem-compare receives meanwhile is passed on to the run in training
(`train_process`); and what its metrics say (`read_metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import cem_jax
from cem_jax import exits
from cem_jax.data import files
from cem_jax.evaluate import bits_per_byte_of
from cem_jax.train.metrics import logged_records, logged_values
from cem_jax.train_config import TrainConfig, load_config

# What to do when a run's directory holds another run (cem-compare and cem-study both train here).
_ELSEWHERE = ("move that directory away, or train in another runs directory (cem-compare's "
              "--runs-dir, a study file's runs_dir)")
# How a row's note words cem-train's exit status (`cem_jax.exits.ExitStatus`).
_STATUS_WORDS = {1: "crashed", 2: "cannot run as configured", 3: "diverged",
                 75: "stopped by a signal: run {program} again to resume it"}
Key = tuple[str, int, int]  # a run's (config stem, steps, seed)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run: config `stem` (file `path`) for `steps` with `seed`."""

    stem: str
    path: str
    steps: int
    seed: int
    args: tuple[str, ...]
    cfg: TrainConfig

    @classmethod
    def make(cls, stem: str, path: str, steps: int, seed: int, eval_every: int,
             runs_dir: str, overrides: Sequence[str]) -> RunSpec:
        """The run's `cem-train` arguments and resolved config (raises as `load_config`)."""
        args = ("run.progress=false", *overrides, f"run.steps={steps}",
                f"run.eval_every={eval_every}", f"run.seed={seed}", f"data.seed={seed}",
                f"run.dir={files.join(str(runs_dir), stem, f'steps{steps}_seed{seed}')}")
        return cls(stem, path, steps, seed, args, load_config(path, list(args)))


def train_one(spec: RunSpec, program: str = "cem-compare") -> dict:
    """Train (or resume, or reuse) one run, its lines on stdout and stderr headed by
    `program`; returns its result as a dict: "ok", "note", "status" (cem-train's exit status,
    0 for a run reused), "dir", "seed", "steps", "wall_s" and `read_metrics`' fields."""
    cfg, run_dir = spec.cfg, spec.cfg.run.dir
    row = {"dir": run_dir, "seed": spec.seed, "steps": spec.steps, "ok": False, "note": "",
           "status": 0, "stopped": False}
    clash = _other_run(run_dir, cfg)
    if clash:
        row["note"] = clash
        print(f"{program}: {spec.stem}: {clash}", file=sys.stderr)
        return row
    book = files.join(run_dir, "compare.json")  # training wall time summed over invocations
    wall = json.loads(files.read_text(book))["wall_s"] if files.is_file(book) else 0.0
    if not _finished(run_dir, cfg):
        print(f"{program}: training {spec.stem} seed {spec.seed} ({spec.steps} steps) in "
              f"{run_dir}", flush=True)
        files.make_dirs(run_dir)
        start = time.perf_counter()
        status = _train_logged(["--config", spec.path, *spec.args], files.join(run_dir,
                                                                               "train.log"))
        wall += time.perf_counter() - start
        files.write_text(book, json.dumps({"wall_s": wall}))
        row["status"], row["stopped"] = status, status == exits.ExitStatus.STOPPED
        if status != 0:
            words = _STATUS_WORDS.get(status, "killed" if status < 0 else "crashed").format(
                program=program)
            row["note"] = (f"cem-train exited with status {status} ({words}); see "
                           f"{files.join(run_dir, 'train.log')}")
            print(f"{program}: {spec.stem}: {row['note']}", file=sys.stderr)
    row.update(read_metrics(run_dir, cfg), wall_s=wall)
    row["ok"] = not row["note"] and _finished(run_dir, cfg)
    return row


def train_all(runs: Mapping[Key, RunSpec]) -> tuple[dict[Key, dict], Key | None]:
    """Train the runs in order (`train_one`): their rows by key, and the key of the run a
    signal stopped (None when none did); the rows end with that run's."""
    results = {}
    for key, spec in runs.items():
        results[key] = train_one(spec)
        if results[key]["stopped"] or exits.received() is not None:
            return results, key
    return results, None


def _train_logged(argv: list[str], log_path: str) -> int:
    """`train_process` with its output appended to the file `log_path`; on a bucket (no
    append) it is written to a local temporary file, and the log uploaded whole after."""
    if not files.is_url(log_path):
        with open(log_path, "a") as log:
            return train_process(argv, log)
    old = files.read_bytes(log_path) if files.is_file(log_path) else b""
    with tempfile.TemporaryFile() as log:
        try:
            return train_process(argv, log)
        finally:
            log.seek(0)
            files.write_bytes(log_path, old + log.read())


def train_process(argv: list[str], log) -> int:
    """Run `python -m cem_jax.cli.train ARGV` with its output in the file `log`; returns its exit
    status (`cem_jax.exits.ExitStatus`, or -N for a kill by signal N). It runs in its own
    session, and a SIGINT or SIGTERM that cem-compare receives meanwhile is passed on to it (a
    Ctrl-C in the terminal reaches it once: it stops at a safe point and saves). It imports
    the cem_jax this process runs, not a `cem_jax/` in the current directory (`python -P`):
    a study record names the commit of this process's code."""
    root = str(Path(cem_jax.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen([sys.executable, "-P", "-m", "cem_jax.cli.train", *argv], env=env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with exits.forwarding(child.pid):
        return child.wait()


def read_metrics(run_dir: str, cfg: TrainConfig) -> dict:
    """From `metrics.jsonl`: the final validation {"loss", "perplexity", "bits_per_byte"}
    ("eval", empty if none), the validation curve ("curve": [(step, bits per byte)]) and the
    median tokens/s of the training log windows after the first tenth of the steps."""
    by_kind = {"train": {}, "eval": {}}
    for r in logged_records(run_dir):  # a step logged again after a resume keeps its last
        by_kind.setdefault(r["kind"], {})[r["step"]] = r
    evals = sorted(by_kind["eval"].items())
    speeds = [r["tokens_per_s"] for step, r in by_kind["train"].items()
              if step > cfg.run.steps / 10 and "tokens_per_s" in r]
    return {"eval": evals[-1][1] if evals else {},
            "curve": [(step, bits_per_byte_of(r)) for step, r in evals],
            "tokens_per_s": statistics.median(speeds) if speeds else math.nan}


def _finished(run_dir: str, cfg: TrainConfig) -> bool:
    """The metrics hold the final validation (written once the last step is done), or, for a
    run without a validation split, the last step's training record."""
    kind = "eval" if cfg.data.has_validation else "train"
    return logged_values(run_dir, cfg.run.steps, kind) is not None


def _other_run(run_dir: str, cfg: TrainConfig) -> str:
    """Why `run_dir` cannot hold this run ("" if it is new or the same run)."""
    if not files.is_file(files.join(run_dir, "config.yaml")):
        return ""
    saved = load_config(files.join(run_dir, "config.yaml")).to_dict()
    new = cfg.to_dict()
    for section in ("model", "data", "optimizer"):
        if saved[section] != new[section]:
            return f"{run_dir} holds a run with another {section} section; {_ELSEWHERE}"
    for key in ("steps", "seed"):
        if saved["run"][key] != new["run"][key]:
            return f"{run_dir} holds a run with run.{key}={saved['run'][key]}; {_ELSEWHERE}"
    return ""
