"""Benchmark of the chunked cross entropy (issue #24): the compiled train step's temporary bytes
(XLA's memory analysis) and tokens/s, with the loss in `model.loss_chunks` chunks of the
sequence (`cem_jax.loss`; the default 4) against the same step on the whole fp32 logits [B,T,V] with
optax's `softmax_cross_entropy_with_integer_labels` under `jax.grad` (what the train step did
before, and what nanoGPT and MaxText without vocabulary tiling do). Same model, batch and
optimizer; the steps timed interleaved in one run (`timing.median_times`).

    python benchmarks/loss.py                              # V = 32,768, then V = 2,048
    python benchmarks/loss.py --vocab 32768 --chunks 4 16 data.batch_size=16

Targets: temporary bytes ≥ 2× lower at V = 32,768; tokens/s ≥ 0.97× the whole-logits step.
"""

import argparse
import os

import jax
import numpy as np
import optax
from timing import median_times

from cem_jax.loss import chunk_length
from cem_jax.model import model_from_params
from cem_jax.sharding import global_batch, make_mesh
from cem_jax.train.step import Trainer
from cem_jax.train_config import load_config


class WholeLogitsTrainer(Trainer):
    """The baseline: the train step on the whole logits (the model's own head)."""

    def loss(self, params, batch):
        model = model_from_params(self.model_cfg, params)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            logits = model(batch["inputs"], batch["positions"], batch["segment_ids"]).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def contender(cfg, batch, trainer_class):
    """(zero-argument function running one train step, compiled temporary bytes)."""
    mesh = make_mesh(cfg.mesh)
    trainer = trainer_class(cfg.model, cfg.optimizer, cfg.run.steps, mesh)
    holder = {"state": trainer.init(0)}
    batch = global_batch(batch, mesh)
    compiled = trainer.train_step.lower(holder["state"], batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes

    def run():
        holder["state"], metrics = trainer.train_step(holder["state"], batch)
        return metrics

    return run, temp


def compare(config: str, vocab: int, chunk_counts: list[int], overrides: list[str],
            repeats: int) -> None:
    base = load_config(config, [*overrides, f"model.vocab_size={vocab}", "data.vocab_size=null"])
    B, T = base.data.batch_size, base.data.seq_len
    tokens = np.random.default_rng(0).integers(4, vocab, (B, T + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "segment_ids": np.ones((B, T), np.int32),
             "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}
    rows = {"whole logits (optax)": contender(base, batch, WholeLogitsTrainer)}
    for chunks in chunk_counts:
        cfg = load_config(config, [*overrides, f"model.vocab_size={vocab}",
                                   "data.vocab_size=null", f"model.loss_chunks={chunks}"])
        rows[f"{chunks} chunks of {chunk_length(T, chunks)}"] = contender(cfg, batch, Trainer)
    times = median_times({name: fn for name, (fn, _) in rows.items()}, repeats=repeats)
    m = base.model
    print(f"\nV={vocab} D={m.d_model} L={m.num_layers} B={B} T={T} dtype={m.dtype}; whole fp32 "
          f"logits {B * T * vocab * 4 / 2**20:.0f} MiB")
    print(f"{'train step':<26}{'temp MiB':>10}{'vs whole':>10}{'tokens/s':>12}{'vs whole':>10}")
    base_temp, base_time = rows["whole logits (optax)"][1], times["whole logits (optax)"]
    for name, (_, temp) in rows.items():
        print(f"{name:<26}{temp / 2**20:>10.1f}{base_temp / temp:>9.2f}x"
              f"{B * T / times[name]:>12,.0f}{base_time / times[name]:>9.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/shakespeare_cem.yaml")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 2048])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 2, 8],
                        help="values of model.loss_chunks to time")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}; "
          f"temp = XLA's compiled temporary bytes of the whole train step")
    for vocab in args.vocab:
        compare(args.config, vocab, args.chunks, args.overrides, args.repeats)


if __name__ == "__main__":
    main()
