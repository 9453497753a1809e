"""Sharded steps on 8 host devices equal the 1-device step, and a checkpoint written on one mesh
restores onto another. Runs this file as a subprocess with 8 forced host devices."""

import json
import re
import tempfile
import types
from pathlib import Path

import pytest
from train_helpers import run_on_8_host_devices

MESHES = {"data=8": (8, 1, 1), "fsdp=8": (1, 8, 1), "data=2,fsdp=2,tensor=2": (2, 2, 2)}


@pytest.mark.slow
def test_sharded_steps_and_cross_mesh_restore_match_one_device():
    report = run_on_8_host_devices(__file__)
    assert report["devices"] == 8
    for name in MESHES:
        assert report[name]["loss"] <= 1e-5, (name, report[name])
        assert report[name]["params"] <= 1e-5, (name, report[name])
    assert report["data=8"]["embed_shard"] == [320, 32]  # [V, D]: replicated
    assert report["fsdp=8"]["embed_shard"] == [320, 4]  # D over fsdp
    assert report["data=2,fsdp=2,tensor=2"]["embed_shard"] == [160, 16]  # V over tensor
    # Each device computes its own rows: no all-gather makes a whole-batch activation (the
    # embedding lookup did, from the table's D over fsdp, when fsdp and tensor were both 2).
    assert report["data=2,fsdp=2,tensor=2"]["batch_gathers"] == []
    assert report["restore 8->1"]["params"] == 0.0
    assert report["restore 8->1"]["next_loss"] <= 1e-5


def _run() -> dict:
    import jax
    import numpy as np

    from cem_jax.checkpoint import Checkpointer
    from cem_jax.config import ModelConfig
    from cem_jax.sharding import global_batch, make_mesh
    from cem_jax.train.step import Trainer
    from cem_jax.train_config import MeshConfig, OptimizerConfig

    model = ModelConfig(vocab_size=320, d_model=32, num_layers=2, num_heads=4, mlp_dim=64,
                        interaction="dplr", preconditioner="dplr", preconditioner_rank=2)
    opt = OptimizerConfig(lr=1e-2, warmup_steps=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 320, (16, 17)).astype(np.int32)
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.repeat(np.array([[1] * 10 + [2] * 6]), 16, 0).astype(np.int32),
            "positions": np.tile(np.r_[np.arange(10), np.arange(6)], (16, 1)).astype(np.int32)}

    def steps(mesh, n=2, state=None):
        trainer = Trainer(model, opt, 10, mesh)
        state = trainer.init(0) if state is None else state
        for _ in range(n):
            state, metrics = trainer.train_step(state, global_batch(host, mesh))
        return trainer, state, float(metrics["loss"])

    def max_diff(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    one = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    _, ref_state, ref_loss = steps(one)
    ref = jax.device_get(ref_state["params"])
    report = {"devices": jax.device_count()}
    for name, (d, f, t) in MESHES.items():
        mesh = make_mesh(MeshConfig(data=d, fsdp=f, tensor=t))
        trainer, state, loss = steps(mesh)
        report[name] = {"loss": abs(loss - ref_loss), "params": max_diff(state["params"], ref),
                        "embed_shard": list(state["params"]["embed"].addressable_shards[0]
                                            .data.shape)}
        if (d, f, t) == (2, 2, 2):
            hlo = trainer.train_step.lower(state, global_batch(host, mesh)).compile().as_text()
            report[name]["batch_gathers"] = re.findall(  # [B, T, ...] of the global B = 16
                r"= (f32\[16,16,\d+\])\S* all-gather\(", hlo)
    with tempfile.TemporaryDirectory() as run_dir:  # save on 2x2x2, restore on 1 device
        tokenizer = types.SimpleNamespace(sha256="0")
        checkpointer = Checkpointer(Path(run_dir), keep=1)
        checkpointer.save(2, state, {}, tokenizer)
        checkpointer.wait()
        restored, _ = checkpointer.restore(2, Trainer(model, opt, 10, one).abstract_state())
        checkpointer.close()
    restored_diff = max_diff(restored["params"], state["params"])
    _, _, next_loss = steps(one, 1, restored)  # (donates `restored`)
    _, _, ref_next = steps(one, 1, ref_state)
    report["restore 8->1"] = {"params": restored_diff, "next_loss": abs(next_loss - ref_next)}
    return report


if __name__ == "__main__":
    print(json.dumps(_run()))
