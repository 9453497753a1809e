"""The batches of a step, from a run's splits (`cem_jax.data.pipeline.load_tokens`): the training
batches of each step (`make_train_iterator`) and the evaluation batches covering a split once
(`make_eval_batches`), as packed rows (`packed_batch`).

Packing. A split is one token stream

    EOS d1 EOS d2 EOS ... EOS dn EOS

A row is a window of T+1 consecutive tokens: inputs = window[:-1], targets = window[1:]. An EOS
in the inputs starts a document: `segment_ids` (1-based, per row) step up there and `positions`
restart at 0 (they also start at 0 at the row's first token). A document's segment is thus
[EOS, its tokens] and its targets are [its tokens, EOS]: with attention kept inside a segment,
each document is predicted from its own text alone, and its end is predicted too.
`SplitStats.tokens` counts those targets: every stream token but the first.

Training. Rows start at multiples of T, so an epoch shows every target once. The windows are
shuffled by `seed`, with a new permutation each epoch (grain `MapDataset.shuffle` + `repeat`,
indexed directly), giving one global sequence of rows; the batch of step s = 1, 2, … is
its rows (s-1)·B … s·B-1, and process p of P reads only its block of them, from row
(s-1)·B + p·B/P: the global batch of a step depends on the seed and the step alone, whatever
P, so a run resumes at its step on another process count, and the position is the step
(nothing else is saved).

Evaluation. `make_eval_batches` covers a split once (its first whole documents up to
`cfg.val_tokens` tokens, when set): rows of T targets back to back, the last row padded, whole
padding rows added so that every process gets the same number of batches; the `weights` mask
(1 for a real target) sums to `SplitStats.tokens` over all processes.

Reading. A batch's rows are read together (`TokenStream.read_many`): from a bucket as
concurrent range requests, a step in about one request's latency rather than one per row;
grain's `cfg.num_threads` threads read that many steps at once, and `cfg.prefetch` batches
are read ahead of the training loop. Neither changes which rows a step holds.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import grain
import jax
import numpy as np

from cem_jax.data.config import DataConfig
from cem_jax.data.pipeline import load_tokens
from cem_jax.data.shards import TokenStream
from cem_jax.data.tokenizers import Tokenizer


def make_train_iterator(cfg: DataConfig, tokenizer: Tokenizer, *, first_step: int = 0,
                        process_index: int | None = None,
                        process_count: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The training batches of steps `first_step` + 1, `first_step` + 2, … for one process.

    Each batch is a dict of int32 [B/P, T] arrays "inputs", "targets", "segment_ids",
    "positions" (B = cfg.batch_size, T = cfg.seq_len, P = process_count; process index and
    count default to `jax.process_index()` / `jax.process_count()`): the process's block of the
    step's global batch (module docstring). Raises ValueError: B is not divisible by P, the
    process index is out of range, or the training split is shorter than one row.
    """
    process_index, process_count = _process(cfg, process_index, process_count)
    data = load_tokens(cfg, tokenizer, "train")
    num_windows = (len(data.stream) - 1) // cfg.seq_len
    if num_windows == 0:
        raise ValueError(f"{data.description} has {len(data.stream)} tokens, fewer than one "
                         f"row of seq_len + 1 = {cfg.seq_len + 1}: lower seq_len or add text")
    windows = grain.MapDataset.range(num_windows).shuffle(seed=cfg.seed).repeat()
    rows = cfg.batch_size // process_count
    steps = grain.MapDataset.range(first_step, 2**62).map(functools.partial(
        _train_batch, windows=windows, stream=data.stream, batch_size=cfg.batch_size,
        rows=rows, offset=process_index * rows, seq_len=cfg.seq_len, eos_id=tokenizer.eos_id))
    options = grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch)
    return iter(steps.to_iter_dataset(options))


def make_eval_batches(cfg: DataConfig, tokenizer: Tokenizer, split: str = "validation", *,
                      process_index: int | None = None,
                      process_count: int | None = None) -> grain.MapDataset:
    """The whole of `split` once, as a finite, deterministic grain `MapDataset` of batches
    (`len()` batches, the same number on every process; iterate it or index it).

    Each batch: "inputs", "targets", "segment_ids", "positions" int32 [B/P, T] and "weights"
    float32 [B/P, T], 1 for a real target and 0 for padding (where inputs = pad id, segment id
    and position = 0). Mean loss = Σ weights·loss / Σ weights, in nats per token; bits per byte
    via `load_tokens(...).stats.bits_per_byte`. Raises ValueError as `make_train_iterator`
    (except that a split shorter than a row is fine).
    """
    process_index, process_count = _process(cfg, process_index, process_count)
    data = load_tokens(cfg, tokenizer, split)
    num_rows = -(-data.stats.tokens // cfg.seq_len)
    num_batches = -(-num_rows // cfg.batch_size)
    return (grain.MapDataset.range(num_batches * cfg.batch_size)[process_index::process_count]
            .batch(cfg.batch_size // process_count)
            .map(functools.partial(_eval_batch, stream=data.stream, seq_len=cfg.seq_len,
                                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)))


def packed_batch(rows: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Windows of the packed stream, int [B, T+1] → the int32 [B, T] batch arrays "inputs",
    "targets", "segment_ids" (1-based, a new one at each EOS input) and "positions"."""
    rows = rows.astype(np.int32)
    inputs = rows[:, :-1]
    return {"inputs": inputs, "targets": rows[:, 1:],
            "segment_ids": np.cumsum(_document_starts(inputs, eos_id), axis=1, dtype=np.int32),
            "positions": document_positions(inputs, eos_id)}


def document_positions(inputs: np.ndarray, eos_id: int | None) -> np.ndarray:
    """int32 [B, T] positions of input tokens int [B, T] within their document: 0 at each
    EOS (it starts a document) and at the row's first token, counting up in between (no EOS
    id: 0..T-1). Training's positions, and decoding's (`cem_jax.sample.generate`)."""
    steps = np.arange(inputs.shape[1], dtype=np.int32)
    if eos_id is None:
        return np.broadcast_to(steps, inputs.shape).copy()
    starts = np.where(_document_starts(inputs, eos_id), steps, 0)
    return steps - np.maximum.accumulate(starts, axis=1)


def _document_starts(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    starts = inputs == eos_id
    starts[:, 0] = True
    return starts


def _train_batch(step: int, *, windows: grain.MapDataset, stream: TokenStream,
                 batch_size: int, rows: int, offset: int, seq_len: int,
                 eos_id: int) -> dict[str, np.ndarray]:
    first = step * batch_size + offset  # its block of the rows of step `step` + 1
    starts = [windows[first + j] * seq_len for j in range(rows)]
    tokens = np.stack(stream.read_many(starts, [s + seq_len + 1 for s in starts]))
    return packed_batch(tokens, eos_id)


def _eval_batch(rows: np.ndarray, *, stream: TokenStream, seq_len: int, eos_id: int,
                pad_id: int) -> dict[str, np.ndarray]:
    total = len(stream)
    starts = [min(int(row) * seq_len, total) for row in rows]
    windows = np.full((len(rows), seq_len + 1), pad_id, np.int32)
    for window, got in zip(windows, stream.read_many(
            starts, [min(s + seq_len + 1, total) for s in starts]), strict=True):
        window[:len(got)] = got
    offsets = rows[:, None] * seq_len + np.arange(seq_len + 1)
    valid = offsets < total
    batch = packed_batch(windows, eos_id)
    weights = valid[:, 1:]
    batch["inputs"] = np.where(weights, batch["inputs"], pad_id)
    batch["segment_ids"] *= weights
    batch["positions"] *= weights
    batch["weights"] = weights.astype(np.float32)
    return batch


def _process(cfg: DataConfig, process_index: int | None,
             process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if cfg.batch_size % process_count:
        raise ValueError(f"batch_size {cfg.batch_size} (global) is not divisible by "
                         f"process_count {process_count}")
    return process_index, process_count


