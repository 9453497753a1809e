"""What a run reports: metrics to `metrics.jsonl` and TensorBoard event files (process 0 only),
and the analytic FLOP count behind MFU.

FLOPs (`flops_per_token`): a matmul of an [n,a] by [a,b] costs 2·n·a·b. Per token, forward, with
D, H, G (key heads), K, F, V, L layers, S = cfg.steps, and N = the sequence length T (attention
is counted over the full T as in PaLM's MFU, not halved for causality):

  attention, tied:   keys 2·D·G·K per context + S × (query 2·D·H·K + scores 2·H·K·N
                     + p·k 2·H·K·N + output with Wqᵀ 2·H·K·D)
     DPLR adds per step a width-D head: scores 2·D·N per head (once if shared) + p·c 2·H·D·N
  attention, untied: keys and values 2·2·D·G·K per context + S × (query, scores, p·v, output)
  MLP, tied:         up 2·D·F per context + S × (gate 2·D·F + gateᵀ 2·D·F)
  MLP, untied:       up 2·D·F per context + S × (gate 2·D·F + down 2·F·D)
  contexts per sub-layer: 1, or S with recompute_context (keys, values and Wu c of every step)
  preconditioner "dplr": S × 2·2·D·r per sub-layer;  output head 2·D·V
  (norms, RoPE, softmax, activations and the embedding lookup are not counted)

Training = 3 × forward (the backward pass costs about twice the forward). MFU = FLOPs/token ×
tokens/s / peak FLOP/s of all devices.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary

from cem_jax.config import ModelConfig
from cem_jax.fileio import atomic_file

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
    contexts = S if cfg.recompute_context else 1
    if cfg.tie_attention:
        context = 2 * D * G * K
        if cfg.interaction == "dplr":
            per_step += 2 * D * N * (H if cfg.diagonal == "per_head" else 1) + 2 * H * D * N
    else:
        context = 2 * 2 * D * G * K
    attention = contexts * context + S * per_step
    mlp = contexts * 2 * D * F + S * 2 * (2 * D * F)
    precond = 2 * S * 2 * 2 * D * cfg.preconditioner_rank if cfg.preconditioner == "dplr" else 0
    forward = cfg.num_layers * (attention + mlp + precond) + 2 * D * V
    return float(forward * (3 if training else 1))


def matmul_peak_probe(n: int = 2048) -> tuple[Callable[[], jax.Array], float]:
    """A zero-argument jitted fp32 n×n matmul on the default device and its FLOPs (2·n³): the
    probe behind the measured CPU peak (benchmarks time it beside the train step)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    f = jax.jit(lambda x: x @ x)
    return lambda: f(a), 2.0 * n**3


def measure_matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of `matmul_peak_probe(n)`: the fastest of `repeats` calls after a warm-up call (a
    peak: other work on a shared machine only slows calls down)."""
    probe, flops = matmul_peak_probe(n)
    jax.block_until_ready(probe())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(probe())
        times.append(time.perf_counter() - start)
    return flops / min(times)


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
    """Append metric records to `run_dir/metrics.jsonl` and to a TensorBoard event file in
    `run_dir/tensorboard`; a no-op on processes other than 0.

    Records go to both files in the caller's thread (tensorboardX's `EventsWriter`, without the
    queue and thread of its `SummaryWriter`), so `flush` puts every record written so far into
    both: the loop flushes before each checkpoint, and a process killed after a checkpoint has
    logged every step it covers. The event file is created at the first record (a process
    that logs nothing leaves none).

    A run resumed from step N (`resume_step`; 0 for a new run) trains steps N+1, ... (again):
    the records of those steps that a killed process had logged are dropped from
    metrics.jsonl (rewritten atomically), and the new event file opens with TensorBoard's
    purge of steps > N (a `SessionLog.START` event at step N+1, as `SummaryWriter(purge_step=)`
    writes; TensorBoard applies it to the older files), so each step is shown once."""

    def __init__(self, run_dir: Path, resume_step: int = 0):
        self.active = jax.process_index() == 0
        self.tensorboard, self.resume_step = Path(run_dir) / "tensorboard", resume_step
        self.events: EventsWriter | None = None
        if self.active:
            path = Path(run_dir) / "metrics.jsonl"
            lines = path.read_bytes().splitlines(keepends=True) if path.is_file() else []
            kept = [line for line in lines if _logged_by(line, resume_step)]
            if kept != lines:
                with atomic_file(path) as f:
                    f.writelines(kept)
            self.jsonl = open(path, "a")  # noqa: SIM115

    def write(self, step: int, kind: str, values: dict[str, float]) -> None:
        """One record {"step", "kind" ("train"/"eval"), "time", **values}; TensorBoard tags
        are `kind/name`."""
        if not self.active:
            return
        record = {"step": step, "kind": kind, "time": time.time(),
                  **{k: float(v) for k, v in values.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.events is None:
            self.tensorboard.mkdir(exist_ok=True)
            # Its name: "events.out.tfevents.<s>.<host>.<ns>", in creation order within a second.
            self.events = EventsWriter(str(self.tensorboard / "events"), f".{time.time_ns()}")
            self.events.write_event(Event(step=self.resume_step + 1, session_log=SessionLog(
                status=SessionLog.START)))
        summary = Summary(value=[Summary.Value(tag=f"{kind}/{name}", simple_value=float(value))
                                 for name, value in values.items()])
        self.events.write_event(Event(wall_time=record["time"], step=step, summary=summary))

    def flush(self) -> None:
        """Hand every record written so far to the operating system (it outlives the process,
        SIGKILL included)."""
        if self.active:
            self.jsonl.flush()
            if self.events is not None:
                self.events.flush()

    def close(self) -> None:
        """Flush and close the files."""
        if self.active:
            self.jsonl.close()
            if self.events is not None:
                self.events.close()


def logged_records(run_dir: Path) -> list[dict]:
    """The whole records of `run_dir/metrics.jsonl` in order ([] without the file; a kill can
    tear the last line, which is left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_bytes().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if _logged_by(line, math.inf)]


def logged_values(run_dir: Path, step: int, kind: str) -> dict[str, float] | None:
    """The values of the last whole `kind` ("train"/"eval") record of `step` in
    `run_dir/metrics.jsonl` (without "step", "kind", "time"), or None if it holds none."""
    found = [r for r in logged_records(run_dir) if r["step"] == step and r.get("kind") == kind]
    return {k: v for k, v in found[-1].items() if k not in ("step", "kind", "time")} \
        if found else None


def _logged_by(line: bytes, step: float) -> bool:
    """Whether a metrics.jsonl line is a whole record of a step ≤ `step` (a kill can tear the
    last line)."""
    try:
        return json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
        return False
