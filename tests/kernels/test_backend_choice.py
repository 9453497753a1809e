"""The kernel backend follows the platform traced for: the abstract mesh's device when there is
one (lowering for a TPU or GPU from this CPU, DESIGN.md §6), else the default backend; so a
TPU lowering embeds the Mosaic kernel, never the interpreted one."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from cem_jax.kernels import tied_attention
from cem_jax.kernels.common import resolve_backend

TPU = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
GPU = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def _mesh(device):
    return AbstractMesh((1,), ("data",), abstract_device=device)


@pytest.mark.parametrize("device, interpret, expected", [
    (TPU, None, ("tpu", False)),
    (GPU, None, ("gpu", False)),
    (None, None, ("xla", False)),  # this CPU: the reference
    (None, True, ("gpu", True)),  # this CPU, a kernel asked for: interpreted
])
def test_backend_follows_the_mesh_device(device, interpret, expected):
    assert jax.default_backend() == "cpu"
    mesh = jax.sharding.get_abstract_mesh() if device is None else _mesh(device)
    with jax.sharding.use_abstract_mesh(mesh):
        assert resolve_backend(None, interpret) == expected


def test_lowering_for_a_tpu_from_this_cpu_embeds_the_mosaic_kernels():
    """Defaults only (no backend, no interpret): forward and backward lower to the three Mosaic
    calls of `cem_jax/kernels/tpu.py`; with the CPU's choice they would be interpreted HLO."""
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, k):
        return jnp.sum(tied_attention(q, k).astype(jnp.float32))

    with jax.sharding.use_abstract_mesh(_mesh(TPU)):
        text = jax.jit(jax.grad(loss, (0, 1))).trace(q, q).lower(
            lowering_platforms=("tpu",)).as_text()
    for kernel in ("fwd", "dq", "dk"):
        assert f'kernel_name = "cem_tied_attention_{kernel}_tpu"' in text
