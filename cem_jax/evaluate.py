"""`cem-eval --run DIR [--step N] [--text FILE | --corpus validation|milton]`: loss (nats per
token), perplexity and bits per byte of a checkpoint on any text, with a progress bar.

The text is packed and batched as training's validation split is (`cem_jax.data`: documents
separated by EOS, attention inside a document, the run's seq_len and batch size), and every
target is counted once, so bits per byte is exact: loss·tokens / bytes / ln 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence

import jax
from tqdm import tqdm

from cem_jax.data import load_tokens, make_eval_batches
from cem_jax.rundir import Run, load_run, quiet_checkpoint_logs
from cem_jax.train.checkpoint import CheckpointError
from cem_jax.train.config import MeshConfig
from cem_jax.train.sharding import global_batch, make_mesh
from cem_jax.train.step import Trainer


def evaluate_run(run: Run, text: str | None = None, corpus: str = "validation",
                 progress: bool = True, allow_invalid_utf8: bool = False) -> dict[str, float]:
    """{"loss", "perplexity", "bits_per_byte", "tokens", "bytes"} of `run` on a corpus spec
    `text` (a file, glob or `FORMAT:PATH` as `DataConfig.corpus` takes), or on the run's split
    `corpus` ("validation" or "milton") when `text` is None. `allow_invalid_utf8` reads invalid
    UTF-8 bytes as U+FFFD (as the run's data.allow_invalid_utf8 does).

    Raises ValueError (unknown split, no validation split, empty or undecodable text),
    FileNotFoundError (missing files), `cem_jax.data.FetchError` (built-in corpus unavailable).
    """
    data = run.config.data
    if allow_invalid_utf8:
        data = dataclasses.replace(data, allow_invalid_utf8=True)
    if text is not None:
        data, corpus = dataclasses.replace(data, val_corpus=text), "validation"
    elif corpus == "validation" and not data.has_validation:
        raise ValueError(f"{run.directory} was trained on {data.corpus!r} without a validation "
                         "split: evaluate a text instead (cem-eval --text FILE)")
    mesh = make_mesh(MeshConfig(data=-1), jax.local_devices())
    trainer = Trainer(run.config.model, run.config.optimizer, run.config.run.steps, mesh)
    batches = make_eval_batches(data, run.tokenizer, corpus)
    stats = load_tokens(data, run.tokenizer, corpus).stats
    loss_sum = weight_sum = 0.0
    with tqdm(total=stats.tokens, unit="tok", desc=f"evaluating {text or corpus}",
              disable=not progress, dynamic_ncols=True) as bar:
        for batch in batches:
            loss, weight = jax.device_get(trainer.eval_step(run.params, global_batch(batch,
                                                                                      mesh)))
            loss_sum, weight_sum = loss_sum + float(loss), weight_sum + float(weight)
            bar.update(int(weight))
            bar.set_postfix(loss=f"{loss_sum / max(weight_sum, 1):.4f}")
    loss = loss_sum / weight_sum
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte":
            stats.bits_per_byte(loss), "tokens": stats.tokens, "bytes": stats.bytes}


def main(argv: Sequence[str] | None = None) -> int:
    """`cem-eval`; returns the exit status (0 ok, 1 the run or the text cannot be read)."""
    parser = argparse.ArgumentParser(prog="cem-eval", description="Loss, perplexity and bits "
                                     "per byte of a checkpoint on a text.")
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--text", help="text to evaluate on: a file, a glob, or FORMAT:PATH "
                       "(text, jsonl, arrayrecord)")
    where.add_argument("--corpus", default="validation", choices=("validation", "milton"),
                       help="a built-in split of the run (default: validation)")
    parser.add_argument("--allow-invalid-utf8", action="store_true",
                        help="read invalid UTF-8 bytes as U+FFFD instead of refusing the text")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from cem_jax.data import FetchError

    quiet_checkpoint_logs()
    try:
        run = load_run(args.run, args.step)
        result = evaluate_run(run, args.text, args.corpus, progress=not args.no_progress,
                              allow_invalid_utf8=args.allow_invalid_utf8)
    except (FileNotFoundError, CheckpointError, FetchError, ValueError) as err:
        print(f"cem-eval: error: {err}", file=sys.stderr)
        return 1
    what = args.text or args.corpus
    print(f"{what} at step {run.step}: loss {result['loss']:.4f} nats/token, perplexity "
          f"{result['perplexity']:.2f}, bits per byte {result['bits_per_byte']:.4f} "
          f"({result['tokens']:,} tokens, {result['bytes']:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
