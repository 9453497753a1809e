"""`cem-train --dry-run --target NAME`: lower the train step for a TPU or GPU topology that this
host does not have (DESIGN.md §6, MaxText's `train_compile.py`): the target table, the abstract
mesh over its chips, and what the lowered module holds (per-device state bytes, shardings,
custom calls and whether each sits in a `shard_map`, an activation estimate against the chip's
memory)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh

from cem_jax.attention import attention_impl
from cem_jax.loss import chunk_length
from cem_jax.sharding import mesh_sizes
from cem_jax.train.sizing import (
    GIB,
    MIB,
    abstract_step,
    activation_estimate,
    check_batch_split,
    describe_model,
)
from cem_jax.train_config import MESH_AXES, SLICE_AXIS, TrainConfig


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


def lower_for_target(cfg: TrainConfig, target: Target, echo: Callable[[str], None] = print
                     ) -> dict[str, Any]:
    """Lower (never compile) one train step of `cfg` for `target`'s chips from this host and
    report it through `echo` (DESIGN.md §6). The mesh is the config's mesh section, a -1 axis
    taking the chips the others leave, as an `AbstractMesh` whose abstract device is the
    target's: the model traces for the target's platform (Pallas kernels for it, in a
    `shard_map`) and the step lowers for it. One process lowers for the whole topology, so
    `mesh.distributed` is not acted on.

    With `mesh.num_slices` > 1 (`--num-slices`) the topology is that many slices of the
    target, the data axis spanning them.

    Returns {"target", "params": counts by part, "mesh": {axis: size}, "devices", "slices",
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
    slices = cfg.mesh.num_slices
    chips = target.chips * slices
    of = f"{slices} slices of {target.name}" if slices > 1 else target.name
    try:
        sizes = mesh_sizes(cfg.mesh, chips)
    except ValueError as err:
        raise ValueError(f"--target {of} has {chips} chips: {err}") from None
    counts = describe_model(cfg, echo, (
        f"cem-train --dry-run --target {target.name}: lowering one train step for "
        f"{chips} x {kind} ({of}) from this host (lowered, not compiled: "
        f"there is no compiler for the target here; nothing is allocated, read or written)"))
    mesh = AbstractMesh(sizes, MESH_AXES, abstract_device=target.device)
    m = cfg.model
    with jax.sharding.use_abstract_mesh(mesh):
        core = attention_impl(m.impl, jnp.dtype(m.dtype), m.head_width,
                              tied=m.kinds[0] != "llama_attention")
    if core == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(f"--target {target.name}: model.impl={m.impl!r} runs cuDNN's flash "
                         f"attention there, which JAX traces only where a GPU and cuDNN are; "
                         f"lower on a GPU host, or check the rest of the step here with "
                         f"model.impl=pallas or xla")
    across = f"; {SLICE_AXIS} spans the slices" if slices > 1 else ""
    trainer, state, batch = abstract_step(
        cfg, mesh, echo, f"{chips} chips of {of} (device kind {kind!r}), "
        f"{cores} core{'s' * (cores > 1)} each{across}")
    start = time.perf_counter()
    lowered = trainer.train_step.trace(state, batch).lower(
        lowering_platforms=(LOWERING_PLATFORM[platform],))
    lower_s = time.perf_counter() - start
    echo(f"lowered the train step for {LOWERING_PLATFORM[platform]} in {lower_s:.1f} s")

    state_bytes, shardings = _report_state(state, echo)
    calls = custom_calls(lowered.compiler_ir("stablehlo"))
    _report_calls(calls, echo)
    act = activation_estimate(cfg.model, mesh, check_batch_split(cfg, mesh), cfg.data.seq_len)
    share = _report_memory(cfg, target, state_bytes, act, echo)
    return {"target": target, "params": counts, "mesh": dict(mesh.shape),
            "devices": chips, "slices": slices, "batch_rows": cfg.data.batch_size,
            "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len, "lower_s": lower_s,
            "bytes_per_device": state_bytes, "shardings": shardings, "custom_calls": calls,
            "activations_estimate": act["total"], "memory_share_estimate": share}


def _report_state(state, echo: Callable[[str], None]) -> tuple[dict[str, int], dict]:
    """Say and return the per-device bytes of the parameters and the optimizer state (exact,
    from their shardings) and each parameter's sharding (layers as *)."""
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
    return state_bytes, shardings


def _report_calls(calls: dict[str, dict[str, Any]], echo: Callable[[str], None]) -> None:
    """Say the lowered module's custom calls (`custom_calls`) and where their kernels sit."""
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


def _report_memory(cfg: TrainConfig, target: Target, state_bytes: dict[str, int],
                   act: dict[str, int], echo: Callable[[str], None]) -> float:
    """Say the activation estimate and the estimated memory per device against the chip's;
    return that share (parameters, their gradients, optimizer state and activations)."""
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
    return share


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of a pytree of sharded `jax.ShapeDtypeStruct`s."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def _shape(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


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
