"""What a run reports: metrics to `metrics.jsonl` and TensorBoard event files (process 0 only),
and the analytic FLOP count behind MFU.

FLOPs (`flops_per_token`): a matmul of an [n,a] by [a,b] costs 2·n·a·b. Per token, forward, with
D, H, G (key heads), K, F, V, L layers, S = cfg.steps, and N = the sequence length T (attention
is counted over the full T as in PaLM's MFU, not halved for causality):

  attention, tied:   keys 2·D·G·K once + S × (query 2·D·H·K + scores 2·H·K·N + p·k 2·H·K·N
                     + output with Wqᵀ 2·H·K·D)
     DPLR adds per step a width-D head: scores 2·D·N per head (once if shared) + p·c 2·H·D·N
  attention, untied: keys and values 2·2·D·G·K once + S × (query, scores, p·v, output, as above)
  MLP, tied:         up 2·D·F once + S × (gate 2·D·F + gateᵀ 2·D·F)
  MLP, untied:       up 2·D·F once + S × (gate 2·D·F + down 2·F·D)
  preconditioner "dplr": S × 2·2·D·r per sub-layer;  output head 2·D·V
  (norms, RoPE, softmax, activations and the embedding lookup are not counted)

Training = 3 × forward (the backward pass costs about twice the forward). MFU = FLOPs/token ×
tokens/s / peak FLOP/s of all devices.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from tensorboardX import SummaryWriter

from cem_jax.config import ModelConfig
from cem_jax.data.cache import atomic_file

# Peak dense bf16 FLOP/s per device, by whole words of `jax.Device.device_kind` (vendor
# sheets); the first name that matches wins, so a longer name precedes its prefix.
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6": 918e12, "H200": 989e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "L4": 121e12, "V100": 125e12}


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token of a forward pass (×3 when `training`), by the formula above."""
    D, H, G, K, F, V, S, N = (cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_width,
                              cfg.mlp_dim, cfg.vocab_size, cfg.steps, seq_len)
    per_step = 2 * D * H * K * 2 + 2 * H * K * N * 2
    if cfg.tie_attention:
        once = 2 * D * G * K
        if cfg.interaction == "dplr":
            per_step += 2 * D * N * (H if cfg.diagonal == "per_head" else 1) + 2 * H * D * N
    else:
        once = 2 * 2 * D * G * K
    attention = once + S * per_step
    mlp = 2 * D * F + S * 2 * (2 * D * F)
    precond = 2 * S * 2 * 2 * D * cfg.preconditioner_rank if cfg.preconditioner == "dplr" else 0
    forward = cfg.num_layers * (attention + mlp + precond) + 2 * D * V
    return float(forward * (3 if training else 1))


def matmul_peak_probe(n: int = 2048) -> tuple[Callable[[], jax.Array], float]:
    """A zero-argument jitted fp32 n×n matmul on the default device and its FLOPs (2·n³): the
    probe behind the measured CPU peak (benchmarks time it beside the train step)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    f = jax.jit(lambda x: x @ x)
    return lambda: f(a), 2.0 * n**3


def measure_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of `matmul_peak_probe(n)` (median of `repeats` after a warm-up call)."""
    probe, flops = matmul_peak_probe(n)
    jax.block_until_ready(probe())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(probe())
        times.append(time.perf_counter() - start)
    return flops / float(np.median(times))


def table_peak_flops(device_kind: str) -> tuple[str, float] | None:
    """(name, bf16 FLOP/s) of the first `PEAK_FLOPS` entry whose words appear in
    `device_kind` (e.g. "NVIDIA H200"), or None for a device not in the table."""
    for name, flops in PEAK_FLOPS.items():
        if re.search(rf"\b{re.escape(name)}\b", device_kind, re.IGNORECASE):
            return name, flops
    return None


def peak_flops(configured: float | None) -> tuple[float, str]:
    """Peak FLOP/s of all devices and where the figure came from: `configured` if given, the
    `PEAK_FLOPS` table for a known accelerator (times the device count), else a matmul measured
    on one local device: times the device count, or on CPU the process count (the host devices
    of one process, e.g. from `--xla_force_host_platform_device_count`, share its cores)."""
    if configured is not None:
        return configured, "configured"
    if known := table_peak_flops(jax.devices()[0].device_kind):
        name, flops = known
        return flops * jax.device_count(), f"table ({name} bf16)"
    n = jax.process_count() if jax.default_backend() == "cpu" else jax.device_count()
    return measure_matmul_peak() * n, "measured fp32 matmul"


class MetricsWriter:
    """Append metric records to `run_dir/metrics.jsonl` and TensorBoard event files in
    `run_dir/tensorboard`; a no-op on processes other than 0.

    A run resumed from step N (`resume_step`) trains steps N+1, ... again: the records of
    those steps that a killed process had logged are dropped from metrics.jsonl (rewritten
    atomically), and TensorBoard purges them (`purge_step`), so each step is logged once."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.active = jax.process_index() == 0
        if self.active:
            path = Path(run_dir) / "metrics.jsonl"
            if resume_step is not None and path.is_file():
                lines = path.read_bytes().splitlines(keepends=True)
                with atomic_file(path) as f:
                    f.writelines(line for line in lines if _logged_by(line, resume_step))
            self.jsonl = open(path, "a")  # noqa: SIM115
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, kind: str, values: dict[str, float]) -> None:
        """One record {"step", "kind" ("train"/"eval"), "time", **values}; TensorBoard tags
        are `kind/name`."""
        if not self.active:
            return
        record = {"step": step, "kind": kind, "time": time.time(),
                  **{k: float(v) for k, v in values.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for name, value in values.items():
            self.tb.add_scalar(f"{kind}/{name}", float(value), step)

    def close(self) -> None:
        """Flush and close the files."""
        if self.active:
            self.jsonl.close()
            self.tb.close()


def _logged_by(line: bytes, step: int) -> bool:
    """Whether a metrics.jsonl line is a whole record of a step ≤ `step` (a kill can tear the
    last line)."""
    try:
        return json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
        return False
