"""`cem-train --dry-run`: size a run before paying for it.

Builds the mesh and compiles the real train step (`Trainer.train_step`, with its shardings)
for abstract inputs: the train state comes from `jax.eval_shape` and the batch is a
`jax.ShapeDtypeStruct`, so no parameter is allocated, no data file, tokenizer or run directory
is read or written (the vocabulary is the model config's). It prints the parameter count by
part, the mesh, the global batch, the per-device memory of the compiled executable
(`memory_analysis()`: arguments, outputs, donated/aliased, temporaries) and the FLOPs of one
step (the analytic count of `cem_jax.train.metrics.flops_per_token`, and XLA's
`cost_analysis()`).

To size a pod from one machine, give the host as many CPU devices as the pod has chips
(`XLA_FLAGS=--xla_force_host_platform_device_count=N JAX_PLATFORMS=cpu`): the shardings, and so
the per-device argument bytes, are the pod's; temporaries are the CPU compiler's estimate
(fusion and layouts differ on TPU/GPU).

`check_expected_params` is also what `cem-train` runs first when a config states
`expected_params`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.model import CEMTransformer, count_params
from cem_jax.train.config import TrainConfig
from cem_jax.train.metrics import flops_per_token
from cem_jax.train.sharding import batch_sharding, make_mesh
from cem_jax.train.step import TRAIN_KEYS, Trainer

GIB = 2**30
PARTS = ("embedding", "attention", "mlp", "norm", "preconditioner", "head")


def param_counts(model_cfg: ModelConfig) -> dict[str, int]:
    """`count_params` of the model of `model_cfg`, built abstractly (`nnx.eval_shape`: shapes
    only, nothing allocated, so a 100M model costs a second)."""
    return count_params(nnx.eval_shape(lambda: CEMTransformer(model_cfg, rngs=nnx.Rngs(0))))


def describe_counts(counts: dict[str, int]) -> str:
    """'77,091,073 = embedding 25,165,824 + attention ...' (parts present, in `PARTS` order)."""
    parts = " + ".join(f"{p} {counts[p]:,}" for p in PARTS if counts.get(p))
    return f"{counts['total']:,} = {parts}"


def check_expected_params(cfg: TrainConfig) -> dict[str, int]:
    """The model's parameter counts by part; raises ValueError naming both numbers when
    `cfg.expected_params` is set and differs from the total."""
    counts = param_counts(cfg.model)
    if cfg.expected_params is not None and cfg.expected_params != counts["total"]:
        raise ValueError(
            f"expected_params = {cfg.expected_params:,} but the model section builds "
            f"{counts['total']:,} parameters ({describe_counts(counts)}); if the model was "
            f"changed on purpose, set expected_params: {counts['total']} in the config (or "
            f"override expected_params={counts['total']}, or expected_params=null to skip the "
            f"check), else restore the model section")
    return counts


def check_batch_split(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> int:
    """Rows of one micro-batch (data.batch_size / optimizer.accumulation_steps); raises
    ValueError when they cannot be split evenly over the data×fsdp devices."""
    rows = cfg.data.batch_size // cfg.optimizer.accumulation_steps
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % split:
        raise ValueError(f"a micro-batch of {rows} rows (data.batch_size / optimizer."
                         f"accumulation_steps) cannot be split over data×fsdp = {split} devices")
    return rows


def dry_run(cfg: TrainConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Compile one train step of `cfg` on its mesh without data or parameters and report
    (through `echo`, process 0 only) what it needs.

    Returns {"params": counts by part, "mesh": {axis: size}, "devices", "batch_rows",
    "tokens_per_step", "compile_s", "memory": {"arguments", "outputs", "aliased", "temp",
    "code", "total"} in bytes per device (None if the backend gives no memory analysis),
    "flops": {"analytic_per_step", "analytic_per_device", "xla_per_device" (None if not
    given)}}. Raises ValueError (expected_params mismatch, batch not divisible by the mesh).
    """
    if cfg.mesh.distributed:
        jax.distributed.initialize(cfg.mesh.coordinator_address, cfg.mesh.num_processes,
                                   cfg.mesh.process_id)
    say = echo if jax.process_index() == 0 else (lambda _: None)
    m = cfg.model
    say("cem-train --dry-run: compiling one train step on abstract inputs (nothing is "
        "allocated, read or written)")
    say(f"model: L={m.num_layers} D={m.d_model} H={m.num_heads} G={m.kv_heads} "
        f"K={m.head_width} F={m.mlp_dim} V={m.vocab_size}; tie_attention={m.tie_attention} "
        f"tie_mlp={m.tie_mlp} interaction={m.interaction} preconditioner={m.preconditioner} "
        f"steps={m.steps}; dtype={m.dtype} param_dtype={m.param_dtype} remat={m.remat}")
    counts = check_expected_params(cfg)
    stated = "" if cfg.expected_params is None else \
        f" (expected_params {cfg.expected_params:,}: matches)"
    say(f"parameters: {describe_counts(counts)}{stated}")

    mesh = make_mesh(cfg.mesh)
    devices = mesh.devices.size
    rows = check_batch_split(cfg, mesh)
    B, T, A = cfg.data.batch_size, cfg.data.seq_len, cfg.optimizer.accumulation_steps
    shape = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    say(f"mesh: {shape} ({devices} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''})")
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    say(f"global batch: {B} rows x {T} tokens = {B * T:,} tokens per step ({A} micro-batch"
        f"{'es' if A > 1 else ''} of {rows} rows; {rows // split} rows per device)")

    trainer = Trainer(m, cfg.optimizer, cfg.run.steps, mesh)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding(mesh))
             for k in TRAIN_KEYS}
    start = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    say(f"compiled the train step in {compile_s:.1f} s")

    memory = _memory(compiled)
    if memory is None:
        say("memory per device: not reported by this backend")
    else:
        say("memory per device: " + ", ".join(
            f"{k} {memory[k] / GIB:.4f} GiB" for k in ("arguments", "outputs", "aliased",
                                                       "temp", "code", "total")))
    per_token = flops_per_token(m, T)
    analytic = per_token * B * T
    xla = _xla_flops(compiled)
    say(f"FLOPs per step (analytic, train = 3 x forward): {analytic:.4g} = "
        f"{per_token / 1e9:.4g} GFLOPs/token x {B * T:,} tokens; {analytic / devices:.4g} per "
        f"device")
    note = (f" (XLA counts the layer scan's body once: with model.scan_layers=true this leaves "
            f"out {m.num_layers - 1} of the {m.num_layers} layers)") if m.scan_layers else ""
    say("FLOPs per step per device (XLA cost_analysis): "
        + ("not reported by this backend" if xla is None else f"{xla:.4g}{note}"))
    return {"params": counts, "mesh": dict(mesh.shape), "devices": devices, "batch_rows": B,
            "tokens_per_step": B * T, "compile_s": compile_s, "memory": memory,
            "flops": {"analytic_per_step": analytic, "analytic_per_device": analytic / devices,
                      "xla_per_device": xla}}


def _memory(compiled) -> dict[str, int] | None:
    """Per-device bytes of a compiled executable; total = arguments + outputs - aliased
    (donated buffers reused for outputs) + temp + code."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    if stats is None:
        return None
    mem = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
           "aliased": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes,
           "code": stats.generated_code_size_in_bytes}
    mem["total"] = mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temp"] + mem["code"]
    return {k: int(v) for k, v in mem.items()}


def _xla_flops(compiled) -> float | None:
    """XLA's FLOP count of the (per-device) executable, or None."""
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None and math.isfinite(flops) and flops > 0 else None
