"""How big a train step is, before anything runs: the parameter count by part (checked against
a config's `expected_params`), the batch's split over the mesh, an analytic estimate of the
activations per device, and whether the step can fit in the device's memory at all. Shared by
`cem-train` (its first checks), `--dry-run` and `--target` (`cem_jax.train.dry_run`,
`cem_jax.train.targets`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from cem_jax.config import ModelConfig
from cem_jax.loss import chunk_length
from cem_jax.memory import check_fits
from cem_jax.model import param_counts
from cem_jax.sharding import (
    batch_sharding,
    logical_to_mesh,
)
from cem_jax.train.step import TRAIN_KEYS, Trainer
from cem_jax.train_config import BATCH_AXES, PARAM_AXES, TrainConfig

GIB = 2**30
MIB = 2**20
PARTS = ("embedding", "attention", "mlp", "norm", "preconditioner", "head")


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
    split = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if rows % split:
        raise ValueError(f"a micro-batch of {rows} rows (data.batch_size / optimizer."
                         f"accumulation_steps) cannot be split over {'×'.join(BATCH_AXES)} = "
                         f"{split} devices")
    return rows


def check_fits_in_memory(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> None:
    """Raise `cem_jax.memory.DoesNotFit` (a ValueError) when a lower bound of one train step's
    memory per device exceeds the device's (`cem_jax.memory.device_memory_bytes`): the
    parameters, their gradients and Adam's two moments (4 x the parameter bytes, split over
    fsdp x tensor) and `activation_estimate`. A model that cannot fit is refused in one line
    before anything is written, instead of an out-of-memory traceback after."""
    count = param_counts(cfg.model)["total"]
    params = count * jnp.dtype(cfg.model.param_dtype).itemsize
    state = 4 * params // math.prod(mesh.shape[a] for a in PARAM_AXES)
    act = activation_estimate(cfg.model, mesh, check_batch_split(cfg, mesh), cfg.data.seq_len)
    remat = "" if cfg.model.remat == "full" else ", set model.remat=full"
    check_fits(state + act["total"], f"a train step of this {count:,}-parameter model "
               f"(parameters, gradients, optimizer state: {state / 1e9:,.1f} GB per device; "
               f"activations {act['total'] / 1e9:,.1f} GB)",
               f"make the model smaller (model.d_model, model.mlp_dim, model.num_layers), split "
               f"it over more devices (mesh.fsdp), or lower data.batch_size{remat} "
               f"(`cem-train --dry-run` sizes a config without running it)")


def describe_model(cfg: TrainConfig, say: Callable[[str], None], title: str
                    ) -> dict[str, int]:
    """Say `title`, the model's shape and its parameter counts (checked against
    `expected_params`); return the counts."""
    m = cfg.model
    say(title)
    say(f"model: L={m.num_layers} D={m.d_model} H={m.num_heads} G={m.kv_heads} "
        f"K={m.head_width} F={m.mlp_dim} V={m.vocab_size}; kinds={'+'.join(m.kinds)} "
        f"preconditioner={m.preconditioner} "
        f"steps={m.steps}; dtype={m.dtype} param_dtype={m.param_dtype} remat={m.remat} "
        f"impl={m.impl}")
    counts = check_expected_params(cfg)
    stated = "" if cfg.expected_params is None else \
        f" (expected_params {cfg.expected_params:,}: matches)"
    say(f"parameters: {describe_counts(counts)}{stated}")
    return counts


def abstract_step(cfg: TrainConfig, mesh, say: Callable[[str], None], devices: str):
    """Say the mesh (`devices` describes them) and the batch; return (`Trainer` on `mesh`, its
    abstract train state, an abstract int32 [B,T] batch) for lowering the train step.
    Raises ValueError when the batch does not split over the mesh."""
    rows = check_batch_split(cfg, mesh)
    B, T, A = cfg.data.batch_size, cfg.data.seq_len, cfg.optimizer.accumulation_steps
    shape = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    say(f"mesh: {shape} ({devices})")
    split = math.prod(mesh.shape[a] for a in BATCH_AXES)
    say(f"global batch: {B} rows x {T} tokens = {B * T:,} tokens per step ({A} micro-batch"
        f"{'es' if A > 1 else ''} of {rows} rows; {rows // split} rows per device)")
    trainer = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, mesh)
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding(mesh))
             for k in TRAIN_KEYS}
    return trainer, trainer.abstract_state(), batch


def activation_estimate(m: ModelConfig, mesh, rows: int, seq_len: int) -> dict[str, int]:
    """Analytic activation bytes per device of a train step on `mesh` (a `Mesh` or
    `AbstractMesh`) for micro-batches of `rows` rows (all devices together) of `seq_len`
    tokens: {"block_inputs": L x the residual stream [B,T,D] in m.dtype (what each block keeps
    for its backward; all a remat="full" block keeps), "loss": what the chunked cross entropy
    holds (`cem_jax.loss`): one chunk's fp32 logits [B,c,V] (c = ⌈T / loss_chunks⌉) and their
    gradient, the gradient of the hidden states [B,T,D] in m.dtype and the head's fp32 [D,V],
    "total"}, each
    split as the model pins it (`cem_jax.sharding.constrain`: B over "batch", V over "vocab",
    D of the head over "embed"). An estimate, not a measurement: it leaves out one block's
    recomputed intermediates, and fusion decides the rest."""
    def local(logical, shape):  # elements of one device's shard
        spec = logical_to_mesh(logical, shape, mesh.shape)
        return math.prod(NamedSharding(mesh, spec).shard_shape(shape))

    itemsize = jnp.dtype(m.dtype).itemsize
    residual = local(("batch", "length", None), (rows, seq_len, m.d_model))
    block_inputs = m.num_layers * residual * itemsize
    chunk = chunk_length(seq_len, m.loss_chunks)
    loss = (2 * local(("batch", "length", "vocab"), (rows, chunk, m.vocab_size)) * 4
            + residual * itemsize + local(("embed", "vocab"), (m.d_model, m.vocab_size)) * 4)
    return {"block_inputs": block_inputs, "loss": loss, "total": block_inputs + loss}


def compiled_memory(compiled) -> dict[str, int] | None:
    """Per-device bytes of a compiled executable (`Compiled.memory_analysis()`): {"arguments",
    "outputs", "aliased" (donated buffers reused for outputs), "temp", "code", "total" =
    arguments + outputs - aliased + temp + code, the step's peak}; None when the backend gives
    no memory analysis. Shared by `--dry-run` on this host's devices and on a `--target`."""
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


def compiler_flops(compiled) -> float | None:
    """XLA's FLOP count of the (per-device) executable (`cost_analysis()`; a loop's body is
    counted once), or None."""
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None and math.isfinite(flops) and flops > 0 else None
