"""`run.init_from`: a new run starts from another run's parameters (nanoGPT's `init_from`) and
fine-tunes them on another corpus, with a fresh optimizer; the model section and tokenizer are
checked; a started fine-tune resumes from its own checkpoints. And the Trainer's step with a
model in hand, as a notebook has one."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import VOCAB, _documents
from flax import nnx
from train_helpers import train_losses

from cem_jax import CEMTransformer, MeshConfig, ModelConfig, OptimizerConfig
from cem_jax.cli.train import main
from cem_jax.data import load_tokenizer, make_train_iterator, train_tokenizer
from cem_jax.rundir import load_run
from cem_jax.sharding import global_batch, make_mesh
from cem_jax.train import load_config, train
from cem_jax.train.resume import model_changes
from cem_jax.train.step import Trainer


@pytest.fixture(scope="module")
def pretrained(tiny_overrides, tmp_path_factory):
    """A tiny run trained for 6 steps on the shared corpus."""
    run_dir = tmp_path_factory.mktemp("pretrained")
    train(load_config(None, [*tiny_overrides, f"run.dir={run_dir}", "run.steps=6"]))
    return run_dir


def _other_corpus(root):
    """Another corpus (other documents), with validation."""
    for split, docs in (("train", _documents(6, 7)), ("val", _documents(1, 8))):
        (root / split).mkdir(parents=True)
        for i, doc in enumerate(docs):
            (root / split / f"doc{i}.txt").write_text(doc)
    return [f"data.corpus={root / 'train'}/*.txt", f"data.val_corpus={root / 'val'}/*.txt"]


@pytest.mark.slow
def test_fine_tune_starts_from_the_trained_parameters(tiny_overrides, pretrained, tmp_path):
    corpus = _other_corpus(tmp_path / "other")
    run_dir = tmp_path / "tuned"
    overrides = [*tiny_overrides, *corpus, f"run.dir={run_dir}", "run.steps=3",
                 f"run.init_from={pretrained}", "run.init_step=6", "optimizer.lr=3e-3",
                 "optimizer.warmup_steps=1"]
    summary = train(load_config(None, overrides))
    assert summary["step"] == 3  # its own steps, from 0: a fresh optimizer, not a resume

    # step 1's loss is the pretrained parameters' loss on the new corpus's first batch
    cfg = load_config(None, overrides)
    source = load_run(pretrained, 6)
    mesh = make_mesh(cfg.mesh)
    trainer = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, mesh)
    batch = global_batch(next(make_train_iterator(cfg.data, source.tokenizer)), mesh)
    want = float(jax.jit(trainer.loss)(trainer.init_from_params(source.params)["params"],
                                       batch))
    assert train_losses(run_dir)[1] == pytest.approx(want, rel=1e-6)
    fresh = float(jax.jit(trainer.loss)(trainer.init(cfg.run.seed)["params"], batch))
    assert abs(want - fresh) > 0.1  # the pretrained start is not a fresh one

    tuned = load_run(run_dir)
    assert tuned.tokenizer.sha256 == source.tokenizer.sha256
    assert tuned.config.run.init_from == str(pretrained)
    moved = [float(np.max(np.abs(a - b))) for a, b in
             zip(jax.tree.leaves(tuned.params), jax.tree.leaves(source.params), strict=True)]
    assert max(moved) > 0  # it trained
    # started again, it resumes its own run (step 3 → 5), not the pretrained one; another
    # init_from given then is not used, and config.yaml keeps how the run began
    again = [*overrides, "run.steps=5", f"run.init_from={run_dir}", "run.init_step=null"]
    assert train(load_config(None, again))["step"] == 5
    assert sorted(train_losses(run_dir)) == [1, 2, 3, 4, 5]
    kept = load_run(run_dir).config.run
    assert (kept.init_from, kept.init_step, kept.steps) == (str(pretrained), 6, 5)


def test_another_model_or_tokenizer_is_refused(tiny_overrides, pretrained, tmp_path, capsys):
    base = [*tiny_overrides, f"run.init_from={pretrained}", "run.steps=2"]
    assert main([*base, f"run.dir={tmp_path / 'a'}", "model.d_model=48"]) == 2
    err = capsys.readouterr().err
    assert "holds a model with a different model section" in err
    assert "'model.d_model': (32, 48)" in err
    assert not (tmp_path / "a").exists()  # a failed start leaves nothing behind

    texts = _documents(4, 9)
    other = train_tokenizer(texts, VOCAB, tmp_path / "other.model")  # saved there
    assert other.sha256 != load_tokenizer(pretrained / "tokenizer.model").sha256
    tokenizer = f"data.tokenizer={tmp_path / 'other.model'}"
    assert main([*base, f"run.dir={tmp_path / 'b'}", tokenizer]) == 2
    assert "is not the tokenizer of run.init_from" in capsys.readouterr().err

    assert main([*base, f"run.dir={tmp_path / 'c'}", "run.init_step=4"]) == 2
    assert "has no checkpoint of step 4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'run.init_step' = 3 is invalid: it must be null unless"):
        load_config(None, ["run.init_step=3"])


def test_the_train_step_takes_a_model_in_hand_and_gives_it_back():
    # a notebook's model: the product's step trains it, and nnx.update puts the result back
    cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, mlp_dim=24)
    model = CEMTransformer(cfg, rngs=nnx.Rngs(3))
    trainer = Trainer(cfg, OptimizerConfig(lr=1e-2, warmup_steps=1), 20,
                      make_mesh(MeshConfig()))
    state = trainer.init_from_params(nnx.to_pure_dict(nnx.state(model)))
    np.testing.assert_array_equal(state["params"]["embed"], model.embed[...])
    tokens = np.tile(np.arange(17) % 4, (8, 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1)),
             "segment_ids": np.zeros((8, 16), np.int32)}
    losses = []
    for _ in range(20):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses  # a cycle of 4 is learned
    nnx.update(model, jax.device_get(state["params"]))
    np.testing.assert_array_equal(model.embed[...], state["params"]["embed"])


def test_a_null_and_the_value_it_stands_for_are_the_same_model():
    """cem-import writes num_kv_heads and head_dim out; a config leaving them null (G = H,
    K = D / H) names the same model, for init_from and a resume alike."""
    base = ModelConfig(vocab_size=64, d_model=32, num_heads=2, mlp_dim=48)
    keys = list(dataclasses.asdict(base))
    assert model_changes(base, dataclasses.replace(base, num_kv_heads=2, head_dim=16), keys) == {}
    assert model_changes(base, dataclasses.replace(base, d_model=64), keys) == {
        "model.d_model": (32, 64)}  # head_dim follows, null in both: not a change of its own
    assert model_changes(base, dataclasses.replace(base, num_kv_heads=1), keys) == {
        "model.num_kv_heads": (None, 1)}
