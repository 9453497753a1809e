"""The device mesh and where every array lives on it.

Mesh axes ("data", "fsdp", "tensor"). Batches are split over `BATCH_AXES` ("data", "fsdp") on
their batch axis, and so are the model's activations inside the steps, whatever the parameters'
sharding (`cem_jax.layers.constrain`). Parameters carry logical axis names
(`cem_jax.layers.param`); `LOGICAL_RULES` maps them to mesh axes: the model width "embed" is
sharded over "fsdp" (ZeRO-3 style: each device holds a slice, XLA gathers it for the matmul) and
the "heads", "kv_heads", "mlp", "vocab" axes over "tensor" (Megatron style). A dimension that
the mesh axis size does not divide, or whose mesh axis is already used by another dimension of
the same array, stays replicated, so every mesh shape works for every model (only memory and
speed differ). The optimizer state is sharded like the parameters.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cem_jax.layers import BATCH_AXES
from cem_jax.train.config import MeshConfig

AXES = ("data", "fsdp", "tensor")
LOGICAL_RULES = {"embed": "fsdp", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor",
                 "mlp": "tensor", "norm": None}


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A `Mesh` of shape (data, fsdp, tensor) over `devices` (default: all, every process).

    A -1 axis takes the devices the others leave. Raises ValueError when the sizes do not
    multiply to the device count.
    """
    devices = jax.devices() if devices is None else devices
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devices) % rest:
            raise ValueError(f"mesh {dict(zip(AXES, sizes, strict=True))}: {len(devices)} "
                             f"devices are not divisible by the fixed axes' product {rest}")
        sizes[sizes.index(-1)] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh data×fsdp×tensor = {sizes} needs {math.prod(sizes)} devices, "
                         f"but there are {len(devices)}: change the mesh section (use -1 for "
                         f"one axis to take the rest)")
    return Mesh(np.asarray(devices).reshape(sizes), AXES)


def logical_to_mesh(spec: tuple, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """A parameter's logical spec (e.g. ("vocab", "embed"); stacked layers lead with None) →
    the mesh `PartitionSpec` for an array of `shape`, by `LOGICAL_RULES`."""
    used, out = set(), []
    for name, size in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape, strict=True):
        axis = LOGICAL_RULES.get(name) if name is not None else None
        if name is not None and name not in LOGICAL_RULES:
            raise ValueError(f"logical axis {name!r} has no sharding rule (known: "
                             f"{', '.join(LOGICAL_RULES)})")
        if axis is None or axis in used or size % mesh.shape[axis]:
            out.append(None)
        else:
            used.add(axis)
            out.append(axis)
    return PartitionSpec(*out)


def param_shardings(params, logical_specs, mesh: Mesh):
    """`NamedSharding` per parameter: pytrees `params` (arrays or ShapeDtypeStructs) and
    `logical_specs` (PartitionSpecs of logical names, same structure)."""
    return jax.tree.map(lambda p, s: NamedSharding(mesh, logical_to_mesh(s, p.shape, mesh)),
                        params, logical_specs)


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array every device holds whole (scalars, step counters)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch arrays [B, ...] split over ("data", "fsdp") on B."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *(None,) * (ndim - 1)))


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process' rows {name: [B/P, T]} → global jax Arrays [B, T] on the mesh
    (`jax.make_array_from_process_local_data`: process p's rows are the p-th block of B)."""
    out = {}
    for name, value in local.items():
        sharding = batch_sharding(mesh, value.ndim)
        shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, value, shape)
    return out
