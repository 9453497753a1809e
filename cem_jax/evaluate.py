"""Evaluation: loss (nats per token), perplexity and bits per byte of a model's parameters on a
split or any text. One function, `evaluate`, serves training's periodic validation and
`cem-eval --run DIR [--step N] [--text FILE | --corpus validation|milton]` (`cem_jax.cli.evaluate`,
through `evaluate_run`).

The text is packed and batched as training's validation split is (`cem_jax.data`: documents
separated by EOS, attention inside a document, the run's seq_len and batch size), and every
target is counted once, so bits per byte is exact: loss·tokens / bytes / ln 2. An evaluation of
only the first batches (training's `run.eval_batches`) reports `bits_per_byte_est` instead: the
loss of those tokens at the whole split's bytes per token.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
from tqdm import tqdm

from cem_jax.config import ModelConfig
from cem_jax.data import DataConfig, Tokenizer, load_tokens, make_eval_batches
from cem_jax.forward import EvalStep, make_eval_step
from cem_jax.sharding import global_batch, local_mesh

if TYPE_CHECKING:  # rundir imports the training stack, which imports this module
    from cem_jax.rundir import Run

def evaluate(params: dict, model_cfg: ModelConfig, data_cfg: DataConfig, tokenizer: Tokenizer,
             mesh: jax.sharding.Mesh, *, split: str = "validation",
             max_batches: int | None = None, eval_step: EvalStep | None = None,
             progress: str | None = None,
             check: Callable[[], None] | None = None) -> dict[str, float]:
    """{"loss" (nats/token), "perplexity", "bits_per_byte"} of `params` on `split` of
    `data_cfg` ("validation", or "milton"), over the whole split, or over its first
    `max_batches` batches: then "bits_per_byte_est" (the whole split's bytes per token) in
    place of "bits_per_byte". `eval_step`: a compiled `make_eval_step` to reuse; `progress`: a
    description to show a progress bar with; `check`: called before each batch (a stop check:
    what it raises ends the evaluation, e.g. `cem_jax.exits.check`). Every process calls
    it (batches are split across processes); each gets the same figures. Raises as
    `make_eval_batches`, and what `check` raises."""
    batches = make_eval_batches(data_cfg, tokenizer, split)
    stats = load_tokens(data_cfg, tokenizer, split).stats  # opened once per process
    count = len(batches) if max_batches is None else min(max_batches, len(batches))
    eval_step = eval_step or make_eval_step(model_cfg, mesh)
    loss_sum = weight_sum = 0.0
    with tqdm(total=stats.tokens if count == len(batches) else None, unit="tok", desc=progress,
              disable=progress is None, dynamic_ncols=True) as bar:
        def add(sums):  # a batch's sums, read once the next batch is dispatched
            nonlocal loss_sum, weight_sum
            loss, weight = jax.device_get(sums)
            loss_sum, weight_sum = loss_sum + float(loss), weight_sum + float(weight)
            bar.update(int(weight))
            bar.set_postfix(loss=f"{loss_sum / max(weight_sum, 1):.4f}")

        pending = None
        for i in range(count):
            if check is not None:
                check()
            sums = eval_step(params, global_batch(batches[i], mesh))
            if pending is not None:
                add(pending)
            pending = sums
        if pending is not None:
            add(pending)
    loss = loss_sum / weight_sum
    bpb = "bits_per_byte" if count == len(batches) else "bits_per_byte_est"
    return {"loss": loss, "perplexity": math.exp(loss), bpb: stats.bits_per_byte(loss)}


def bits_per_byte_of(result: dict[str, float]) -> float | None:
    """An `evaluate` result's (or metrics record's) bits per byte: the exact figure, else the
    estimate of a partial evaluation, else None."""
    return result.get("bits_per_byte", result.get("bits_per_byte_est"))


def describe(result: dict[str, float]) -> str:
    """'loss 1.2345 nats/token, perplexity 3.44, bits per byte 0.6789' ('bits per byte
    (estimate)' for a partial evaluation)."""
    estimate = " (estimate)" if "bits_per_byte" not in result else ""
    return (f"loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.2f}, "
            f"bits per byte{estimate} {bits_per_byte_of(result):.4f}")


def evaluate_run(run: Run, text: str | None = None, corpus: str = "validation",
                 progress: bool = True, allow_invalid_utf8: bool = False,
                 steps: int | None = None) -> dict[str, float]:
    """`evaluate` of a loaded run (`cem_jax.rundir.Run`) on a corpus spec `text` (a file, glob
    or `FORMAT:PATH` as `DataConfig.corpus` takes), or on the run's split `corpus`
    ("validation" or "milton") when `text` is None, on the local devices; adds "tokens" and
    "bytes" of the text; `progress`: a bar on a terminal. `allow_invalid_utf8` reads invalid
    UTF-8 bytes as U+FFFD (as the run's data.allow_invalid_utf8 does). `steps`: run every
    sub-layer for this many CEM steps instead of the trained `model.steps` (test-time
    recursion: the steps of a sub-layer share its weights, DESIGN.md §1, so the same
    parameters serve any count).

    Raises ValueError (unknown split, no validation split, empty or undecodable text, steps
    < 1), FileNotFoundError (missing files), `cem_jax.data.FetchError` (built-in corpus
    unavailable).
    """
    model_cfg = run.config.model if steps is None else dataclasses.replace(run.config.model,
                                                                           steps=steps)
    data = run.config.data
    if allow_invalid_utf8:
        data = dataclasses.replace(data, allow_invalid_utf8=True)
    if text is not None:  # the whole text as the validation split
        data = dataclasses.replace(data, val_corpus=text, val_fraction=0.0, val_tokens=None)
        corpus = "validation"
    elif corpus == "validation" and not data.has_validation:
        raise ValueError(f"{run.directory} was trained on {data.corpus!r} without a validation "
                         "split: evaluate a text instead (cem-eval --text FILE)")
    result = evaluate(run.params, model_cfg, data, run.tokenizer, local_mesh(), split=corpus,
                      progress=f"evaluating {text or corpus}"
                      if progress and sys.stderr.isatty() else None)
    stats = load_tokens(data, run.tokenizer, corpus).stats
    return {**result, "tokens": stats.tokens, "bytes": stats.bytes}
