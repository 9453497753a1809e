"""Is the data pipeline ever the bottleneck? Its tokens/s against a training step's, on CPU.

    python benchmarks/data.py [--steps 5] [--batches 300] [--cache-dir DIR]

Measures (1) the grain pipeline of the default config (Shakespeare, 2k BPE, B=32, T=256):
batches per second after a warm-up, as tokens/s; (2) a jitted forward + backward + AdamW step
of the default tiny model (`ModelConfig()`: D=256, L=4, H=4, F=704, V=2048) on those batches,
as tokens/s. Prints both and their ratio; exits with status 1 if the pipeline is less than
REQUIRED_RATIO times faster.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import optax
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.data import DataConfig, build_tokenizer, make_train_iterator
from cem_jax.model import CEMTransformer

REQUIRED_RATIO = 20.0


def pipeline_tokens_per_s(cfg: DataConfig, tokenizer, batches: int) -> float:
    """Tokens (B·T per batch) the pipeline delivers per second, after 20 warm-up batches."""
    iterator = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
    for _ in range(20):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * cfg.batch_size * cfg.seq_len / (time.perf_counter() - start)


def train_step_tokens_per_s(cfg: DataConfig, tokenizer, steps: int) -> float:
    """Tokens per second of a jitted training step of the default tiny model (2 warm-up steps,
    the first compiles)."""
    model = CEMTransformer(ModelConfig(vocab_size=cfg.vocab_size), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    iterator = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
    for _ in range(2):
        jax.block_until_ready(train_step(model, optimizer, next(iterator)))
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(model, optimizer, next(iterator))
    jax.block_until_ready(loss)
    return steps * cfg.batch_size * cfg.seq_len / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--batches", type=int, default=300, help="timed pipeline batches")
    parser.add_argument("--cache-dir", default=None, help="data cache (default $CEM_JAX_CACHE)")
    args = parser.parse_args()
    cfg = DataConfig(cache_dir=args.cache_dir)
    tokenizer = build_tokenizer(cfg)
    pipeline = pipeline_tokens_per_s(cfg, tokenizer, args.batches)
    training = train_step_tokens_per_s(cfg, tokenizer, args.steps)
    ratio = pipeline / training
    print(f"batch B={cfg.batch_size} x T={cfg.seq_len}, {jax.device_count()} "
          f"{jax.default_backend()} device(s), {cfg.num_threads} pipeline thread(s)")
    print(f"pipeline:      {pipeline:14,.0f} tokens/s")
    print(f"training step: {training:14,.0f} tokens/s (default tiny model, fwd+bwd+AdamW)")
    verdict = "OK" if ratio >= REQUIRED_RATIO else "TOO SLOW"
    print(f"ratio:         {ratio:14,.1f}x  (required >= {REQUIRED_RATIO:.0f}x: {verdict})")
    return 0 if ratio >= REQUIRED_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
