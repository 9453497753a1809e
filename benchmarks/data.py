"""Is the data pipeline ever the bottleneck? Its tokens/s against a training step's, on CPU.

    python benchmarks/data.py [--steps 5] [--batches 300] [--config configs/X.yaml]

Measures, for the config of `make train` (configs/shakespeare_cem.yaml: Shakespeare, 2k BPE):
(1) its grain pipeline, batches per second after a warm-up, as tokens/s; (2) the compiled train
step of `cem_jax.train` (forward, backward, clipping, AdamW) on those batches, as tokens/s.
Prints both and their ratio; exits with status 1 if the pipeline is less than REQUIRED_RATIO
times faster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

from cem_jax.data import DataConfig, build_tokenizer, make_train_iterator
from cem_jax.sharding import global_batch, make_mesh
from cem_jax.train.config import TrainConfig, load_config
from cem_jax.train.step import Trainer

REQUIRED_RATIO = 20.0
REPO = Path(__file__).resolve().parent.parent


def pipeline_tokens_per_s(cfg: DataConfig, tokenizer, batches: int) -> float:
    """Tokens (B·T per batch) the pipeline delivers per second, after 20 warm-up batches."""
    iterator = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
    for _ in range(20):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * cfg.batch_size * cfg.seq_len / (time.perf_counter() - start)


def train_step_tokens_per_s(cfg: TrainConfig, tokenizer, steps: int) -> float:
    """Tokens per second of the compiled train step of `cfg` (2 warm-up steps: the first
    compiles)."""
    trainer = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, make_mesh(cfg.mesh))
    state = trainer.init(cfg.run.seed)
    iterator = make_train_iterator(cfg.data, tokenizer, process_index=0, process_count=1)
    batches = [global_batch(next(iterator), trainer.mesh) for _ in range(steps + 2)]
    for batch in batches[:2]:
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for batch in batches[2:]:
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    return steps * cfg.data.batch_size * cfg.data.seq_len / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--batches", type=int, default=300, help="timed pipeline batches")
    parser.add_argument("--config", default=str(REPO / "configs" / "shakespeare_cem.yaml"))
    args = parser.parse_args()
    train_cfg = load_config(args.config)
    cfg = train_cfg.data
    tokenizer = build_tokenizer(cfg)
    pipeline = pipeline_tokens_per_s(cfg, tokenizer, args.batches)
    training = train_step_tokens_per_s(train_cfg, tokenizer, args.steps)
    ratio = pipeline / training
    print(f"batch B={cfg.batch_size} x T={cfg.seq_len}, {jax.device_count()} "
          f"{jax.default_backend()} device(s), {cfg.num_threads} pipeline thread(s)")
    print(f"pipeline:      {pipeline:14,.0f} tokens/s")
    print(f"training step: {training:14,.0f} tokens/s ({args.config}, fwd+bwd+AdamW)")
    verdict = "OK" if ratio >= REQUIRED_RATIO else "TOO SLOW"
    print(f"ratio:         {ratio:14,.1f}x  (required >= {REQUIRED_RATIO:.0f}x: {verdict})")
    return 0 if ratio >= REQUIRED_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
