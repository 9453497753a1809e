"""Helpers of the training tests: run `cem-train` in a subprocess (with a signal at a chosen
point, too), read a run's losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m cem_jax.cli.train ARGS` (cem-train) in a subprocess (output captured as text)."""
    return subprocess.run([sys.executable, "-m", "cem_jax.cli.train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def signal_at(point: str, sig: str, args: list[str],
              timeout: float = 300) -> subprocess.CompletedProcess:
    """`cem-train ARGS` in a subprocess that sends itself `sig` ("SIGINT", "SIGTERM", "SIGINTx2":
    twice) when it reaches `point` (tests/train/signal_at.py lists them)."""
    return subprocess.run([sys.executable, str(Path(__file__).with_name("signal_at.py")), point,
                           sig, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def train_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl ("train" records); AssertionError if a step is
    logged twice (a resume drops what it trains again)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    steps = [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def run_on_8_host_devices(script: str) -> dict:
    """Run test file `script` as a subprocess with 8 forced host CPU devices and return the JSON
    report its `__main__` prints last (XLA's device count is fixed when jax is imported)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, script], capture_output=True, text=True,
                            env=env, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
