"""`impl: pallas` on 8 host devices: the kernel runs in a `shard_map` (XLA cannot partition a
Mosaic or Triton call), and the loss and gradients equal one device's. Runs this file as a
subprocess with 8 forced host devices (the kernel interpreted, as on every CPU)."""

import json

import pytest
from train_helpers import run_on_8_host_devices

pytestmark = pytest.mark.slow  # starts processes (make test-all)

# (data, fsdp, tensor): key heads G=2 split over tensor=2; with tensor=4 they do not divide,
# so the kernel takes whole heads on every tensor device (query heads follow their key heads)
MESHES = {"data=2,fsdp=2,tensor=2": (2, 2, 2), "fsdp=2,tensor=4": (1, 2, 4)}


def test_pallas_loss_and_gradients_on_8_devices_equal_one_device():
    report = run_on_8_host_devices(__file__)
    assert report["devices"] == 8
    assert report["one"]["shard_maps"] == 0  # one device: the kernel is called directly
    for name in MESHES:
        assert report[name]["loss"] <= 1e-6 * report["one"]["loss"], (name, report[name])
        assert report[name]["grads"] <= 1e-5, (name, report[name])
        # the forward, and in the backward the recomputed forward and the gradient kernels
        assert report[name]["shard_maps"] >= 2, (name, report[name])


def _run() -> dict:
    import re

    import jax
    import numpy as np

    from cem_jax.config import ModelConfig
    from cem_jax.sharding import batch_sharding, global_batch, make_mesh
    from cem_jax.train.step import TRAIN_KEYS, Trainer
    from cem_jax.train_config import MeshConfig, OptimizerConfig

    model = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                        mlp_dim=48, init_std=0.1, impl="pallas")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (8, 17)).astype(np.int32)
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],  # two documents per row
            "segment_ids": np.repeat(np.array([[1] * 10 + [2] * 6]), 8, 0).astype(np.int32),
            "positions": np.tile(np.r_[np.arange(10), np.arange(6)], (8, 1)).astype(np.int32)}

    initial = jax.device_get(Trainer(model, OptimizerConfig(), 10, make_mesh(
        MeshConfig(data=1), jax.devices()[:1])).init(0)["params"])

    def loss_and_grads(mesh):
        trainer = Trainer(model, OptimizerConfig(), 10, mesh)
        params = jax.device_put(initial, trainer.state_shardings["params"])
        step = jax.jit(jax.value_and_grad(trainer.loss),
                       in_shardings=(trainer.state_shardings["params"],
                                     {k: batch_sharding(mesh) for k in TRAIN_KEYS}))
        batch = global_batch(host, mesh)
        lowered = step.lower(params, batch)
        loss, grads = lowered.compile()(params, batch)
        maps = len(re.findall(r"sdy\.manual_computation", lowered.as_text()))
        return float(loss), jax.device_get(grads), maps

    one_loss, one_grads, one_maps = loss_and_grads(make_mesh(MeshConfig(data=1),
                                                             jax.devices()[:1]))
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(one_grads))
    report = {"devices": jax.device_count(), "one": {"loss": one_loss, "shard_maps": one_maps}}
    for name, (d, f, t) in MESHES.items():
        loss, grads, maps = loss_and_grads(make_mesh(MeshConfig(data=d, fsdp=f, tensor=t)))
        diff = max(float(np.max(np.abs(a - b))) for a, b in
                   zip(jax.tree.leaves(grads), jax.tree.leaves(one_grads), strict=True))
        report[name] = {"loss": abs(loss - one_loss), "grads": diff / scale, "shard_maps": maps}
    return report


if __name__ == "__main__":
    print(json.dumps(_run()))
