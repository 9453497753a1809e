"""`cem-train --dry-run --target`: the ~100M train step with `impl: pallas` lowered from this CPU
for a TPU pod slice and a GPU host (DESIGN.md §6). The kernels lower as the target's custom
calls (Mosaic `tpu_custom_call`s, Triton calls), each inside a `shard_map`; the parameters are
sharded as the mesh section says; a target that is unknown or that the mesh does not fit is
named. Lowered only (`compile=False`, `--lower-only`: what a host without libtpu does); the
compile by libtpu is tests/train/test_tpu_compile.py."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P
from train_helpers import REPO

from cem_jax.cli.train import main
from cem_jax.train import load_config
from cem_jax.train.dry_run import dry_run
from cem_jax.train.targets import parse_target

FULL = REPO / "configs" / "cem_full_100m.yaml"
PARAMS = 77_089_560
SMALL = 12 * 2 * 768 + 768 + 24  # norm scales and the preconditioners' step sizes: [D], []


def _lower(target: str, overrides: list[str]) -> tuple[dict, list[str]]:
    lines: list[str] = []
    report = dry_run(load_config(FULL, ["model.impl=pallas", *overrides]), echo=lines.append,
                     target=target, compile=False)
    return report, lines


def test_100m_pallas_step_lowers_for_a_16_chip_tpu_with_fsdp():
    """tpu-v5p-32 is 16 chips (v5p names count TensorCores, 2 per chip); mesh data=2, fsdp=-1
    takes the other 8. Mosaic kernels: the forward (twice: the full remat recomputes it in the
    backward of the layer scan's body), dq and dk (`cem_jax/kernels/tpu.py`)."""
    report, lines = _lower("tpu-v5p-32", ["mesh.data=2", "mesh.fsdp=-1"])
    assert report["devices"] == 16
    assert report["mesh"] == {"data": 2, "fsdp": 8, "tensor": 1}
    assert report["params"]["total"] == PARAMS

    calls = report["custom_calls"]
    assert set(calls) == {"tpu_custom_call"}  # the interpreted kernel would have none
    assert calls["tpu_custom_call"]["kernels"] == {
        "cem_tied_attention_fwd_tpu": 2, "cem_tied_attention_dq_tpu": 1,
        "cem_tied_attention_dk_tpu": 1}
    assert calls["tpu_custom_call"]["outside_shard_map"] == 0  # XLA could not partition them
    assert any("3 kernels" in line and "all inside shard_map" in line for line in lines)

    # weights split over fsdp on D (ZeRO-3), "tensor" (size 1) on heads, MLP and vocabulary
    shardings = report["shardings"]
    assert shardings["embed"] == P("tensor", "fsdp")  # [V, D]: D over fsdp
    assert shardings["blocks/attention/mixer/query"] == P(None, "fsdp", "tensor", None)
    assert shardings["blocks/attention/mixer/key"] == P(None, "fsdp", "tensor", None)
    assert shardings["blocks/mlp/mixer/gate"] == P(None, "fsdp", "tensor")
    assert shardings["blocks/attention/norm/scale"] == P(None, None)  # [L, D]: replicated
    # fp32: every matrix has D (768 = 8 x 96) split 8 ways, the small vectors are whole
    param_bytes = 4 * ((PARAMS - SMALL) // 8 + SMALL)
    assert report["bytes_per_device"]["params"] == param_bytes
    # Adam's mu and nu like the parameters, plus a few replicated step counters
    assert 2 * param_bytes <= report["bytes_per_device"]["opt_state"] < 2 * param_bytes + 64
    assert any(line.startswith("activations per device, ESTIMATE") for line in lines)
    # parameters, their gradients, Adam's state and the activations, of a v5p chip's 95 GB
    need = 2 * param_bytes + report["bytes_per_device"]["opt_state"] + \
        report["activations_estimate"]
    assert report["memory_share_estimate"] == pytest.approx(need / 95e9)
    assert any(line.startswith("memory per device, ESTIMATE") and "(fits, by this estimate)"
               in line for line in lines)


def test_a_step_too_big_for_the_chip_is_flagged():
    """tpu-v5litepod-8: 16 GB chips, 64 of the 512 rows each. The loss in one chunk holds their
    whole fp32 logits and gradient, 2 x 64 x 1024 x 32768 x 4 bytes = 16 GiB: flagged. In the
    default 4 chunks it holds a quarter of that (`cem_jax.loss`), and the step fits."""
    report, lines = _lower("tpu-v5litepod-8", ["model.loss_chunks=1"])
    assert report["memory_share_estimate"] > 1
    assert any("does NOT fit: raise mesh.fsdp" in line for line in lines)
    chunked, lines = _lower("tpu-v5litepod-8", [])
    saved = report["activations_estimate"] - chunked["activations_estimate"]
    assert saved == 3 * 2 * 64 * 256 * 32768 * 4  # three of the four chunks' logits and grads
    assert any("(fits, by this estimate)" in line for line in lines)


def test_100m_pallas_step_lowers_for_a_gpu_host():
    """gpu-h200-8: the Triton kernels (forward, twice as above, and the fused backward) in a
    shard_map; mesh data=-1 (the config's) replicates the parameters on the 8 GPUs."""
    report, _ = _lower("gpu-h200-8", [])
    assert report["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    calls = report["custom_calls"]["__gpu$xla.gpu.triton"]
    assert calls["kernels"] == {"cem_tied_attention_fwd_gpu": 2, "cem_tied_attention_bwd_gpu": 1}
    assert calls["outside_shard_map"] == 0
    assert report["bytes_per_device"]["params"] == 4 * PARAMS


@pytest.mark.parametrize("name, chips, kind, platform", [
    ("tpu-v5p-32", 16, "TPU v5", "tpu"),  # names count TensorCores, 2 per chip
    ("tpu-v4-8", 4, "TPU v4", "tpu"),
    ("tpu-v6e-16", 16, "TPU v6 lite", "tpu"),  # names count chips (one core each)
    ("tpu-v5litepod-64", 64, "TPU v5 lite", "tpu"),
    ("gpu-h200-8", 8, "NVIDIA H200", "gpu"),
])
def test_target_names_give_chips_and_device(name, chips, kind, platform):
    target = parse_target(name)
    assert (target.chips, target.device.device_kind, target.device.platform) == \
        (chips, kind, platform)


@pytest.mark.parametrize("args, message", [
    (["--target", "tpu-v9-16"], "unknown --target 'tpu-v9-16': use one of tpu-v4-N"),
    (["--target", "tpu-v5p-15"], "--target 'tpu-v5p-15': tpu-v5p-N counts TensorCores, 2 per "
                                 "chip, so N must be a positive multiple of 2"),
    (["--target", "tpu-v6e-16", "mesh.data=3"],
     "--target tpu-v6e-16 has 16 chips: mesh data×fsdp×tensor = [3, 1, 1] needs 3 devices"),
    (["--target", "tpu-v6e-16", "mesh.data=-1", "mesh.fsdp=3"],
     "--target tpu-v6e-16 has 16 chips: mesh {'data': -1, 'fsdp': 3, 'tensor': 1}: 16 devices "
     "are not divisible by the fixed axes' product 3"),
    (["--target", "tpu-v6e-16", "--num-slices", "2", "mesh.data=1", "mesh.fsdp=-1"],
     "--target 2 slices of tpu-v6e-16 has 32 chips: mesh.num_slices = 2 must divide the data "
     "axis, which spans the slices (data = 1 on 32 devices)"),
    # cuDNN's attention traces only beside a GPU; auto picks it for a bf16 model on a GPU
    (["--target", "gpu-h200-8", "model.impl=auto"], "--target gpu-h200-8: model.impl='auto' "
     "runs cuDNN's flash attention there, which JAX traces only where a GPU and cuDNN are"),
])
def test_a_bad_target_is_named(args, message, capsys):
    assert main(["--config", str(FULL), "--dry-run", *args]) == 2
    assert capsys.readouterr().err.startswith(f"cem-train: error: {message}")


def test_the_100m_step_lowers_for_two_v5p_slices(capsys):
    """`--num-slices 2`: two tpu-v5p-32 slices (32 chips), data spanning them (4 = 2 per
    slice), fsdp 8 inside each: the per-device state is one slice's with fsdp 8."""
    assert main(["--config", str(FULL), "--dry-run", "--target", "tpu-v5p-32", "--num-slices",
                 "2", "--lower-only", "mesh.data=-1", "mesh.fsdp=8", "model.impl=pallas"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cem-train --dry-run --target tpu-v5p-32: lowering one train step for "
                          "32 x TPU v5 (2 slices of tpu-v5p-32) from this host (lowered only, "
                          "not compiled: --lower-only;")
    assert "mesh: data=4 fsdp=8 tensor=1 (32 chips of 2 slices of tpu-v5p-32" in out
    assert "data spans the slices" in out
    param_mib = 4 * ((PARAMS - SMALL) // 8 + SMALL) / 2**20
    assert f"per device (exact, from the shardings): parameters {param_mib:.1f} MiB" in out


def test_a_device_slice_is_its_slice_index_or_a_run_of_host_devices():
    from types import SimpleNamespace

    from cem_jax.sharding import device_slices

    tpus = [SimpleNamespace(id=i, slice_index=i % 2) for i in range(8)]
    assert [[d.id for d in g] for g in device_slices(tpus, 2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match=r"the 8 devices are in 2 slice\(s\) of \[4, 4\] "
                                         r"devices, but mesh.num_slices = 1: set "
                                         r"mesh.num_slices=2"):
        device_slices(tpus, 1)
    hosts = [SimpleNamespace(id=i) for i in range(8)]
    assert [[d.id for d in g] for g in device_slices(hosts, 4)] == [[0, 1], [2, 3], [4, 5],
                                                                     [6, 7]]


def test_target_needs_dry_run(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(FULL), "--target", "tpu-v6e-16"])
    assert exit_info.value.code == 2
    assert "--target needs --dry-run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(FULL), "--dry-run", "--num-slices", "2"])
    assert exit_info.value.code == 2
    assert "--num-slices needs --target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(FULL), "--dry-run", "--lower-only"])
    assert exit_info.value.code == 2
    assert "--lower-only needs --target" in capsys.readouterr().err
