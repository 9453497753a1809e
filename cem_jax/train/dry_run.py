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

`--target NAME` (`cem-train --dry-run --target tpu-v5p-32`, `cem_jax.train.targets`) does it
for a TPU or GPU topology that this host does not have (`TARGETS`; DESIGN.md §6, MaxText's
`train_compile.py`). For a TPU, with libtpu installed (the `tpu` extra; `.[dev]` has it), the
TPU compiler compiles the step for the devices of the target's topology: the memory per chip
is the compiler's, and decides (a step whose peak is over the chip's HBM is refused), with the
collectives per chip per step inside a slice and across slices, the Mosaic kernels and their
scoped VMEM. Without libtpu (or for a GPU, or with `--lower-only`) the step is lowered only,
for an `AbstractMesh` whose abstract device carries the target's platform and device kind (so
the Pallas kernels lower for it: Mosaic `tpu_custom_call`s, Triton calls on a GPU), and the
memory is an estimate: the parameters' and optimizer state's bytes (exact, from their
shardings) and an analytic activation estimate against the chip's memory (its vendor sheet's).
Either way it prints the parameters' shardings and the lowered module's custom calls (and
whether each sits in a `shard_map`, which XLA needs to partition a kernel).

The target table, the lowering and the compile are `cem_jax.train.targets` (what the lowered
and the compiled programs hold: `cem_jax.train.hlo`); the sizes and checks both share
(`check_expected_params`, which `cem-train` also runs first when a config states
`expected_params`, the activation estimate, the compiled memory) are `cem_jax.train.sizing`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from cem_jax.kinds import check_user_kinds
from cem_jax.optim import check_trainable
from cem_jax.sharding import (
    make_mesh,
)
from cem_jax.train.metrics import flops_per_token
from cem_jax.train.sizing import (
    GIB,
    abstract_step,
    compiled_memory,
    compiler_flops,
    describe_model,
)
from cem_jax.train.targets import parse_target, step_on_target
from cem_jax.train_config import TrainConfig


def dry_run(cfg: TrainConfig, echo: Callable[[str], None] = print,
            target: str | None = None, compile: bool = True) -> dict[str, Any]:
    """Compile one train step of `cfg` on its mesh without data or parameters and report
    (through `echo`, process 0 only) what it needs; with `target` (a `parse_target` name),
    do it for that topology instead (`step_on_target`: compiled by libtpu for a TPU where it
    is installed and `compile`, else lowered; its dict).

    Returns {"params": counts by part, "mesh": {axis: size}, "devices", "batch_rows",
    "tokens_per_step", "compile_s", "memory": {"arguments", "outputs", "aliased", "temp",
    "code", "total"} in bytes per device (None if the backend gives no memory analysis),
    "flops": {"analytic_per_step", "analytic_per_device", "xla_per_device" (None if not
    given)}}. Raises ValueError (expected_params mismatch, a `model.param_dtype` the optimizer
    cannot train, a user's kind that `check_kind` refuses, batch not divisible by the mesh,
    an unknown target or one whose chips the mesh section does not fit).
    """
    check_trainable(cfg.model)
    check_user_kinds(cfg.model)
    if target is not None:
        return step_on_target(cfg, parse_target(target), echo, compile=compile)
    if cfg.mesh.distributed:
        jax.distributed.initialize(cfg.mesh.coordinator_address, cfg.mesh.num_processes,
                                   cfg.mesh.process_id)
    say = echo if jax.process_index() == 0 else (lambda _: None)
    m = cfg.model
    counts = describe_model(cfg, say, "cem-train --dry-run: compiling one train step on "
                             "abstract inputs (nothing is allocated, read or written)")
    mesh = make_mesh(cfg.mesh)
    devices = mesh.devices.size
    processes = f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''}"
    trainer, state, batch = abstract_step(
        cfg, mesh, say, f"{devices} {jax.devices()[0].platform} devices, {processes}")
    B, T = cfg.data.batch_size, cfg.data.seq_len
    start = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    say(f"compiled the train step in {compile_s:.1f} s")

    memory = compiled_memory(compiled)
    if memory is None:
        say("memory per device: not reported by this backend")
    else:
        say("memory per device: " + ", ".join(
            f"{k} {memory[k] / GIB:.4f} GiB" for k in ("arguments", "outputs", "aliased",
                                                       "temp", "code", "total")))
    per_token = flops_per_token(m, T)
    analytic = per_token * B * T
    xla = compiler_flops(compiled)
    say(f"FLOPs per step (analytic, train = 3 x forward): {analytic:.4g} = "
        f"{per_token / 1e9:.4g} GFLOPs/token x {B * T:,} tokens; {analytic / devices:.4g} per "
        f"device")
    left_out = ([f"{m.num_layers - 1} of the {m.num_layers} layers (model.scan_layers=true)"]
                if m.scan_layers else [])
    chunks = min(m.loss_chunks, T)
    if chunks > 1:
        left_out.append(f"{chunks - 1} of the loss's {chunks} chunks (model.loss_chunks)")
    note = (f" (XLA counts a loop's body once: this leaves out {' and '.join(left_out)})"
            if left_out else "")
    say("FLOPs per step per device (XLA cost_analysis): "
        + ("not reported by this backend" if xla is None else f"{xla:.4g}{note}"))
    return {"params": counts, "mesh": dict(mesh.shape), "devices": devices, "batch_rows": B,
            "tokens_per_step": B * T, "compile_s": compile_s, "memory": memory,
            "flops": {"analytic_per_step": analytic, "analytic_per_device": analytic / devices,
                      "xla_per_device": xla}}
