"""The device mesh and one sharding vocabulary for weights and activations.

Mesh axes `MESH_AXES` = ("data", "fsdp", "tensor"), from the one table of mesh axes
(`cem_jax.train_config.MESH_AXIS_TABLE`). Arrays name their axes logically and `LOGICAL_RULES`,
derived from that table, maps those names to mesh axes (MaxText's `logical_axis_rules`):

    batch    → ("data", "fsdp")   the rows of batches and of every activation
    length   → None               sequence positions (no sequence parallelism)
    embed    → "fsdp"             a weight's model width D (ZeRO-3: a slice per device, gathered
                                  for the matmul); an activation's D is left unnamed (None)
    vocab, heads, kv_heads, mlp → "tensor"   (Megatron-style splits of weights and logits)
    norm     → None               norm scales, preconditioner vectors

Weights carry their names from creation (`cem_jax.layers.param`); activations are pinned with
`constrain` while traced under a mesh (the train and eval steps). A mesh axis that the mesh
lacks, that does not divide the dimension, or that another dimension of the same array already
uses is dropped (that dimension stays replicated), so every mesh shape works for every model:
only memory and speed differ. The optimizer state is sharded like the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cem_jax.train_config import (
    BATCH_AXES,
    MESH_AXES,
    MESH_AXIS_TABLE,
    SLICE_AXIS,
    MeshConfig,
)

Array = jax.Array
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES, "length": None,
    **{name: axis.name for axis in MESH_AXIS_TABLE for name in axis.shards}, "norm": None}


def logical_to_mesh(logical: tuple[str | None, ...], shape: tuple[int, ...],
                    mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """The mesh `PartitionSpec` of an array of `shape` whose axes are named `logical` (padded
    with None on the left for leading axes without a name, e.g. stacked layers), by
    `LOGICAL_RULES` on a mesh of `mesh_shape` ({axis: size}). Raises ValueError for a name
    without a rule."""
    logical = (None,) * (len(shape) - len(logical)) + tuple(logical)
    used: set[str] = set()
    spec = []
    for name, size in zip(logical, shape, strict=True):
        if name is not None and name not in LOGICAL_RULES:
            raise ValueError(f"logical axis {name!r} has no sharding rule (known: "
                             f"{', '.join(LOGICAL_RULES)})")
        axes = LOGICAL_RULES.get(name) if name is not None else None
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ())
                     if a in mesh_shape and a not in used)
        if axes and size % math.prod(mesh_shape[a] for a in axes) == 0:
            used.update(axes)
            spec.append(axes[0] if len(axes) == 1 else axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def constrain(x: Array, *logical: str | None) -> Array:
    """`x` pinned to the sharding its logical axis names give (one per dimension) when traced
    under a mesh (`jax.sharding.use_abstract_mesh`, as the train and eval steps are); with no
    mesh it is `x` unchanged. The model pins its residual stream and logits to "batch": without
    this, XLA's sharding propagation can follow a weight sharded over "fsdp" (e.g. the tied
    embedding's D) and compute whole-batch activations on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_mesh(logical, x.shape, mesh.shape))


def target_platform() -> str:
    """The platform being traced for: the device platform of the abstract mesh in context
    ("tpu", "gpu", "cpu"; set when lowering for a TPU or GPU from a CPU host, DESIGN.md §6,
    and by the train and eval steps' mesh), else `jax.default_backend()`. Kernel and `impl`
    choices follow it (`cem_jax.kernels`, `cem_jax.attention.attention_impl`)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return jax.default_backend() if device is None else device.platform


def target_device_kind() -> str:
    """The device kind being traced for ("TPU v5 lite", ...): the abstract mesh's device in
    context, else the default device (`jax.default_device`, as Pallas reads it when lowering
    for a TPU topology from a CPU host), else the first device; "" when it has none."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        device = jax.devices()[0]
    return getattr(device, "device_kind", "")


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A `Mesh` of shape (data, fsdp, tensor) over `devices` (default: all, every process).

    A -1 axis takes the devices the others leave. With `cfg.num_slices` > 1 the devices of each
    slice (`device_slices`) fill a contiguous block of the data axis, so fsdp and tensor stay
    inside a slice (jax's `create_hybrid_device_mesh`, by reshape). Raises ValueError when the
    sizes do not multiply to the device count, or the slices do not fit (`device_slices`).
    """
    devices = jax.devices() if devices is None else devices
    sizes = list(mesh_sizes(cfg, len(devices)))
    axis = MESH_AXES.index(SLICE_AXIS)
    sizes[axis] //= cfg.num_slices
    return Mesh(np.concatenate([np.asarray(group).reshape(sizes)
                                for group in device_slices(devices, cfg.num_slices)], axis),
                MESH_AXES)


def device_slices(devices: list, num_slices: int) -> list[list]:
    """`devices` in `num_slices` groups, one per slice: by their `slice_index` (TPU multislice)
    where they have one, else (CPU host devices, GPUs) in `num_slices` contiguous runs of the
    device order, which tests the sharding across slices but not the network between them.
    Raises ValueError when the devices' slices are not `num_slices` equal groups."""
    if not hasattr(devices[0], "slice_index"):
        per = len(devices) // num_slices
        return [devices[i * per:(i + 1) * per] for i in range(num_slices)]
    groups: dict[int, list] = {}
    for device in devices:
        groups.setdefault(device.slice_index, []).append(device)
    if len(groups) != num_slices or len({len(g) for g in groups.values()}) > 1:
        raise ValueError(f"the {len(devices)} devices are in {len(groups)} slice(s) of "
                         f"{sorted(len(g) for g in groups.values())} devices, but "
                         f"mesh.num_slices = {num_slices}: set mesh.num_slices={len(groups)}")
    return [groups[index] for index in sorted(groups)]


def mesh_sizes(cfg: MeshConfig, count: int) -> tuple[int, ...]:
    """(data, fsdp, tensor) of the mesh section `cfg` on `count` devices, a -1 axis taking the
    devices the others leave. Raises ValueError when the sizes do not multiply to `count`, or
    the data axis (which spans the slices) does not split into `cfg.num_slices` equal parts."""
    sizes = list(cfg.sizes())
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if count % rest:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes, strict=True))}: {count} "
                             f"devices are not divisible by the fixed axes' product {rest}")
        sizes[sizes.index(-1)] = count // rest
    if math.prod(sizes) != count:
        raise ValueError(f"mesh {'×'.join(MESH_AXES)} = {sizes} needs {math.prod(sizes)} devices, "
                         f"but there are {count}: change the mesh section (use -1 for "
                         f"one axis to take the rest)")
    slices, axis = cfg.num_slices, MESH_AXES.index(SLICE_AXIS)
    if sizes[axis] % slices:
        raise ValueError(f"mesh.num_slices = {slices} must divide the {SLICE_AXIS} axis, which "
                         f"spans the slices ({SLICE_AXIS} = {sizes[axis]} on {count} devices): "
                         f"give mesh.{SLICE_AXIS} a multiple of {slices}, or fewer slices")
    return tuple(sizes)


def local_mesh() -> Mesh:
    """This process' devices on "data" (fsdp = tensor = 1): the mesh of readers (evaluation,
    sampling) of replicated parameters."""
    return Mesh(np.asarray(jax.local_devices()).reshape(-1, *[1] * (len(MESH_AXES) - 1)),
                MESH_AXES)


def param_shardings(params, logical_specs, mesh: Mesh):
    """`NamedSharding` per parameter: pytrees `params` (arrays or ShapeDtypeStructs) and
    `logical_specs` (PartitionSpecs of logical names, same structure)."""
    return jax.tree.map(
        lambda p, s: NamedSharding(mesh, logical_to_mesh(tuple(s), p.shape, mesh.shape)),
        params, logical_specs)


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array every device holds whole (scalars, step counters)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch arrays [B, ...] split over "batch" on B."""
    return NamedSharding(mesh, logical_to_mesh(("batch",) + (None,) * (ndim - 1),
                                               (0,) * ndim, mesh.shape))


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process' rows {name: [B/P, T]} → global jax Arrays [B, T] on the mesh
    (`jax.make_array_from_process_local_data`: process p's rows are the p-th block of B)."""
    out = {}
    for name, value in local.items():
        sharding = batch_sharding(mesh, value.ndim)
        shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, value, shape)
    return out
