"""`cem-train --dry-run --target NAME`: the train step for a TPU or GPU topology that this host
does not have (DESIGN.md §6, MaxText's `train_compile.py`): the target table, the mesh over its
chips, and what the step on them holds.

For a TPU target with libtpu importable (the `tpu` extra, and `.[dev]`), the step is
**compiled** by the TPU compiler on this host: the mesh is over the devices of the target's
real topology (`jax.experimental.topologies`, N slices of it with `mesh.num_slices`), and the
compiler's own figures are reported: memory per chip and its peak against the chip's HBM
(which decides: a step over the chip is refused, `cem_jax.memory.DoesNotFit`), the
collectives per chip per step inside a slice (ICI) and across slices (DCN), the Mosaic kernels
and their scoped VMEM (`cem_jax.train.hlo`), the compiler's FLOPs. Otherwise (no libtpu, or a
GPU target) it is **lowered** for an `AbstractMesh` whose abstract device carries the target's
platform and device kind, and the memory is an analytic estimate.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh

from cem_jax.attention import attention_impl
from cem_jax.loss import chunk_length
from cem_jax.memory import DoesNotFit, is_out_of_memory
from cem_jax.sharding import make_mesh, mesh_sizes
from cem_jax.train import hlo
from cem_jax.train.metrics import flops_per_token
from cem_jax.train.sizing import (
    GIB,
    MIB,
    abstract_step,
    activation_estimate,
    check_batch_split,
    compiled_memory,
    compiler_flops,
    describe_model,
)
from cem_jax.train_config import MESH_AXES, SLICE_AXIS, TrainConfig


class Family(NamedTuple):
    """A kind of accelerator a `--target` names: `device_kind` and `platform` as its JAX
    devices report them, `cores` per chip (TensorCores; a GPU's streaming multiprocessors), and
    whether the name's number counts cores (Cloud TPU v4 and v5p: `v5p-32` is 16 chips) or
    chips (every other name). One JAX device per chip (v4 and v5p in megacore mode).
    `memory_gb`: the chip's HBM as its vendor sheet states it (GB). `topology`: libtpu's name
    of the generation (`get_topology_desc("v5p:2x2x4")`), None for a GPU; its chips form a 3-D
    torus (v4, v5p) or a 2-D one (v5e, v6e)."""

    device_kind: str
    platform: str
    cores: int
    name_counts_cores: bool
    memory_gb: float
    topology: str | None = None


# `--target {family}-{N}`: Cloud TPU's accelerator types with a "tpu-" prefix, GPUs by model.
TARGETS = {
    "tpu-v4": Family("TPU v4", "tpu", 2, True, 32, "v4"),
    "tpu-v5p": Family("TPU v5", "tpu", 2, True, 95, "v5p"),
    "tpu-v5litepod": Family("TPU v5 lite", "tpu", 1, False, 16, "v5e"),
    "tpu-v6e": Family("TPU v6 lite", "tpu", 1, False, 32, "v6e"),
    "gpu-h100": Family("NVIDIA H100 80GB HBM3", "gpu", 132, False, 80),
    "gpu-h200": Family("NVIDIA H200", "gpu", 132, False, 141),
}


# A compiled peak over this share of the chip's memory is reported as leaving little room.
FIT_SHARE = 0.85

# The platform name `lower(lowering_platforms=...)` takes for a device platform.
LOWERING_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}


class Target(NamedTuple):
    """A parsed `--target`: its name, chips (JAX devices), the abstract device of each, its
    memory (GB, vendor sheet) and its `Family`."""

    name: str
    chips: int
    device: AbstractDevice
    memory_gb: float
    family: Family


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
                                 platform=family.platform), family.memory_gb, family)


def tpu_compiler() -> str | None:
    """"libtpu X" when libtpu, the TPU compiler, is importable here (it compiles for a TPU
    topology on a host without one), else None. Installing it changes neither this host's
    devices nor the start-up: JAX loads it only when asked for a TPU."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    return f"libtpu {importlib.metadata.version('libtpu')}"


def topology_name(family: Family, chips: int) -> str:
    """libtpu's topology of `chips` chips of a TPU family, e.g. "v5p:2x2x4" for 16: the shapes
    of Cloud TPU's slices (a 3-D torus grown z, then y, then x from 2x2x1; a 2-D one from 2x2
    by doubling its short side). Raises ValueError for a count no slice has."""
    three_d = family.topology in ("v4", "v5p")
    dims, order = ([2, 2, 1], [2] + [2, 1, 0] * 10) if three_d else ([2, 2], [1, 0] * 15)
    if chips == 1 and not three_d:
        dims = [1, 1]
    for axis in order:
        if math.prod(dims) >= chips:
            break
        dims[axis] *= 2
    if math.prod(dims) != chips:
        raise ValueError(f"no {family.topology} slice has {chips} chips (its slices have "
                         f"{'4, 8, 16' if three_d else '1, 4, 8, 16'}, ... chips)")
    return f"{family.topology}:{'x'.join(map(str, dims))}"


def topology_devices(target: Target, slices: int) -> list:
    """The devices of `slices` slices of a TPU target's topology, from libtpu on this host
    (each with its `slice_index`): what a `Mesh` of the pod is built from. Off a TPU VM, where
    unset: TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES, which libtpu looks up at start (the
    target and this host: else it warns that they are missing), and ALLOW_MULTIPLE_LIBTPU_LOAD
    (else libtpu's lock on /tmp/libtpu_lockfile, which guards a TPU VM's chips, lets one
    process at a time compile here)."""
    from jax.experimental import topologies

    if jax.devices()[0].platform != "tpu":  # not a TPU VM: no chip to guard, nothing to find
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.name.removeprefix("tpu-"))
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    megacore = target.family.topology in ("v4", "v5p")
    return list(topologies.get_topology_desc(
        platform="tpu", topology_name=topology_name(target.family, target.chips),
        chip_config_name="megacore" if megacore else "default",
        chips_per_host_bounds=(2, 2, 1) if target.chips >= 4 else (1, 1, 1),
        num_slices=slices).devices)


def step_on_target(cfg: TrainConfig, target: Target, echo: Callable[[str], None] = print,
                   compile: bool = True) -> dict[str, Any]:
    """One train step of `cfg` for `target`'s chips, from this host, reported through `echo`
    (DESIGN.md §6): compiled by libtpu for a TPU target where it is importable
    (`tpu_compiler`) and `compile` is true, else lowered. The mesh is the config's mesh
    section, a -1 axis taking the chips the others leave; with `mesh.num_slices` > 1
    (`--num-slices`) the topology is that many slices of the target, the data axis spanning
    them. One process does it for the whole topology, so `mesh.distributed` is not acted on.

    Returns {"target", "compiler" ("libtpu X", or None: lowered only), "params": counts by
    part, "mesh": {axis: size}, "devices", "slices", "batch_rows", "tokens_per_step",
    "lower_s", "bytes_per_device": {"params", "opt_state"} (exact, from the shardings),
    "shardings": {parameter path (layers as *): PartitionSpec}, "custom_calls": the lowered
    module's (`cem_jax.train.hlo.custom_calls`), "activations_estimate": bytes per device
    (`activation_estimate`, analytic), "memory_share_estimate": parameters, gradients,
    optimizer state and activations over the chip's memory}; compiled, also "compile_s",
    "memory": `compiled_memory` with "hbm" (the chip's bytes) and "share" (the peak's part of
    them), "collectives": {"ici", "dcn"} (`cem_jax.train.hlo.analyze`: {kind: {"count",
    "bytes"}} per chip per step), "dcn_bound": one all-reduce of a chip's gradient shard in
    bytes, "kernels" and "kernel_vmem" (Mosaic kernels: calls per step, scoped VMEM bytes),
    "flops": {"compiler_per_chip" (loop bodies once), "analytic_per_chip", "six_n_per_chip"}.

    Raises ValueError (as `dry_run`; the message names the target when its chip count does not
    fit the mesh section; cuDNN attention, which traces only beside a GPU, off one) and
    `cem_jax.memory.DoesNotFit` (a ValueError) when the compiled step's peak is over the chip's
    memory, or the compiler itself finds it over, naming the bytes and what to change.
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
    compiler = tpu_compiler() if platform == "tpu" and compile else None
    nothing = "nothing is allocated, read or written"
    if compiler is not None:
        title = (f"one train step compiled for {chips} x {kind} ({of}) by {compiler}, the TPU "
                 f"compiler, on this host ({nothing})")
    else:
        why = ("a GPU's compiler needs the GPU" if platform != "tpu" else "--lower-only"
               if not compile else f"libtpu, the TPU compiler, is not installed: pip install "
               f"'jax[tpu]=={jax.__version__}' (or cem_jax[tpu]) compiles it")
        title = (f"lowering one train step for {chips} x {kind} ({of}) from this host "
                 f"(lowered only, not compiled: {why}; {nothing})")
    counts = describe_model(cfg, echo, f"cem-train --dry-run --target {target.name}: {title}")
    abstract = AbstractMesh(sizes, MESH_AXES, abstract_device=target.device)
    m = cfg.model
    with jax.sharding.use_abstract_mesh(abstract):
        core = attention_impl(m.impl, jnp.dtype(m.dtype), m.head_width,
                              tied=m.kinds[0] != "llama_attention")
    if core == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(f"--target {target.name}: model.impl={m.impl!r} runs cuDNN's flash "
                         f"attention there, which JAX traces only where a GPU and cuDNN are; "
                         f"lower on a GPU host, or check the rest of the step here with "
                         f"model.impl=pallas or xla")
    devices = topology_devices(target, slices) if compiler is not None else None
    mesh = abstract if devices is None else make_mesh(cfg.mesh, devices)
    across = f"; {SLICE_AXIS} spans the slices" if slices > 1 else ""
    trainer, state, batch = abstract_step(
        cfg, mesh, echo, f"{chips} chips of {of} (device kind {kind!r}), "
        f"{cores} core{'s' * (cores > 1)} each{across}")
    start = time.perf_counter()
    if devices is None:
        lowered = trainer.train_step.trace(state, batch).lower(
            lowering_platforms=(LOWERING_PLATFORM[platform],))
    else:
        with jax.default_device(devices[0]):  # Pallas reads the device kind at lowering
            lowered = trainer.train_step.trace(state, batch).lower()
    lower_s = time.perf_counter() - start
    echo(f"lowered the train step for {LOWERING_PLATFORM[platform]} in {lower_s:.1f} s")

    state_bytes, shardings = _report_state(state, echo)
    calls = hlo.custom_calls(lowered.compiler_ir("stablehlo"))
    _report_calls(calls, echo)
    act = activation_estimate(cfg.model, mesh, check_batch_split(cfg, mesh), cfg.data.seq_len)
    report = {"target": target, "compiler": compiler, "params": counts,
              "mesh": dict(mesh.shape), "devices": chips, "slices": slices,
              "batch_rows": cfg.data.batch_size,
              "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len, "lower_s": lower_s,
              "bytes_per_device": state_bytes, "shardings": shardings, "custom_calls": calls,
              "activations_estimate": act["total"]}
    if devices is not None:
        report |= _compile(cfg, target, lowered, state, counts["total"], chips, echo)
    report["memory_share_estimate"] = _report_memory(cfg, target, state_bytes, act, echo,
                                                     compiled=devices is not None)
    if devices is not None:
        _refuse_if_over(cfg, target, report["memory"])
    return report


def _compile(cfg: TrainConfig, target: Target, lowered, state, params: int, chips: int,
             echo: Callable[[str], None]) -> dict[str, Any]:
    """Compile the lowered step with libtpu and say what the compiler reports."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:  # over the chip already in the compiler's eyes
        if not is_out_of_memory(err):
            raise
        raise DoesNotFit(f"--target {target.name}: the TPU compiler refused the train step "
                         f"({str(err).splitlines()[0]}); try {_knobs(cfg)}") from None
    compile_s = time.perf_counter() - start
    echo(f"compiled the train step in {compile_s:.1f} s")
    memory = compiled_memory(compiled)
    memory["hbm"] = int(target.memory_gb * 1e9)
    memory["share"] = memory["total"] / memory["hbm"]
    verdict = ("fits" if memory["share"] <= FIT_SHARE else "fits, but over "
               f"{FIT_SHARE:.0%} (little room for XLA's runtime)" if memory["share"] <= 1
               else "does NOT fit")
    echo("memory per chip (the compiler's): " + ", ".join(
        f"{k} {memory[k] / GIB:.2f} GiB" for k in ("arguments", "outputs", "aliased", "temp",
                                                   "code"))
         + f"; peak {memory['total'] / GIB:.2f} GiB of the chip's {target.memory_gb:g} GB "
           f"({memory['share']:.0%}): {verdict}")
    found = hlo.analyze(compiled.as_text())
    bound = _gradient_shard_bytes(state)
    for where, name in (("ici", "inside a slice (ICI)"), ("dcn", "across slices (DCN)")):
        parts = found[where]
        total = sum(p["bytes"] for p in parts.values())
        said = ", ".join(f"{k} x{p['count']} {p['bytes'] / MIB:,.1f} MiB"
                         for k, p in sorted(parts.items())) or "none"
        extra = (f" = {total / bound:.2f} x one all-reduce of the chip's gradient shard "
                 f"({bound / MIB:,.1f} MiB)" if where == "dcn" and parts else "")
        echo(f"collectives per chip per step {name}: {said}"
             + (f"; {total / MIB:,.1f} MiB in all{extra}" if parts else ""))
    kernels = found["kernels"]
    echo(f"Mosaic kernels compiled: {len(kernels)}" + (" (" + ", ".join(
        f"{k} x{n} per step, scoped VMEM {found['kernel_vmem'][k] / MIB:.2f} MiB"
        for k, n in sorted(kernels.items())) + ")" if kernels else ""))
    B, T = cfg.data.batch_size, cfg.data.seq_len
    six_n = 6 * params * B * T / chips
    flops = {"compiler_per_chip": compiler_flops(compiled),
             "analytic_per_chip": flops_per_token(cfg.model, T) * B * T / chips,
             "six_n_per_chip": six_n}
    said = "not reported" if flops["compiler_per_chip"] is None else \
        f"{flops['compiler_per_chip']:.4g} (a loop's body counted once)"
    echo(f"FLOPs per chip per step: the compiler's {said}; analytic "
         f"{flops['analytic_per_chip']:.4g}; 6 x parameters x tokens {six_n:.4g}")
    return {"compile_s": compile_s, "memory": memory,
            "collectives": {"ici": found["ici"], "dcn": found["dcn"]}, "dcn_bound": bound,
            "kernels": kernels, "kernel_vmem": found["kernel_vmem"], "flops": flops}


def _refuse_if_over(cfg: TrainConfig, target: Target, memory: dict[str, int]) -> None:
    """DoesNotFit when the compiled peak is over the chip's memory: the bytes and the knobs."""
    if memory["total"] <= memory["hbm"]:
        return
    raise DoesNotFit(
        f"--target {target.name}: the compiled train step needs {memory['total'] / GIB:.2f} "
        f"GiB per chip (arguments {memory['arguments'] / GIB:.2f}, temporaries "
        f"{memory['temp'] / GIB:.2f}, outputs not aliased "
        f"{(memory['outputs'] - memory['aliased']) / GIB:.2f}, code "
        f"{memory['code'] / GIB:.2f}), more than the chip's {target.memory_gb:g} GB; try "
        f"{_knobs(cfg)}")


def _knobs(cfg: TrainConfig) -> str:
    """What lowers a train step's memory per chip, as a config's overrides name it."""
    knobs = ["fewer rows per chip (lower data.batch_size, or raise "
             "optimizer.accumulation_steps)"]
    if cfg.model.remat != "full":
        knobs.append("model.remat=full")
    knobs += [f"more loss chunks (model.loss_chunks, now {cfg.model.loss_chunks})",
              f"a larger mesh.fsdp (now {cfg.mesh.fsdp})"]
    return ", ".join(knobs)


def _gradient_shard_bytes(state) -> int:
    """Bytes of one chip's shard of the gradients: its parameter shards (gradients have the
    parameters' shapes, dtypes and shardings)."""
    return _bytes_per_device(state["params"])


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
    """Say the lowered module's custom calls (`hlo.custom_calls`) and where their kernels sit."""
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
             "attention in one: the tied kernel, or splash attention for Llama's on a TPU)")


def _report_memory(cfg: TrainConfig, target: Target, state_bytes: dict[str, int],
                   act: dict[str, int], echo: Callable[[str], None], compiled: bool) -> float:
    """Say the activation estimate and the estimated memory per device against the chip's;
    return that share (parameters, their gradients, optimizer state and activations). With
    the step `compiled`, the compiler's peak decides and this is said to be an estimate only."""
    bound = " (a lower bound with remat=none: every block's intermediates stay too)" \
        if cfg.model.remat == "none" else ""
    echo(f"activations per device, ESTIMATE (analytic, not measured){bound}: "
         f"{act['total'] / GIB:.2f} GiB = block inputs kept for the backward "
         f"{act['block_inputs'] / GIB:.2f} GiB + the loss (fp32 logits of "
         f"{chunk_length(cfg.data.seq_len, cfg.model.loss_chunks)} positions at a time and their "
         f"gradient, the gradients of the hidden states and the head) "
         f"{act['loss'] / GIB:.2f} GiB; one block's recomputed intermediates come on top, "
         + ("and the compiler's peak above is the step's" if compiled else
            "and the real peak is the target compiler's (fusion, buffer assignment), which only "
            "a compile for the target gives"))
    need = 2 * state_bytes["params"] + state_bytes["opt_state"] + act["total"]
    share = need / (target.memory_gb * 1e9)
    remat = "" if cfg.model.remat == "full" else " or set model.remat=full"
    verdict = (" (an estimate only: the compiler's peak decides)" if compiled else
               " (fits, by this estimate)" if share <= 0.9 else
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
