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

`--target NAME` (`cem-train --dry-run --target tpu-v5p-32`) lowers the step for a TPU or GPU
topology that this host does not have (`TARGETS`; DESIGN.md §6, MaxText's `train_compile.py`):
the mesh is an `AbstractMesh` over the target's chips whose abstract device carries the target's
platform and device kind, so the Pallas kernels lower for it (Mosaic `tpu_custom_call`s, Triton
calls on a GPU). It lowers only (no compiler for the target here) and prints the per-device
bytes of the parameters and the optimizer state (exact: from their shardings), the parameters'
shardings, the custom calls of the lowered module (and whether each sits in a `shard_map`,
which XLA needs to partition a kernel), activation memory as an analytic estimate, and the sum
of these against the chip's memory (its vendor sheet's). A real device still has to compile it
(Mosaic's own checks, VMEM limits), time it and measure memory.

`check_expected_params` is also what `cem-train` runs first when a config states
`expected_params`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding

from cem_jax.attention import attention_impl
from cem_jax.config import ModelConfig
from cem_jax.loss import chunk_length
from cem_jax.memory import check_fits
from cem_jax.model import param_counts
from cem_jax.sharding import (
    MESH_AXES,
    batch_sharding,
    logical_to_mesh,
    make_mesh,
    mesh_sizes,
)
from cem_jax.train.config import TrainConfig
from cem_jax.train.metrics import flops_per_token
from cem_jax.train.step import TRAIN_KEYS, Trainer

GIB = 2**30
MIB = 2**20
PARTS = ("embedding", "attention", "mlp", "norm", "preconditioner", "head")


class Family(NamedTuple):
    """A kind of accelerator a `--target` names: `device_kind` and `platform` as its JAX
    devices report them, `cores` per chip (TensorCores; a GPU's streaming multiprocessors), and
    whether the name's number counts cores (Cloud TPU v4 and v5p: `v5p-32` is 16 chips) or
    chips (every other name). One JAX device per chip (v4 and v5p in megacore mode).
    `memory_gb`: the chip's HBM as its vendor sheet states it (GB)."""

    device_kind: str
    platform: str
    cores: int
    name_counts_cores: bool
    memory_gb: float


# `--target {family}-{N}`: Cloud TPU's accelerator types with a "tpu-" prefix, GPUs by model.
TARGETS = {
    "tpu-v4": Family("TPU v4", "tpu", 2, True, 32),
    "tpu-v5p": Family("TPU v5", "tpu", 2, True, 95),
    "tpu-v5litepod": Family("TPU v5 lite", "tpu", 1, False, 16),
    "tpu-v6e": Family("TPU v6 lite", "tpu", 1, False, 32),
    "gpu-h100": Family("NVIDIA H100 80GB HBM3", "gpu", 132, False, 80),
    "gpu-h200": Family("NVIDIA H200", "gpu", 132, False, 141),
}
# The platform name `lower(lowering_platforms=...)` takes for a device platform.
LOWERING_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}


class Target(NamedTuple):
    """A parsed `--target`: its name, chips (JAX devices), the abstract device of each and its
    memory (GB, vendor sheet)."""

    name: str
    chips: int
    device: AbstractDevice
    memory_gb: float


def parse_target(name: str) -> Target:
    """`Target` of a name such as "tpu-v5p-32" (16 chips), "tpu-v6e-16" or "gpu-h200-8".
    Raises ValueError for an unknown family or a count that is not a positive number of chips,
    naming the known families."""
    match = re.fullmatch(r"(.+)-(\d+)", name)
    family = TARGETS.get(match[1]) if match else None
    known = ", ".join(f"{f}-N" for f in TARGETS)
    if family is None:
        raise ValueError(f"unknown --target {name!r}: use one of {known} (e.g. tpu-v5p-32, "
                         f"tpu-v6e-16, gpu-h200-8)")
    count, per_chip = int(match[2]), family.cores if family.name_counts_cores else 1
    if count < 1 or count % per_chip:
        unit = f"TensorCores, {per_chip} per chip" if per_chip > 1 else "chips"
        raise ValueError(f"--target {name!r}: {match[1]}-N counts {unit}, so N must be a "
                         f"positive multiple of {per_chip}")
    return Target(name, count // per_chip,
                  AbstractDevice(device_kind=family.device_kind, num_cores=family.cores,
                                 platform=family.platform), family.memory_gb)


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


def check_fits_in_memory(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> None:
    """Raise `cem_jax.memory.DoesNotFit` (a ValueError) when a lower bound of one train step's
    memory per device exceeds the device's (`cem_jax.memory.device_memory_bytes`): the
    parameters, their gradients and Adam's two moments (4 x the parameter bytes, split over
    fsdp x tensor) and `activation_estimate`. A model that cannot fit is refused in one line
    before anything is written, instead of an out-of-memory traceback after."""
    count = param_counts(cfg.model)["total"]
    params = count * jnp.dtype(cfg.model.param_dtype).itemsize
    state = 4 * params // (mesh.shape["fsdp"] * mesh.shape["tensor"])
    act = activation_estimate(cfg.model, mesh, check_batch_split(cfg, mesh), cfg.data.seq_len)
    remat = "" if cfg.model.remat == "full" else ", set model.remat=full"
    check_fits(state + act["total"], f"a train step of this {count:,}-parameter model "
               f"(parameters, gradients, optimizer state: {state / 1e9:,.1f} GB per device; "
               f"activations {act['total'] / 1e9:,.1f} GB)",
               f"make the model smaller (model.d_model, model.mlp_dim, model.num_layers), split "
               f"it over more devices (mesh.fsdp), or lower data.batch_size{remat} "
               f"(`cem-train --dry-run` sizes a config without running it)")


def dry_run(cfg: TrainConfig, echo: Callable[[str], None] = print,
            target: str | None = None) -> dict[str, Any]:
    """Compile one train step of `cfg` on its mesh without data or parameters and report
    (through `echo`, process 0 only) what it needs; with `target` (a `parse_target` name),
    lower it for that topology instead (`lower_for_target`).

    Returns {"params": counts by part, "mesh": {axis: size}, "devices", "batch_rows",
    "tokens_per_step", "compile_s", "memory": {"arguments", "outputs", "aliased", "temp",
    "code", "total"} in bytes per device (None if the backend gives no memory analysis),
    "flops": {"analytic_per_step", "analytic_per_device", "xla_per_device" (None if not
    given)}}. Raises ValueError (expected_params mismatch, batch not divisible by the mesh,
    an unknown target or one whose chips the mesh section does not fit).
    """
    if target is not None:
        return lower_for_target(cfg, parse_target(target), echo)
    if cfg.mesh.distributed:
        jax.distributed.initialize(cfg.mesh.coordinator_address, cfg.mesh.num_processes,
                                   cfg.mesh.process_id)
    say = echo if jax.process_index() == 0 else (lambda _: None)
    m = cfg.model
    counts = _describe_model(cfg, say, "cem-train --dry-run: compiling one train step on "
                             "abstract inputs (nothing is allocated, read or written)")
    mesh = make_mesh(cfg.mesh)
    devices = mesh.devices.size
    processes = f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''}"
    trainer, state, batch = _abstract_step(
        cfg, mesh, say, f"{devices} {jax.devices()[0].platform} devices, {processes}")
    B, T = cfg.data.batch_size, cfg.data.seq_len
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


def _describe_model(cfg: TrainConfig, say: Callable[[str], None], title: str
                    ) -> dict[str, int]:
    """Say `title`, the model's shape and its parameter counts (checked against
    `expected_params`); return the counts."""
    m = cfg.model
    say(title)
    say(f"model: L={m.num_layers} D={m.d_model} H={m.num_heads} G={m.kv_heads} "
        f"K={m.head_width} F={m.mlp_dim} V={m.vocab_size}; tie_attention={m.tie_attention} "
        f"tie_mlp={m.tie_mlp} interaction={m.interaction} preconditioner={m.preconditioner} "
        f"steps={m.steps}; dtype={m.dtype} param_dtype={m.param_dtype} remat={m.remat} "
        f"impl={m.impl}")
    counts = check_expected_params(cfg)
    stated = "" if cfg.expected_params is None else \
        f" (expected_params {cfg.expected_params:,}: matches)"
    say(f"parameters: {describe_counts(counts)}{stated}")
    return counts


def _abstract_step(cfg: TrainConfig, mesh, say: Callable[[str], None], devices: str):
    """Say the mesh (`devices` describes them) and the batch; return (`Trainer` on `mesh`, its
    abstract train state, an abstract int32 [B,T] batch) for lowering the train step.
    Raises ValueError when the batch does not split over the mesh."""
    rows = check_batch_split(cfg, mesh)
    B, T, A = cfg.data.batch_size, cfg.data.seq_len, cfg.optimizer.accumulation_steps
    shape = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    say(f"mesh: {shape} ({devices})")
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    say(f"global batch: {B} rows x {T} tokens = {B * T:,} tokens per step ({A} micro-batch"
        f"{'es' if A > 1 else ''} of {rows} rows; {rows // split} rows per device)")
    trainer = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, mesh)
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding(mesh))
             for k in TRAIN_KEYS}
    return trainer, trainer.abstract_state(), batch


def lower_for_target(cfg: TrainConfig, target: Target, echo: Callable[[str], None] = print
                     ) -> dict[str, Any]:
    """Lower (never compile) one train step of `cfg` for `target`'s chips from this host and
    report it through `echo` (DESIGN.md §6). The mesh is the config's mesh section, a -1 axis
    taking the chips the others leave, as an `AbstractMesh` whose abstract device is the
    target's: the model traces for the target's platform (Pallas kernels for it, in a
    `shard_map`) and the step lowers for it. One process lowers for the whole topology, so
    `mesh.distributed` is not acted on.

    Returns {"target", "params": counts by part, "mesh": {axis: size}, "devices",
    "batch_rows", "tokens_per_step", "lower_s", "bytes_per_device": {"params", "opt_state"}
    (exact, from the shardings), "shardings": {parameter path (layers as *): PartitionSpec},
    "custom_calls": `custom_calls` of the lowered module, "activations_estimate": bytes per
    device (`activation_estimate`, analytic), "memory_share_estimate": parameters, gradients,
    optimizer state and activations over the chip's memory}. Raises ValueError (as `dry_run`;
    the message names the target when its chip count does not fit the mesh section; cuDNN
    attention, which traces only beside a GPU, off one).
    """
    kind, platform, cores = target.device.device_kind, target.device.platform, \
        target.device.num_cores
    try:
        sizes = mesh_sizes(cfg.mesh, target.chips)
    except ValueError as err:
        raise ValueError(f"--target {target.name} has {target.chips} chips: {err}") from None
    counts = _describe_model(cfg, echo, (
        f"cem-train --dry-run --target {target.name}: lowering one train step for "
        f"{target.chips} x {kind} ({target.name}) from this host (lowered, not compiled: "
        f"there is no compiler for the target here; nothing is allocated, read or written)"))
    mesh = AbstractMesh(sizes, MESH_AXES, abstract_device=target.device)
    m = cfg.model
    with jax.sharding.use_abstract_mesh(mesh):
        core = attention_impl(m.impl, jnp.dtype(m.dtype), m.head_width, tied=m.tie_attention)
    if core == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(f"--target {target.name}: model.impl={m.impl!r} runs cuDNN's flash "
                         f"attention there, which JAX traces only where a GPU and cuDNN are; "
                         f"lower on a GPU host, or check the rest of the step here with "
                         f"model.impl=pallas or xla")
    trainer, state, batch = _abstract_step(
        cfg, mesh, echo, f"{target.chips} chips of {target.name} (device kind {kind!r}), "
        f"{cores} core{'s' * (cores > 1)} each")
    start = time.perf_counter()
    lowered = trainer.train_step.trace(state, batch).lower(
        lowering_platforms=(LOWERING_PLATFORM[platform],))
    lower_s = time.perf_counter() - start
    echo(f"lowered the train step for {LOWERING_PLATFORM[platform]} in {lower_s:.1f} s")

    state_bytes = {k: _bytes_per_device(state[k]) for k in ("params", "opt_state")}
    echo(f"per device (exact, from the shardings): parameters {state_bytes['params'] / MIB:.1f}"
         f" MiB, optimizer state {state_bytes['opt_state'] / MIB:.1f} MiB")
    echo("parameter shardings (global shape -> per-device shape):")
    shardings = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
        name = re.sub(r"/\d+(?=/|$)", "/*", "/".join(str(k.key) for k in path))
        if name not in shardings:
            shardings[name] = leaf.sharding.spec
            echo(f"  {name} {_shape(leaf.shape)} {leaf.dtype} {leaf.sharding.spec!r} -> "
                 f"{_shape(leaf.sharding.shard_shape(leaf.shape))}")

    calls = custom_calls(lowered.compiler_ir("stablehlo"))
    for call_target, info in sorted(calls.items()):
        kernels = ", ".join(f"{k} x{n}" for k, n in sorted(info["kernels"].items()))
        where = "" if not info["kernels"] else (
            ", all inside shard_map" if not info["outside_shard_map"] else
            f", {info['outside_shard_map']} OUTSIDE shard_map (XLA cannot partition a "
            f"kernel: this step fails to compile on more than one device)")
        echo(f"custom calls: {call_target} x{info['calls']}"
             + (f" ({len(info['kernels'])} kernels: {kernels}{where})" if kernels else ""))
    if not calls:
        echo("custom calls: none (no Pallas kernel in this step; model.impl=pallas puts the "
             "tied attention in one)")

    act = activation_estimate(cfg.model, mesh, check_batch_split(cfg, mesh), cfg.data.seq_len)
    bound = " (a lower bound with remat=none: every block's intermediates stay too)" \
        if cfg.model.remat == "none" else ""
    echo(f"activations per device, ESTIMATE (analytic, not measured){bound}: "
         f"{act['total'] / GIB:.2f} GiB = block inputs kept for the backward "
         f"{act['block_inputs'] / GIB:.2f} GiB + the loss (fp32 logits of "
         f"{chunk_length(cfg.data.seq_len, cfg.model.loss_chunks)} positions at a time and their "
         f"gradient, the gradients of the hidden states and the head) "
         f"{act['loss'] / GIB:.2f} GiB; one block's recomputed intermediates come on top, "
         f"and the real peak is the target compiler's (fusion, buffer assignment), which only "
         f"a compile on the target gives")
    need = 2 * state_bytes["params"] + state_bytes["opt_state"] + act["total"]
    share = need / (target.memory_gb * 1e9)
    remat = "" if cfg.model.remat == "full" else " or set model.remat=full"
    verdict = (" (fits, by this estimate)" if share <= 0.9 else
               " (TIGHT: the compiler's real peak may not fit)" if share <= 1 else
               f" (does NOT fit: raise mesh.fsdp, lower data.batch_size, raise "
               f"optimizer.accumulation_steps{remat})")
    echo(f"memory per device, ESTIMATE: parameters, their gradients, optimizer state and "
         f"activations {need / 1e9:.1f} GB of the chip's {target.memory_gb:g} GB "
         f"(vendor sheet), {share:.0%}{verdict}")
    return {"target": target, "params": counts, "mesh": dict(mesh.shape),
            "devices": target.chips, "batch_rows": cfg.data.batch_size,
            "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len, "lower_s": lower_s,
            "bytes_per_device": state_bytes, "shardings": shardings, "custom_calls": calls,
            "activations_estimate": act["total"], "memory_share_estimate": share}


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of a pytree of sharded `jax.ShapeDtypeStruct`s."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def _shape(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


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


def custom_calls(module) -> dict[str, dict[str, Any]]:
    """The custom calls of a lowered StableHLO module (`Lowered.compiler_ir("stablehlo")`):
    {call target: {"calls": count, "kernels": {kernel name: count} (Mosaic's `kernel_name`,
    Triton's backend_config "name"; calls without one are not listed), "outside_shard_map":
    calls of named kernels not nested in an `sdy.manual_computation` (a `shard_map` body, as
    JAX lowers it with Shardy: inline, not as a called function)}}."""
    from jax._src.lib.mlir import ir  # the MLIR bindings JAX lowers with (no public path)

    found: dict[str, dict[str, Any]] = {}

    def visit(op, manual: bool):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call":
                        attrs = child.attributes
                        entry = found.setdefault(ir.StringAttr(attrs["call_target_name"]).value,
                                                 {"calls": 0, "kernels": {},
                                                  "outside_shard_map": 0})
                        entry["calls"] += 1
                        kernel = _kernel_name(attrs, ir)
                        if kernel is not None:
                            entry["kernels"][kernel] = entry["kernels"].get(kernel, 0) + 1
                            entry["outside_shard_map"] += not manual
                    visit(child, manual or child.name == "sdy.manual_computation")

    visit(module.operation, False)
    return found


def _kernel_name(attrs, ir) -> str | None:
    if "kernel_name" in attrs:  # Mosaic TPU
        return ir.StringAttr(attrs["kernel_name"]).value
    config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else None
    if isinstance(config, ir.DictAttr) and "name" in config:  # Triton: the kernel's "name"
        return ir.StringAttr(config["name"]).value
    return None


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
