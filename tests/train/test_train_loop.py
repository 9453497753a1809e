"""The loop in-process: NaN stop keeps the last good checkpoint, gradient accumulation equals the
big batch, the optimizer's decay mask, config errors and the FLOP formula."""

import errno
import fcntl
import gc
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import faults
import jax
import numpy as np
import pytest
from train_helpers import run_cli

from cem_jax.checkpoint import Checkpointer, drop_failure_echoes
from cem_jax.cli.train import main
from cem_jax.config import ModelConfig
from cem_jax.optim import decay_mask, learning_rate
from cem_jax.rundir import load_run
from cem_jax.sharding import global_batch, make_mesh
from cem_jax.train import load_config, metrics, train
from cem_jax.train import run as run_module
from cem_jax.train.metrics import flops_per_token
from cem_jax.train.step import Trainer
from cem_jax.train_config import MeshConfig, OptimizerConfig


def test_nan_stops_the_run_and_keeps_the_good_checkpoint(tiny_overrides, tmp_path, capsys,
                                                         monkeypatch):
    faults.arm(monkeypatch.setattr, nan_step=8)
    status = main([*tiny_overrides, f"run.dir={tmp_path}", "run.steps=12",
                   "run.checkpoint_every=3"])
    err = capsys.readouterr().err
    assert status == 3  # diverged: not retried
    assert err.rstrip().endswith("(exit status 3)") and "cem-train: diverged: " in err
    assert "non-finite training metrics at step 8" in err
    assert "the latest good checkpoint is step 6" in err and "then resume" in err
    checkpointer = Checkpointer(tmp_path, keep=3)
    assert checkpointer.latest_step() == 6
    cfg = load_config(None, [*tiny_overrides, f"run.dir={tmp_path}"])
    trainer = Trainer(cfg.model, cfg.optimizer, 12, make_mesh(cfg.mesh))
    state, meta = checkpointer.restore(6, trainer.abstract_state())
    checkpointer.close()
    assert int(state["step"]) == 6 and meta["config"]["run"]["steps"] == 12
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))


def test_train_takes_the_callers_loop_hooks(tiny_overrides, tmp_path):
    """`train(cfg, hooks=[...])`: a setup hook sees the run's config and loop, and a loop hook
    it adds sees the steps it is due at, with the losses the run logs."""
    seen = {}

    def setup(at):
        assert at.config.run.dir == str(tmp_path) and at.loop.last_step == 4
        at.loop.add_hook(lambda info: seen.update({info.step: info.host_metrics()["loss"]}), 2)

    cfg = load_config(None, [*tiny_overrides, f"run.dir={tmp_path}", "run.steps=4",
                             "run.sample_tokens=0"])
    assert train(cfg, hooks=[setup])["step"] == 4
    logged = {r["step"]: r["loss"] for r in metrics.logged_records(tmp_path)
              if r["kind"] == "train"}
    assert sorted(seen) == [2, 4]
    assert all(seen[step] == pytest.approx(logged[step], rel=1e-6) for step in seen)


def test_the_last_speed_record_is_within_the_range_of_the_others(tiny_overrides, tmp_path,
                                                                 monkeypatch):
    """Each train record's tokens/s covers its own step, dispatch included: the last record of
    a short run read 1.7x to 38.7x the median (MFU 135.5%) when it covered no dispatch. Each
    batch takes 0.1 s to fetch (a slow input pipeline, part of the dispatch), so a step takes
    0.1 s and more: the tiny model's ~1 ms of compute read 13,357 to 118,169 tokens/s on one
    loaded machine, with no meter at fault."""
    def slow_batch(*args):
        time.sleep(0.1)
        return global_batch(*args)

    monkeypatch.setattr(run_module, "global_batch", slow_batch)
    cfg = load_config(None, [*tiny_overrides, f"run.dir={tmp_path}", "run.steps=10",
                             "run.log_every=1", "run.sample_tokens=0"])
    train(cfg)
    speeds = [r["tokens_per_s"] for r in metrics.logged_records(tmp_path)
              if r["kind"] == "train" and "tokens_per_s" in r]
    assert len(speeds) == 9  # step 1 (mostly compilation) is not timed
    tokens = cfg.data.batch_size * cfg.data.seq_len
    assert all(speed <= tokens / 0.1 for speed in speeds), speeds  # each step holds its fetch
    *others, last = speeds
    assert min(others) / 1.5 <= last <= 1.5 * max(others), speeds  # 1.5: a shared machine


def _batch(rng, B, T, V):
    tokens = rng.integers(4, V, (B, T + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((B, T), np.int32),
            "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}


def test_accumulation_of_4_micro_batches_equals_the_big_batch():
    model = ModelConfig(vocab_size=320, d_model=32, num_layers=2, num_heads=2, mlp_dim=64,
                        interaction="dplr", preconditioner="diag", steps=2)
    mesh = make_mesh(MeshConfig())
    batch = global_batch(_batch(np.random.default_rng(0), 16, 12, 320), mesh)
    results = []
    for accumulation in (1, 4):
        # Adam divides by √v, so the fp32 summation-order noise of a near-zero gradient entry
        # moves its parameter by a fraction of lr: lr=1e-3 keeps that below the 1e-5 checked on
        # the parameters (loss and gradient norm are compared directly).
        opt = OptimizerConfig(lr=1e-3, warmup_steps=0, accumulation_steps=accumulation)
        trainer = Trainer(model, opt, 10, mesh)
        state = trainer.init(0)
        for _ in range(2):
            state, metrics = trainer.train_step(state, batch)
        results.append((jax.device_get(metrics), jax.device_get(state["params"])))
    (m1, p1), (m4, p4) = results
    assert abs(m1["loss"] - m4["loss"]) <= 1e-5 * abs(m1["loss"])
    assert abs(m1["grad_norm"] - m4["grad_norm"]) <= 1e-5 * m1["grad_norm"]
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_the_first_warmup_step_learns_and_a_warmup_longer_than_the_run_is_said(
        tiny_overrides, tmp_path, capsys):
    schedule = learning_rate(OptimizerConfig(lr=1e-2, warmup_steps=4, min_lr_ratio=0.1), 10)
    rates = [float(schedule(step - 1)) for step in (1, 2, 4, 7, 10)]  # by the steps taken
    assert rates == pytest.approx([2.5e-3, 5e-3, 1e-2, 1e-2 * (0.1 + 0.9 * 0.5), 1e-3])
    model = ModelConfig(vocab_size=320, d_model=32, num_layers=1, num_heads=2, mlp_dim=64)
    trainer = Trainer(model, OptimizerConfig(lr=1e-2, warmup_steps=4), 10,
                      make_mesh(MeshConfig()))
    state = trainer.init(0)
    before = jax.device_get(state["params"])
    state, step_metrics = trainer.train_step(
        state, global_batch(_batch(np.random.default_rng(0), 4, 8, 320), trainer.mesh))
    assert float(step_metrics["lr"]) == pytest.approx(2.5e-3)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), before,
                         jax.device_get(state["params"]))
    assert min(jax.tree.leaves(moved)) > 0  # every parameter learned at step 1
    assert main([*tiny_overrides, f"run.dir={tmp_path}", "run.steps=2", "run.sample_tokens=0",
                 "optimizer.warmup_steps=5"]) == 0
    assert "optimizer.warmup_steps = 5 is more than run.steps = 2: the warmup is cut to 2 " \
           "steps" in capsys.readouterr().out


def test_no_weight_decay_on_norms_diagonals_and_preconditioners():
    params = {"embed": 0, "final_norm": {"scale": 0},
              "blocks": {"attention": {"mixer": {"query": 0, "diag": 0}, "norm": {"scale": 0},
                                       "precond": {"rho": 0, "U": 0}},
                         "mlp": {"mixer": {"gate": 0, "up": 0, "down": 0}}}}
    mask = decay_mask(params)
    decayed = sorted("/".join(str(k.key) for k in path)
                     for path, on in jax.tree_util.tree_leaves_with_path(mask) if on)
    assert decayed == ["blocks/attention/mixer/query", "blocks/mlp/mixer/down",
                       "blocks/mlp/mixer/gate", "blocks/mlp/mixer/up", "embed"]


@pytest.mark.parametrize("overrides,field", [
    (["optimizer.lr=0"], "'optimizer.lr'"), (["mesh.tensor=0"], "'mesh.tensor'"),
    (["run.steps=0"], "'run.steps'"), (["model.steps=0"], "'model.steps'"),
    (["run.stepz=3"], "'stepz'"),
    (["data.vocab_size=4096"], "data.vocab_size = 4096 is larger than model.vocab_size = 2048"),
    (["optimizer.accumulation_steps=5"], "accumulation_steps"), (["runs.steps=1"], "runs"),
    (["run.dir="], "'run.dir'"), (["optimizer.lr=.inf"], "'optimizer.lr' = inf"),
    (["model.init_std=.nan"], "'model.init_std' = nan"),
    (["run.peak_flops=0"], "'run.peak_flops' = 0.0"), (["data.seq_len=1"], "'data.seq_len'"),
    (["model.tie_attention=false", "model.interaction=dplr"], "'model.interaction'"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "'mesh.fsdp' = -1 is invalid: it must be a positive "
     "integer, since data is -1 already"),
    (["optimizer.clip_norm=-1"], "'optimizer.clip_norm' = -1.0 is invalid: it must be >= 0 (0 "
     "or null turns clipping off)"),
])
def test_bad_config_is_named(overrides, field, capsys):
    assert main(["--config", "configs/shakespeare_cem.yaml", *overrides]) == 2
    assert field in capsys.readouterr().err


def test_a_null_clip_norm_turns_clipping_off():
    assert load_config(None, ["optimizer.clip_norm=null"]).optimizer.clip_norm == 0.0
    assert load_config(None, []).optimizer.clip_norm == 1.0


def test_missing_validation_corpus_fails_before_training(tiny_overrides, tmp_path, capsys):
    missing = tmp_path / "no_such_val.txt"
    args = [*tiny_overrides, f"data.val_corpus={missing}"]
    assert main([*args, f"run.dir={tmp_path / 'runs' / 'new'}"]) == 2  # cannot run as configured
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # the directories it made held nothing: removed
    mine = tmp_path / "mine"  # a run directory that was there already is left as it was
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    assert main([*args, f"run.dir={mine}"]) == 2
    assert (mine / "notes.txt").read_text() == "my notes"
    assert not (mine / "metrics.jsonl").exists()  # no step was taken
    assert not list((mine / "checkpoints").glob("*"))


def test_flops_of_the_llama_twin_follow_palm_and_tying_saves_the_values():
    """Untied, steps=1: 6·(matmul parameters) + 12·L·H·K·T per token (PaLM's MFU count)."""
    llama = ModelConfig(tie_attention=False, tie_mlp=False, preconditioner="none")
    base = ModelConfig()  # the default shape (G = H)
    D, L, H, K, F, V, T = (base.d_model, base.num_layers, base.num_heads, base.head_width,
                           base.mlp_dim, base.vocab_size, 256)
    matmul_params = L * (4 * D * H * K + 3 * D * F) + D * V
    assert flops_per_token(llama, T) == 6 * matmul_params + 12 * L * H * K * T
    assert flops_per_token(ModelConfig(), T) == flops_per_token(llama, T) - 3 * L * 2 * D * H * K
    two_steps = ModelConfig(steps=2)  # the query side and the gate run twice
    assert flops_per_token(two_steps, T) - flops_per_token(ModelConfig(), T) == \
        3 * L * (4 * D * H * K + 4 * H * K * T + 4 * D * F)
    # recompute_context: every step computes its context's keys (and values) and Wu c again
    recompute = ModelConfig(steps=2, recompute_context=True)
    assert flops_per_token(recompute, T) - flops_per_token(two_steps, T) == \
        3 * L * (2 * D * H * K + 2 * D * F)  # tied keys (G = H) and the MLP's up projection
    untied = dict(tie_attention=False, tie_mlp=False, preconditioner="none", steps=3)
    assert flops_per_token(ModelConfig(**untied, recompute_context=True), T) - \
        flops_per_token(ModelConfig(**untied), T) == 3 * L * 2 * (4 * D * H * K + 2 * D * F)


def test_cpu_peak_is_not_multiplied_by_host_devices(monkeypatch):
    # Host devices (--xla_force_host_platform_device_count) share one process's cores: the
    # measured CPU matmul peak is already the machine's; accelerators count every device.
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda: 100.0)
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    assert metrics.peak_flops(None) == (100.0, "measured fp32 matmul")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # an accelerator not in the table
    assert metrics.peak_flops(None) == (800.0, "measured fp32 matmul")
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(device_kind="NVIDIA H200")])
    assert metrics.peak_flops(None) == (8 * 989e12, "table (H200 bf16)")
    assert metrics.peak_flops(5.0) == (5.0, "configured")


@pytest.mark.parametrize("kind, name", [("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"),
                                        ("NVIDIA A100-SXM4-80GB", "A100"),
                                        ("TPU v5 lite", "TPU v5 lite"), ("TPU v5p", "TPU v5p"),
                                        ("TPU v6 lite", "TPU v6")])
def test_peak_flops_table_matches_whole_words_of_the_device_kind(monkeypatch, kind, name):
    # "L4" is a prefix of "L40S" but not the same chip (121 vs 362 TFLOP/s).
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(device_kind=kind)])
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert metrics.peak_flops(None) == (metrics.PEAK_FLOPS[name], f"table ({name} bf16)")


def test_overflowing_parameters_stop_the_run_before_they_are_saved(tiny_overrides, tmp_path,
                                                                   capsys):
    # lr 1e38: the first step's loss and gradients are finite, its updated parameters are
    # about ±1e38 and their norm overflows; the step-1 checkpoint must not be written.
    status = main([*tiny_overrides, f"run.dir={tmp_path}", "run.steps=3",
                   "run.checkpoint_every=1", "optimizer.lr=1e38", "optimizer.warmup_steps=0"])
    err = capsys.readouterr().err
    assert status == 3
    assert "at step 1" in err and "norm of the updated parameters inf" in err
    assert f"no checkpoint was written yet in {tmp_path}" in err and "start again" in err
    checkpointer = Checkpointer(tmp_path, keep=3)
    assert checkpointer.latest_step() is None
    checkpointer.close()


@pytest.mark.parametrize("damage", [  # ~14 s each
    "garbage", pytest.param("empty manifest", marks=pytest.mark.slow)])
def test_corrupt_checkpoint_is_reported_with_its_path(tiny_overrides, tmp_path, damage):
    """In one message: without orbax's leftover callbacks into its closed event loop, which
    Python printed as dozens of tracebacks around it."""
    args = [*tiny_overrides, f"run.dir={tmp_path}", "run.steps=3", "run.sample_tokens=0"]
    assert main(args) == 0
    state = tmp_path / "checkpoints" / "3" / "state"
    for path in state.rglob("*") if damage == "garbage" else [state / "manifest.ocdbt"]:
        if path.is_file():
            path.write_bytes(b"garbage" if damage == "garbage" else b"")
    result = run_cli([*args[:-2], "run.steps=5"])
    assert result.returncode == 2
    assert f"cem-train: error: cannot restore checkpoint {state.parent} (" in result.stderr
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr


# A read that orbax abandons when a restore fails: closed by its finalizer, it raises its error
# again, which Python prints as "Exception ignored in: <coroutine ...>" with a traceback.
ABANDONED_READ = """
class Pending:
    def __await__(self):
        yield

async def read():
    try:
        await Pending()
    except BaseException:
        raise Exception("Encountered error while reading array index: (slice(0, 4, 1),)")
"""


def _abandon_a_read(filename: str) -> None:
    """Start ABANDONED_READ's coroutine as compiled from `filename`, then drop it."""
    namespace = {}
    exec(compile(ABANDONED_READ, filename, "exec"), namespace)
    coroutine = namespace["read"]()
    coroutine.send(None)
    del coroutine
    gc.collect()


def test_only_the_echoes_of_a_failed_checkpoint_read_or_write_are_dropped(monkeypatch, caplog):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    drop_failure_echoes()
    drop_failure_echoes()  # installed once
    for err in (RuntimeError("Event loop is closed"), RuntimeError("another"),
                ValueError("Event loop is closed")):
        sys.unraisablehook(SimpleNamespace(exc_value=err, object=None))
    _abandon_a_read(os.path.join(os.sep, "venv", "orbax", "checkpoint", "serialization.py"))
    _abandon_a_read("mine.py")  # not orbax's: shown
    assert seen == ["RuntimeError('another')", "ValueError('Event loop is closed')",
                    "Exception('Encountered error while reading array index: (slice(0, 4, 1),)')"]
    with caplog.at_level(logging.ERROR):
        logging.getLogger("asyncio").error("Task exception was never retrieved\nfuture: ...")
        logging.getLogger("asyncio").error("_GatheringFuture exception was never retrieved")
        logging.getLogger("asyncio").error("Unclosed client session")
        orbax = os.path.join(os.sep, "venv", "orbax", "checkpoint", "future.py")
        for path, err in ((orbax, ValueError("RESOURCE_EXHAUSTED: ... [os_error_code='28']")),
                          (orbax, OSError(errno.EFBIG, "File too large")),
                          (orbax, ValueError("INVALID_ARGUMENT: ... [os_error_code='22']")),
                          ("mine.py", OSError(errno.ENOSPC, "No space left on device"))):
            absl = logging.getLogger("absl")
            absl.handle(absl.makeRecord("absl", logging.ERROR, path, 1, "save failed: %s",
                                        (err,), (type(err), err, None)))
    assert [r.getMessage() for r in caplog.records] == [
        "Unclosed client session", "save failed: INVALID_ARGUMENT: ... [os_error_code='22']",
        "save failed: [Errno 28] No space left on device"]


def test_resume_refuses_a_changed_model_or_token_stream_and_reports_a_changed_optimizer(
        tiny_overrides, tmp_path, capsys):
    args = [*tiny_overrides, f"run.dir={tmp_path}", "run.steps=3", "run.sample_tokens=0",
            "run.eval_batches=1"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "model.d_model=64"]) == 2
    assert "different model config (saved, given): {'model.d_model': (32, 64)}" \
        in capsys.readouterr().err
    assert main([*args, "data.seq_len=32"]) == 2
    assert "{'data.seq_len': (16, 32)}" in capsys.readouterr().err
    assert main([*args, "run.steps=2"]) == 2
    assert "run.steps = 2 but the run in" in capsys.readouterr().err
    # data.vocab_size beside a given tokenizer does not choose the tokens: its config.yaml's
    # 400 (the equality the configs once needed) and null (the tokenizer's) are the same run
    assert main([*args, "data.vocab_size=null"]) == 0
    assert "different data config" not in capsys.readouterr().err
    # How the data is read may change, how the model is computed (impl, attention block,
    # remat), and any optimizer field: clipping and weight decay off keep the optimizer
    # state's structure (tests/train/test_resume.py checks every field).
    assert main([*args, "run.steps=5", "optimizer.lr=5e-3", "optimizer.clip_norm=0",
                 "optimizer.weight_decay=0", "data.prefetch=1", "data.num_threads=2",
                 "model.impl=auto", "model.attention_block=8", "model.remat=full"]) == 0
    out = capsys.readouterr().out
    assert ("resuming with changed settings (saved, given): {'optimizer.lr': (0.01, 0.005), "
            "'optimizer.weight_decay': (0.1, 0.0), 'optimizer.clip_norm': (1.0, 0.0), "
            "'run.steps': (3, 5), 'model.impl': ('xla', 'auto'), "
            "'model.attention_block': (16, 8), 'model.remat': ('none', 'full')}") in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "resumed" in out and max(r["step"] for r in records) == 5
    # The logged learning rate is the one each step used: the first schedule (3 steps, lr 1e-2)
    # up to the resume, the new one (5 steps, lr 5e-3) after it.
    before = learning_rate(load_config(None, args).optimizer, 3)
    after = learning_rate(OptimizerConfig(lr=5e-3, warmup_steps=3), 5)
    expected = {s: float((before if s <= 3 else after)(s - 1)) for s in range(1, 6)}
    assert {r["step"]: r["lr"] for r in records if r["kind"] == "train"} == \
        pytest.approx(expected, rel=1e-6)
    assert expected[3] != expected[2] != expected[4]


def test_bfloat16_compute_with_remat_trains(tiny_overrides, tmp_path):
    cfg = load_config(None, [*tiny_overrides, f"run.dir={tmp_path}", "run.steps=8",
                             "model.dtype=bfloat16", "model.remat=full", "run.sample_tokens=0",
                             "optimizer.accumulation_steps=2"])
    summary = train(cfg)
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").open())
              if r["kind"] == "train"]
    assert summary["step"] == 8 and len(losses) == 8
    assert losses[-1] < losses[0] - 0.3  # it learns in bf16 too
    # run.eval_batches=2 evaluates a prefix of the split: the figure says it is an estimate
    assert "bits_per_byte" not in summary["eval"]
    assert math.isfinite(summary["eval"]["bits_per_byte_est"])


def test_bfloat16_weights_are_refused_and_bfloat16_compute_moves_every_norm_scale(
        tiny_overrides, tmp_path, capsys):
    """bfloat16 storage has no float32 master copy, so small updates round away (20 steps at
    lr 6e-4 moved 0 of 320 norm-scale entries): cem-train and its dry run refuse it in one
    line before anything is written, and so does the library's `Trainer` (a notebook's way
    in), with the same words; pointing to bfloat16 compute, under which the same 20 steps
    move every norm scale and every preconditioner step size."""
    refused = tmp_path / "bf16"
    for extra in ([], ["--dry-run"]):
        assert main([*extra, *tiny_overrides, f"run.dir={refused}",
                     "model.param_dtype=bfloat16"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "set model.dtype: bfloat16 to compute in" in err, err
    assert not refused.exists()
    stored = ModelConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=32,
                         param_dtype="bfloat16", dtype="bfloat16")
    with pytest.raises(ValueError) as raised:
        Trainer(stored, OptimizerConfig(lr=6e-4, warmup_steps=0), 20, make_mesh(MeshConfig()))
    assert f"cem-train: error: {raised.value} (exit status 2)\n" == err
    cfg = load_config(None, [*tiny_overrides, f"run.dir={tmp_path / 'run'}", "run.steps=20",
                             "optimizer.lr=6e-4", "optimizer.warmup_steps=0",
                             "model.dtype=bfloat16", "model.preconditioner=diag",
                             "run.sample_tokens=0"])
    train(cfg)
    start = math.log(math.e - 1.0)  # softplus(rho) = 1: P = I
    moved = {jax.tree_util.keystr(path): np.mean(np.asarray(leaf) != init)
             for path, leaf in jax.tree_util.tree_flatten_with_path(load_run(tmp_path / "run")
                                                                    .params)[0]
             for name, init in (("scale", 1.0), ("rho", start))
             if jax.tree_util.keystr(path).endswith(f"['{name}']")}
    assert len(moved) == 5 and all(v == 1.0 for v in moved.values()), moved  # layers stacked


def test_a_resumed_run_drops_the_records_it_will_log_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "kind": "train", "loss": 1.0 / s}) for s in range(1, 6)]
    path.write_text("\n".join(records) + '\n{"step": 6, "ki')  # torn by a kill
    writer = metrics.MetricsWriter(tmp_path, resume_step=3)
    writer.write(4, "train", {"loss": 0.5})
    writer.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_run_dir_in_use_or_not_a_directory_is_refused(tiny_overrides, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = [*tiny_overrides, "run.steps=2", "run.sample_tokens=0"]
    with open(run_dir / ".lock", "w") as held:  # as a running cem-train holds it
        held.write("pid 1234 on elsewhere")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main([*args, f"run.dir={run_dir}"]) == 2
        assert "is in use by another cem-train (pid 1234 on elsewhere)" in capsys.readouterr().err
    assert not (run_dir / "checkpoints").exists()
    (tmp_path / "file").write_text("x")
    assert main([*args, f"run.dir={tmp_path / 'file'}"]) == 2
    out, err = capsys.readouterr()
    assert "is a file, not a directory" in err and out == ""  # one line, nothing before it
    assert main([*args, f"run.dir={tmp_path / 'file' / 'run'}"]) == 2
    assert "Not a directory" in capsys.readouterr().err
    assert main([*args, f"run.dir={run_dir}"]) == 0  # the lock was released


def test_out_of_device_memory_is_a_clear_error(tiny_overrides, tmp_path, monkeypatch, capsys):
    def oom(self):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating "
                                         "11338974384580 bytes.\nmore detail")

    monkeypatch.setattr("cem_jax.train.run.TrainLoop.run", oom)
    assert main([*tiny_overrides, f"run.dir={tmp_path}", "run.steps=2"]) == 2
    err = capsys.readouterr().err
    assert ("cem-train: error: the step needs more memory than the device has (RESOURCE_EXHAUSTED"
            ": Out of memory allocating 11338974384580 bytes.); lower data.batch_size") in err
    assert "Traceback" not in err and err.rstrip().endswith("(exit status 2)")


@pytest.mark.parametrize("error, status, line", [
    (jax.errors.JaxRuntimeError("INTERNAL: lost the coordination service\nmore detail"), 1,
     "cem-train: crashed: JaxRuntimeError: INTERNAL: lost the coordination service (exit "
     "status 1)"),  # a lost host: retried by the launchers
    (OSError(errno.EIO, "Input/output error"), 1,
     "cem-train: crashed: OSError: [Errno 5] Input/output error (exit status 1)"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/r/metrics.jsonl"), 2,
     "cem-train: error: cannot write /runs/r/metrics.jsonl: No space left on device; free space "
     "there or give another run.dir (no checkpoint was written yet) (exit status 2)"),
], ids=["lost-host", "io-error", "disk-full"])
def test_an_error_in_training_ends_with_its_status_and_one_line(
        tiny_overrides, tmp_path, monkeypatch, capsys, error, status, line):
    """A crash prints its traceback (a bug or an infrastructure failure: someone needs it)
    before the line; an error that a retry would meet again is the line alone."""
    def fail(self):
        raise error

    monkeypatch.setattr("cem_jax.train.run.TrainLoop.run", fail)
    assert main([*tiny_overrides, f"run.dir={tmp_path}", "run.peak_flops=1e12"]) == status
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == line
    assert ("Traceback (most recent call last)" in err) == (status == 1)


def test_a_model_that_cannot_fit_is_refused_before_anything_is_written(tiny_overrides,
                                                                         tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*tiny_overrides, f"run.dir={run_dir}", "model.d_model=16384",
                 "model.mlp_dim=65536", "model.num_heads=128"]) == 2  # cannot run as configured
    err = capsys.readouterr().err
    assert "a train step of this 5,375,344,644-parameter model (parameters, gradients, " \
           "optimizer state: 86.0 GB per device" in err and "more than the" in err
    assert "mesh.fsdp" in err and err.count("\n") == 1
    assert not run_dir.exists()


def test_an_unwritable_run_dir_is_named_and_a_finished_one_still_reports(
        tiny_overrides, tmp_path, monkeypatch, capsys):
    args = [*tiny_overrides, f"run.dir={tmp_path}", "run.sample_tokens=0", "run.eval_batches=1"]
    assert main([*args, "run.steps=2"]) == 0
    config = (tmp_path / "config.yaml").read_text()
    capsys.readouterr()
    monkeypatch.setattr("os.access", lambda path, mode: Path(path) != tmp_path)  # read-only
    assert main([*args, "run.steps=2"]) == 0  # finished: nothing to write
    assert "validation after 2 steps" in capsys.readouterr().out
    assert main([*args, "run.steps=3"]) == 2
    assert f"cannot write in run.dir {tmp_path} (read-only or not yours)" in \
        capsys.readouterr().err
    assert (tmp_path / "config.yaml").read_text() == config
    assert main([*args, "run.dir=/proc/no/run"]) == 2
    assert "cannot create run.dir /proc/no/run (No such file or directory" in \
        capsys.readouterr().err


def test_an_impl_this_platform_cannot_run_fails_before_anything_is_written(
        tiny_overrides, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*tiny_overrides, f"run.dir={run_dir}", "model.impl=cudnn",
                 "model.dtype=bfloat16"]) == 2
    assert "impl='cudnn' runs cuDNN's flash attention, which needs a GPU" in \
        capsys.readouterr().err
    assert not run_dir.exists()


def test_a_log_file_gets_a_line_per_logged_step(tiny_overrides, tmp_path):
    """No progress bar off a terminal, so the loss of every logged step is printed."""
    result = run_cli([*tiny_overrides, f"run.dir={tmp_path}", "run.steps=4", "run.log_every=2",
                      "run.sample_tokens=0"])
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    assert "tokens/s, MFU" in lines[1] and "\r" not in result.stdout + result.stderr
