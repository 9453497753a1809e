"""What a run reports: metrics to `metrics.jsonl`, TensorBoard event files and, when configured,
Weights & Biases (process 0 only), and the analytic FLOP count behind MFU.

FLOPs (`flops_per_token`): a matmul of an [n,a] by [a,b] costs 2·n·a·b. Per token, forward, with
D, F, V, L layers, S = cfg.steps, N = the sequence length T and r the preconditioner's rank:

  each sub-layer:    its kind's (per context, per step) FLOPs (`cem_jax.kinds.kind_flops`: the
                     built-in kinds' formulas, XLA's cost analysis for a kind without one)
                     × (contexts, S); contexts: 1, or S with recompute_context
  preconditioner "dplr": S × 2·2·D·r per sub-layer;  output head 2·D·V
  (norms, RoPE, softmax, activations and the embedding lookup are not counted)

Training = 3 × forward (the backward pass costs about twice the forward). MFU = FLOPs/token ×
tokens/s / peak FLOP/s of all devices.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary

from cem_jax.config import ModelConfig
from cem_jax.data import files
from cem_jax.data.storage_errors import storage_error
from cem_jax.kinds import kind_flops, model_kinds
from cem_jax.train_config import TrainConfig

# Peak dense bf16 FLOP/s per device, by whole words of `jax.Device.device_kind` (vendor
# sheets); the first name that matches wins, so a longer name precedes its prefix.
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6": 918e12, "H200": 989e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "L4": 121e12, "V100": 125e12}


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token of a forward pass (×3 when `training`), by the formula above."""
    S, D = cfg.steps, cfg.d_model
    contexts = S if cfg.recompute_context else 1
    layer = 2 * S * 2 * 2 * D * cfg.preconditioner_rank if cfg.preconditioner == "dplr" else 0
    for kind in model_kinds(cfg):
        per_context, per_step = kind_flops(kind, cfg, seq_len)
        layer += contexts * per_context + S * per_step
    forward = cfg.num_layers * layer + 2 * D * cfg.vocab_size
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
    """Append metric records to `run_dir/metrics.jsonl`, to a TensorBoard event file in
    `run_dir/tensorboard` and, given a `config` with `run.wandb_project`, to its W&B run
    (`open_wandb_run`); a no-op on processes other than 0. A context manager: leaving it
    closes it, the W&B run finished as failed when an exception leaves.

    Records go to both files in the caller's thread (tensorboardX's `EventsWriter`, without the
    queue and thread of its `SummaryWriter`), so `flush` puts every record written so far into
    both: the loop flushes before each checkpoint, and a process killed after a checkpoint has
    logged every step it covers. The event file is created at the first record (a process
    that logs nothing leaves none).

    On a bucket (`run_dir` a URL), which has no append: metrics.jsonl is rewritten whole at
    each `flush` (its lines are kept in memory), and the event file is written to a local
    temporary folder and uploaded whole at each `flush` (tensorboardX's own gs:// writer
    uploads the file again at every record). Each upload replaces the object at once, so a
    preemption loses at most the records since the last flush: those of steps after the last
    checkpoint, which the resumed run trains and logs again.

    A run resumed from step N (`resume_step`; 0 for a new run) trains steps N+1, ... (again):
    the records of those steps that a killed process had logged are dropped from
    metrics.jsonl (rewritten atomically; its "goodput" records are kept: `cem_jax.train.goodput`
    reads every launch's), and the new event file opens with TensorBoard's
    purge of steps > N (a `SessionLog.START` event at step N+1, as `SummaryWriter(purge_step=)`
    writes; TensorBoard applies it to the older files), so each step is shown once. W&B keeps
    them (see `open_wandb_run`)."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0,
                 config: TrainConfig | None = None):
        self.active = jax.process_index() == 0
        run_dir = str(run_dir)
        self.remote = files.is_url(run_dir)
        self.tensorboard, self.resume_step = files.join(run_dir, "tensorboard"), resume_step
        self.events: EventsWriter | None = None
        self.local_events: str | None = None  # on a bucket: the local folder of the event file
        self.wandb = None  # the W&B run
        if self.active:
            if config is not None and config.run.wandb_project is not None:
                self.wandb = open_wandb_run(config, run_dir, resume_step)
            self.path = files.join(run_dir, "metrics.jsonl")
            lines = files.read_bytes(self.path).splitlines(keepends=True) \
                if files.is_file(self.path) else []
            self.lines = [line for line in lines if _logged_by(line, resume_step)
                          or _kind(line) == "goodput"]
            if self.lines != lines:
                files.write_bytes(self.path, b"".join(self.lines))
            self.unflushed = False
            self.upload_failed = False  # on a bucket: an upload of `flush` failed
            if not self.remote:
                self.jsonl = open(self.path, "ab")  # noqa: SIM115

    def logged(self, kind: str) -> list[dict]:
        """The records of `kind` in metrics.jsonl, in order (process 0; [] on the others)."""
        if not self.active:
            return []
        return [json.loads(line) for line in self.lines if _kind(line) == kind]

    def write(self, step: int, kind: str, values: dict[str, float]) -> None:
        """One record {"step", "kind" ("train"/"eval"/"goodput"), "time", **values};
        TensorBoard tags and W&B keys are `kind/name`."""
        if not self.active:
            return
        record = {"step": step, "kind": kind, "time": time.time(),
                  **{k: float(v) for k, v in values.items()}}
        line = (json.dumps(record) + "\n").encode()
        if self.remote:
            self.lines.append(line)
            self.unflushed = True
        else:
            self.jsonl.write(line)
            self.jsonl.flush()
        if self.events is None:
            self._open_events()
        tagged = {f"{kind}/{name}": float(value) for name, value in values.items()}
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)
                                 for tag, value in tagged.items()])
        self.events.write_event(Event(wall_time=record["time"], step=step, summary=summary))
        if self.wandb is not None:
            self.wandb.log(tagged, step=step)

    def _open_events(self) -> None:
        # Its name: "events.out.tfevents.<s>.<host>.<ns>", in creation order within a second.
        if self.remote:
            self.local_events = tempfile.mkdtemp(prefix="cem_jax-tensorboard-")
        folder = self.local_events or self.tensorboard
        files.make_dirs(folder)
        self.events = EventsWriter(os.path.join(folder, "events"), f".{time.time_ns()}")
        self.events.write_event(Event(step=self.resume_step + 1, session_log=SessionLog(
            status=SessionLog.START)))

    def flush(self) -> None:
        """Hand every record written so far to the operating system (it outlives the process,
        SIGKILL included), or on a bucket upload both files whole."""
        if not self.active:
            return
        if self.events is not None:
            self.events.flush()
        if not self.remote:
            self.jsonl.flush()
        elif self.unflushed:
            try:
                files.write_bytes(self.path, b"".join(self.lines))
                for name in os.listdir(self.local_events) if self.local_events else []:
                    with open(os.path.join(self.local_events, name), "rb") as f:
                        files.write_bytes(files.join(self.tensorboard, name), f.read())
            except Exception:  # a stop (KeyboardInterrupt) is no failure: close uploads
                self.upload_failed = True
                raise
            self.unflushed = False

    def close(self, failed: bool = False, upload: bool = True) -> None:
        """Flush and close the files; finish the W&B run (exit code 1 if `failed`, 0 if not).
        On a bucket, the last upload is skipped when a `flush`'s upload failed or `upload` is
        False (leaving on a storage failure): another try would wait out gcsfs's retries again
        (~35 s or more) before the process can end, and what it would add is the records of
        steps after the newest checkpoint, which the resumed run logs again."""
        if not self.active:
            return
        try:
            if self.remote and (self.upload_failed or not upload):
                if self.events is not None:
                    self.events.flush()
            else:
                self.flush()
        finally:
            if not self.remote:
                self.jsonl.close()
            if self.events is not None:
                self.events.close()
            if self.local_events is not None:
                shutil.rmtree(self.local_events, ignore_errors=True)
            if self.wandb is not None:
                self.wandb.finish(exit_code=int(failed))

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 *_: Any) -> None:
        self.close(failed=kind is not None,
                   upload=error is None or storage_error(error) is None)


def open_wandb_run(config: TrainConfig, run_dir: str, resume_step: int) -> Any:
    """The Weights & Biases run (`wandb.init`'s `wandb.Run`) of `run_dir`, which `MetricsWriter`
    logs to on process 0: project `run.wandb_project`, entity `run.wandb_entity`, mode
    `run.wandb_mode` (offline: `wandb sync run_dir/wandb/offline-run-*`), its files in
    `run_dir/wandb` (a run directory on a bucket: in `wandb_files_dir`, a local folder, since
    W&B writes its files locally), named as the run directory, the config `config.to_dict()`
    (as config.yaml holds it). Raises ValueError when wandb is not installed, or when W&B
    refuses the login (no or a bad API key); a network that W&B cannot reach is its CommError
    (a crash: retried).

    Its id is kept in `run_dir/wandb_run_id`: a run resumed from a checkpoint (`resume_step` >
    0) continues the W&B run of that id (`resume="allow"`); a new run, or one started over from
    step 0, writes a new id. W&B ignores (with a warning) a record of a step below the last
    step the run logged, so when a killed process had logged steps after its last checkpoint,
    the W&B run keeps those first values of the steps the resumed run trains again, up to
    that last logged step (metrics.jsonl and TensorBoard show the new ones; W&B's rewind,
    `wandb.init(resume_from=...)`, a beta done by the server, is not used)."""
    try:
        import wandb
    except ImportError:
        raise ValueError(f"run.wandb_project = {config.run.wandb_project!r} needs wandb: pip "
                         "install 'cem_jax[wandb]' (or set run.wandb_project=null)") from None
    id_file = files.join(run_dir, "wandb_run_id")
    if resume_step and files.is_file(id_file):
        run_id = files.read_text(id_file).strip()
    else:
        run_id = secrets.token_hex(8)
        files.write_text(id_file, run_id)
    name = run_dir.rstrip("/").rsplit("/", 1)[-1] if files.is_url(run_dir) else \
        Path(run_dir).resolve().name
    try:
        return wandb.init(project=config.run.wandb_project, entity=config.run.wandb_entity,
                          mode=config.run.wandb_mode, dir=Path(wandb_files_dir(run_dir)), id=run_id,
                          name=name, resume="allow", config=config.to_dict())
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as err:
        raise ValueError(f"W&B cannot start (run.wandb_mode = {config.run.wandb_mode!r}): "
                         f"{str(err).rstrip('.')}; log in (wandb login, or WANDB_API_KEY), or "
                         f"set run.wandb_mode=offline") from None


def wandb_files_dir(run_dir: str) -> str:
    """Where W&B keeps its files for `run_dir`: the run directory itself, or for one on a
    bucket `$TMPDIR/cem_jax-wandb/<bucket>/<path>` on this machine."""
    if not files.is_url(run_dir):
        return run_dir
    folder = os.path.join(tempfile.gettempdir(), "cem_jax-wandb", run_dir.split("://", 1)[1])
    os.makedirs(folder, exist_ok=True)
    return folder


def logged_records(run_dir: str | Path) -> list[dict]:
    """The whole records of `run_dir/metrics.jsonl` in order ([] without the file; a kill can
    tear the last line, which is left out)."""
    path = files.join(str(run_dir), "metrics.jsonl")
    lines = files.read_bytes(path).splitlines() if files.is_file(path) else []
    return [json.loads(line) for line in lines if _logged_by(line, math.inf)]


def logged_values(run_dir: str | Path, step: int, kind: str) -> dict[str, float] | None:
    """The values of the last whole `kind` ("train"/"eval") record of `step` in
    `run_dir/metrics.jsonl` (without "step", "kind", "time"), or None if it holds none."""
    found = [r for r in logged_records(run_dir) if r["step"] == step and r.get("kind") == kind]
    return {k: v for k, v in found[-1].items() if k not in ("step", "kind", "time")} \
        if found else None


def _kind(line: bytes) -> str | None:
    """The kind of a whole metrics.jsonl record (None for a torn line)."""
    try:
        return json.loads(line).get("kind")
    except (ValueError, AttributeError):
        return None


def _logged_by(line: bytes, step: float) -> bool:
    """Whether a metrics.jsonl line is a whole record of a step ≤ `step` (a kill can tear the
    last line)."""
    try:
        return json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
        return False
