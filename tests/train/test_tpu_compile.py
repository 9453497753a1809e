"""The TPU compiler on this host (libtpu, `cem_jax.train.targets`; DESIGN.md §6): the tied
kernel compiled by Mosaic for two generations (and the Llama baseline's splash attention), the
100M train step compiled for a v5p-32 (one slice and two), what `cem_jax.train.hlo` reads off
compiled programs whose collectives are known, and the refusal of a step over the chip's
memory and of kernel tiles over its VMEM.

The `tpu_compile` tier (`make test-all`): each 100M compile takes 30-80 s on 2 cores."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from train_helpers import REPO, run_cli

from cem_jax.kernels import BlockSizes, tied_attention
from cem_jax.kernels.tpu import SCOPED_VMEM_DEFAULT
from cem_jax.train import hlo, load_config
from cem_jax.train.dry_run import dry_run
from cem_jax.train.targets import parse_target, topology_devices

pytestmark = [pytest.mark.tpu_compile, pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu (the TPU compiler, in .[dev] and .[tpu]) is not installed")]

FULL = REPO / "configs" / "cem_full_100m.yaml"
MIB = 2**20


def _kernel_grads(device, q, k, seg, block_sizes=None):
    """Compile tied attention's forward and backward for `device`'s TPU; its `hlo.analyze`."""
    def grads(q, k, seg):
        def loss(q, k):
            return tied_attention(q, k, segment_ids=seg, backend="tpu", interpret=False,
                                  block_sizes=block_sizes).astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1))(q, k)

    with jax.default_device(device):
        return hlo.analyze(jax.jit(grads).trace(q, k, seg).lower().compile().as_text())


@pytest.mark.parametrize("target", ["tpu-v5litepod-4", "tpu-v6e-4"])
@pytest.mark.parametrize("T, H, G, K, dtype", [(2048, 8, 2, 128, jnp.bfloat16),
                                               (8192, 4, 4, 256, jnp.float32)])
def test_the_tied_kernel_compiles_for_two_generations(target, T, H, G, K, dtype):
    """Mosaic compiles the forward, dq and dk kernels (segment ids on, default tiles), each
    given scoped VMEM within the 16 MiB a kernel gets."""
    spec = functools.partial(jax.ShapeDtypeStruct, dtype=dtype)
    found = _kernel_grads(topology_devices(parse_target(target), 1)[0], spec((1, T, H, K)),
                          spec((1, T, G, K)), jax.ShapeDtypeStruct((1, T), jnp.int32))
    names = {f"cem_tied_attention_{k}_tpu": k for k in ("fwd", "dq", "dk")}
    assert found["kernels"] == dict.fromkeys(names, 1)
    for name in names:
        assert 0 < found["kernel_vmem"][name] <= SCOPED_VMEM_DEFAULT, name


def test_the_llama_baselines_splash_attention_compiles_for_a_v6e():
    """The untied (Llama) core on a TPU is JAX's splash attention: its forward, dq and dkv
    kernels compile through Mosaic under a one-chip mesh (GQA, segment ids, bf16)."""
    from cem_jax.attention import splash_attention
    from cem_jax.energies import AttentionSpec

    device = topology_devices(parse_target("tpu-v6e-4"), 1)[0]
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    q = jax.ShapeDtypeStruct((2, 8, 2048, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 2048, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 2048), jnp.int32)

    def grads(q, k, v, seg):
        def loss(q, k, v):
            return splash_attention(q, k, v, seg, spec).astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    mesh = Mesh(np.array([device]), ("data",))
    with jax.default_device(device), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        found = hlo.analyze(jax.jit(grads).trace(q, k, k, seg).lower().compile().as_text())
    assert found["kernels"] == {"splash_mqa_fwd_segmented_residuals": 1,
                                "splash_mqa_dq_segmented_no_residuals": 1,
                                "splash_mqa_dkv_segmented_no_residuals": 1}


def test_tiles_over_the_vmem_are_refused_before_compiling():
    """2048 x 2048 fp32 tiles at K = 256: the forward needs at least 24 MiB (its score tile
    alone is 16), refused on a v5e (16 MiB of scoped VMEM) before Mosaic runs. On a v6e
    (32 MiB) the bound passes and Mosaic itself refuses them (the bound is a lower one);
    1024 x 1024 tiles compile there (on a v5e Mosaic's forward needs 20.8 MiB of them)."""
    q = jax.ShapeDtypeStruct((1, 4096, 4, 256), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    huge = BlockSizes(2048, 2048, 2048, 2048)
    v5e = topology_devices(parse_target("tpu-v5litepod-4"), 1)[0]
    v6e = topology_devices(parse_target("tpu-v6e-4"), 1)[0]
    with pytest.raises(ValueError, match=r"tied attention's fwd kernel needs at least 24\.0 MiB "
                       r"of VMEM with its tiles \(BlockSizes.block_q, block_k = 2048, 2048; K "
                       r"padded to 256, 4-byte inputs\), over the 16 MiB of scoped VMEM that "
                       r"Mosaic gives a kernel on a TPU v5 lite: use smaller blocks"):
        _kernel_grads(v5e, q, q, seg, huge)
    with pytest.raises(jax.errors.JaxRuntimeError, match="CompileTimeScopedVmemOom"):
        _kernel_grads(v6e, q, q, seg, huge)
    found = _kernel_grads(v6e, q, q, seg, BlockSizes(1024, 1024, 1024, 1024))
    assert len(found["kernels"]) == 3
    assert max(found["kernel_vmem"].values()) <= 32 * MIB


def test_the_collectives_of_a_known_program_are_counted_per_step():
    """A loop of 5 steps over 4 v5e chips (fsdp) of each of 2 slices (data): per step an
    all-gather of a [1024, 256] fp32 shard to [4096, 256], a reduce-scatter back, and a sum
    over every chip of both slices. Inside a slice: 5 all-gathers of the gathered 4 MiB, 5
    reduce-scatters of it; across slices (DCN): the 1 MiB shard's all-reduce, 5 times."""
    devices = topology_devices(parse_target("tpu-v5litepod-4"), 2)
    mesh = Mesh(np.array(sorted(devices, key=lambda d: (d.slice_index, d.id))).reshape(2, 4),
                ("data", "fsdp"))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    def step(x):
        def body(_, x):
            whole = jax.lax.all_gather(x, "fsdp", tiled=True)
            part = jax.lax.psum_scatter(whole * 2.0, "fsdp", tiled=True)
            return jax.lax.psum(part, "data") / 8.0
        return jax.lax.fori_loop(0, 5, body, x)

    x = jax.ShapeDtypeStruct((4096, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    with jax.default_device(devices[0]):
        found = hlo.analyze(jax.jit(step).trace(x).lower().compile().as_text())
    assert found["ici"]["all-gather"] == {"count": 5, "bytes": 5 * 4 * MIB}
    assert found["ici"]["reduce-scatter"] == {"count": 5, "bytes": 5 * 4 * MIB}
    assert set(found["dcn"]) == {"all-reduce"}
    assert found["dcn"]["all-reduce"]["bytes"] == 5 * MIB
    assert found["unknown_trip_counts"] == 0


def test_the_100m_step_compiles_for_a_v5p_32_and_fits():
    """Data parallel over 16 chips: the compiler's arguments are the train state (parameters
    and Adam's moments, fp32, whole on every chip) and the batch's rows; the
    peak fits a v5p's 95 GB with room; the only collectives are gradient all-reduces inside
    the slice, none across; 12 layers of kernels per step (the forward twice: remat)."""
    lines: list[str] = []
    report = dry_run(load_config(FULL, ["model.impl=pallas"]), echo=lines.append,
                     target="tpu-v5p-32")
    assert lines[0].startswith("cem-train --dry-run --target tpu-v5p-32: one train step "
                               "compiled for 16 x TPU v5 (tpu-v5p-32) by libtpu 0.")
    memory, state = report["memory"], report["bytes_per_device"]
    batch = 2 * (512 // 16) * 1024 * 4  # inputs and targets, int32
    # and a few small arrays (the step, the RNG key, scalars padded to their tiles): < 0.1%
    assert state["params"] + state["opt_state"] + batch <= memory["arguments"] \
        <= (state["params"] + state["opt_state"] + batch) * 1.001
    assert memory["aliased"] >= state["params"] + state["opt_state"]  # donated, updated
    assert memory["total"] == memory["arguments"] + memory["outputs"] - memory["aliased"] + \
        memory["temp"] + memory["code"]
    assert memory["share"] == pytest.approx(memory["total"] / 95e9)
    assert memory["share"] < 0.85
    assert set(report["collectives"]["ici"]) == {"all-reduce"}
    assert report["collectives"]["dcn"] == {}
    # every gradient is reduced once, in bf16 (the blocks') or fp32 (the embedding's, norms)
    reduced = report["collectives"]["ici"]["all-reduce"]["bytes"]
    assert report["dcn_bound"] / 2 < reduced < report["dcn_bound"]
    assert report["kernels"] == {"cem_tied_attention_fwd_tpu": 24,
                                 "cem_tied_attention_dq_tpu": 12,
                                 "cem_tied_attention_dk_tpu": 12}
    assert any(line.startswith("memory per chip (the compiler's): arguments 0.86 GiB")
               and line.endswith("(5%): fits") for line in lines)


def test_the_100m_step_on_two_slices_moves_one_gradient_all_reduce_across(capsys):
    """Two v5p-32 slices, data 4 (2 per slice) x fsdp 8: across slices only all-reduces,
    together about one all-reduce of each chip's gradient shard (its bound), no all-gather
    of a parameter."""
    from cem_jax.cli.train import main

    assert main(["--config", str(FULL), "--dry-run", "--target", "tpu-v5p-32", "--num-slices",
                 "2", "mesh.data=-1", "mesh.fsdp=8", "model.impl=pallas"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cem-train --dry-run --target tpu-v5p-32: one train step compiled "
                             "for 32 x TPU v5 (2 slices of tpu-v5p-32) by libtpu")
    dcn = next(line for line in out if "across slices (DCN)" in line)
    assert dcn.startswith("collectives per chip per step across slices (DCN): all-reduce x")
    ratio = float(dcn.split(" = ")[1].split(" x one all-reduce")[0])
    assert 0.5 < ratio <= 1.05, dcn
    ici = next(line for line in out if "inside a slice (ICI)" in line)
    assert "all-gather" in ici and "reduce-scatter" in ici  # fsdp: gathered, scattered


KNOBS = ("try fewer rows per chip (lower data.batch_size, or raise "
         "optimizer.accumulation_steps), {remat}more loss chunks (model.loss_chunks, now "
         "{chunks}), a larger mesh.fsdp (now {fsdp}) (exit status 2)")


@pytest.mark.slow
def test_a_step_the_compiler_finds_too_big_is_refused_in_one_line():
    """Two layers of the 100M model, 128 rows per v5e chip, no remat, the loss in one chunk:
    the TPU compiler itself finds the temporaries over the chip's HBM; refused with status 2
    in one line that says so and names the knobs."""
    result = run_cli(["--config", str(FULL), "--dry-run", "--target", "tpu-v5litepod-4",
                      "model.num_layers=2", "expected_params=null", "model.remat=none",
                      "model.loss_chunks=1"], timeout=600)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("cem-train: error: --target tpu-v5litepod-4: the TPU compiler "
                           "refused the train step (RESOURCE_EXHAUSTED: Ran out of memory on "
                           "HBM, the total memory required for HLO temporaries (")
    assert line.endswith(KNOBS.format(remat="model.remat=full, ", chunks=1, fsdp=1))


@pytest.mark.slow
def test_a_step_whose_compiled_peak_is_over_the_chip_is_refused_in_one_line():
    """The ~8B tied model on a v5p-8 (4 chips, fsdp 4): it compiles, but its peak (the
    train state's 12.8 GiB of arguments per chip and the temporaries) is over a v5p's 95 GB:
    refused with status 2 in one line naming the bytes (it fits a v5p-16)."""
    result = run_cli(["--config", str(REPO / "configs" / "cem_full_8b.yaml"), "--dry-run",
                      "--target", "tpu-v5p-8"], timeout=900)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("cem-train: error: --target tpu-v5p-8: the compiled train step needs ")
    peak = float(line.split(" needs ")[1].split(" GiB")[0])
    assert peak * 2**30 > 95e9
    assert line.endswith("more than the chip's 95 GB; " + KNOBS.format(remat="", chunks=4,
                                                                       fsdp=-1))
