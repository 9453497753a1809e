"""From a `DataConfig` to batches: its tokenizer, cached token streams, and grain pipelines.

Packing. A split's documents become one token stream

    EOS d1 EOS d2 EOS ... EOS dn EOS

(EOS before, between and after the documents). A row is a window of T+1 consecutive stream
tokens: inputs = window[:-1], targets = window[1:]. An EOS in the inputs starts a document:
`segment_ids` (1-based, per row) step up there and `positions` restart at 0 (they also start at
0 at the row's first token). A document's segment is thus [EOS, its tokens] and its targets are
[its tokens, EOS]: with attention kept inside a segment, each document is predicted from its own
text alone, and its end is predicted too. `SplitStats.tokens` counts those targets: every
stream token but the first, i.e. the documents' tokens plus one EOS each.

Training. Rows start at multiples of T, so an epoch shows every target once. The windows are
shuffled by `seed`, with a new permutation each epoch (grain `MapDataset.shuffle` + `repeat`),
and that global sequence is dealt round-robin: process p of P takes elements p, p+P, p+2P, ...
and batches B/P of them. Step k's batches over all processes are the same rows whatever P, and
no two processes share a row within an epoch. Batches are built in `num_threads` grain threads,
`prefetch` ahead. The iterator's `get_state()` is {"next_index": int} (JSON; grain's orbax
`CheckpointHandler` saves it per process); `set_state` on an iterator made from the same config
and tokenizer continues with exactly the batches that would have come next.

Evaluation. `make_eval_batches` covers a split once: rows of T targets back to back, the last row
padded, whole padding rows added so that every process gets the same number of batches; the
`weights` mask (1 for a real target) sums to `SplitStats.tokens` over all processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import grain
import jax
import numpy as np
from tqdm import tqdm

from cem_jax.data.cache import CacheError, read_tokens, token_dtype, write_tokens
from cem_jax.data.config import DataConfig
from cem_jax.data.corpus import Document, Split, cache_root, resolve_split
from cem_jax.data.tokenizer import TRAINER_VERSION, Tokenizer, load_tokenizer, train_tokenizer

PACKING_VERSION = 1  # bump when the stream layout changes: it invalidates cached token files
# Token files read and verified in this process: (path, key, size, mtime_ns) → their split.
_LOADED: dict[tuple[str, str, int, int], TokenizedSplit] = {}
ENCODE_BATCH_CHARS = 1 << 22  # characters handed to sentencepiece at once


@dataclasses.dataclass(frozen=True)
class SplitStats:
    """Size of a split: `documents`; `tokens`, the targets of one pass (document tokens plus
    one EOS per document); `bytes`, the UTF-8 bytes of the documents' text."""

    documents: int
    tokens: int
    bytes: int

    @property
    def bytes_per_token(self) -> float:
        """Mean UTF-8 bytes of text per target token (how much the tokenizer compresses)."""
        return self.bytes / self.tokens

    def bits_per_byte(self, loss_nats_per_token: float) -> float:
        """Mean loss (nats per target token) → bits per UTF-8 byte: loss·tokens / bytes / ln 2."""
        return loss_nats_per_token * self.tokens / self.bytes / math.log(2)


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """A split's packed stream: `tokens` [N] uint16/uint32 (read-only memmap, N = stats.tokens
    + 1), its `stats`, the cache file `path` and the split's `description`."""

    name: str
    description: str
    tokens: np.ndarray
    stats: SplitStats
    path: Path


def build_tokenizer(cfg: DataConfig, check: Callable[[], None] | None = None) -> Tokenizer:
    """The tokenizer of `cfg`: `cfg.tokenizer` loaded, or a BPE model of `cfg.vocab_size` pieces
    trained on the training split (cached under `cache_dir/tokenizers/`, keyed by the split's
    fingerprint). Save it with the run: `build_tokenizer(cfg).save(run_dir / "tokenizer.model")`.
    `check`: called before each document is read for the training (a stop check: what it raises
    ends the build, and nothing is cached).

    Raises FileNotFoundError / ValueError as `load_tokenizer`, `train_tokenizer` and
    `resolve_split` do (e.g. a vocab size that disagrees with `cfg.vocab_size`), and what
    `check` raises.
    """
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer, expected_vocab_size=cfg.vocab_size)
    split = resolve_split(cfg, "train")
    key = _hash([TRAINER_VERSION, split.fingerprint(), cfg.vocab_size])
    path = cache_root(cfg) / "tokenizers" / f"bpe{cfg.vocab_size}-{key[:16]}.model"
    if path.is_file():
        try:
            return load_tokenizer(path, expected_vocab_size=cfg.vocab_size)
        except ValueError as err:
            warnings.warn(f"cached tokenizer unusable ({err}); training it again", stacklevel=2)
    return train_tokenizer((doc.text for doc in _checked(split.documents(), check)),
                           cfg.vocab_size, path)


def load_tokens(cfg: DataConfig, tokenizer: Tokenizer, split: str,
                check: Callable[[], None] | None = None) -> TokenizedSplit:
    """The packed token stream of `split` ("train", "validation", "milton"), tokenized once and
    cached in `cache_dir/tokens/` under a key of (split fingerprint, tokenizer SHA-256); a
    cache file that fails verification is reported (a warning) and rebuilt. A file is read and
    verified (SHA-256) once per process: later calls return the same `TokenizedSplit` while
    the file is unchanged on disk (same size and modification time). `check`: called before
    each document is tokenized (a stop check: what it raises ends the tokenization, and no
    cache file is written).

    Raises as `resolve_split` and `Split.documents` do (missing files, invalid UTF-8, empty),
    and what `check` raises.
    """
    source = resolve_split(cfg, split)
    key = _hash([PACKING_VERSION, source.fingerprint(), tokenizer.sha256])
    path = cache_root(cfg) / "tokens" / f"{split}-{key[:16]}.bin"
    with contextlib.suppress(FileNotFoundError):
        stat = path.stat()
        loaded = _LOADED.get((str(path.absolute()), key, stat.st_size, stat.st_mtime_ns))
        if loaded is not None:
            return loaded
    try:
        tokens, header = read_tokens(path, key)
    except FileNotFoundError:
        tokens = None
    except CacheError as err:
        warnings.warn(f"token cache unusable, rebuilding it: {err}", stacklevel=2)
        tokens = None
    if tokens is None:
        counts = {"documents": 0, "bytes": 0}
        write_tokens(path, _token_chunks(source, tokenizer, counts, check),
                     token_dtype(tokenizer.vocab_size),
                     lambda: {"key": key, "split": split, **counts})
        tokens, header = read_tokens(path, key)
    stats = SplitStats(header["documents"], header["num_tokens"] - 1, header["bytes"])
    loaded = TokenizedSplit(split, source.description, tokens, stats, path)
    stat = path.stat()
    _LOADED[(str(path.absolute()), key, stat.st_size, stat.st_mtime_ns)] = loaded
    return loaded


def make_train_iterator(cfg: DataConfig, tokenizer: Tokenizer, *,
                        process_index: int | None = None,
                        process_count: int | None = None) -> grain.DatasetIterator:
    """An endless iterator of training batches for one process.

    Each batch is a dict of int32 [B/P, T] arrays "inputs", "targets", "segment_ids",
    "positions" (B = cfg.batch_size, T = cfg.seq_len, P = process_count; process index and
    count default to `jax.process_index()` / `jax.process_count()`).
    Resuming: `get_state()` is a JSON-able dict; `set_state(state)` on an iterator made from
    the same config, tokenizer and process layout continues with the very next batch.
    Raises ValueError: the tokenizer's vocab size is not `cfg.vocab_size`, B is not divisible
    by P, the process index is out of range, or the training split is shorter than one row.
    """
    process_index, process_count = _process(cfg, tokenizer, process_index, process_count)
    data = load_tokens(cfg, tokenizer, "train")
    num_windows = (len(data.tokens) - 1) // cfg.seq_len
    if num_windows == 0:
        raise ValueError(f"{data.description} has {len(data.tokens)} tokens, fewer than one row "
                         f"of seq_len + 1 = {cfg.seq_len + 1}: lower seq_len or add text")
    dataset = (grain.MapDataset.range(num_windows).shuffle(seed=cfg.seed).repeat()
               [process_index::process_count]
               .batch(cfg.batch_size // process_count, drop_remainder=True)
               .map(functools.partial(_train_batch, tokens=data.tokens, seq_len=cfg.seq_len,
                                      eos_id=tokenizer.eos_id)))
    options = grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch)
    return iter(dataset.to_iter_dataset(options))


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
    process_index, process_count = _process(cfg, tokenizer, process_index, process_count)
    data = load_tokens(cfg, tokenizer, split)
    num_rows = -(-data.stats.tokens // cfg.seq_len)
    num_batches = -(-num_rows // cfg.batch_size)
    return (grain.MapDataset.range(num_batches * cfg.batch_size)[process_index::process_count]
            .batch(cfg.batch_size // process_count)
            .map(functools.partial(_eval_batch, tokens=data.tokens, seq_len=cfg.seq_len,
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


def _train_batch(windows: np.ndarray, *, tokens: np.ndarray, seq_len: int,
                 eos_id: int) -> dict[str, np.ndarray]:
    offsets = windows[:, None] * seq_len + np.arange(seq_len + 1)
    return packed_batch(tokens[offsets], eos_id)


def _eval_batch(rows: np.ndarray, *, tokens: np.ndarray, seq_len: int, eos_id: int,
                pad_id: int) -> dict[str, np.ndarray]:
    offsets = rows[:, None] * seq_len + np.arange(seq_len + 1)
    valid = offsets < len(tokens)
    batch = packed_batch(np.where(valid, tokens[np.minimum(offsets, len(tokens) - 1)], pad_id),
                         eos_id)
    weights = valid[:, 1:]
    batch["inputs"] = np.where(weights, batch["inputs"], pad_id)
    batch["segment_ids"] *= weights
    batch["positions"] *= weights
    batch["weights"] = weights.astype(np.float32)
    return batch


def _token_chunks(split: Split, tokenizer: Tokenizer, counts: dict[str, int],
                  check: Callable[[], None] | None) -> Iterator[np.ndarray]:
    """The packed stream of `split` in pieces; fills `counts` (documents, bytes) on the way."""
    yield np.array([tokenizer.eos_id])
    texts, size = [], 0
    with tqdm(desc=f"tokenizing {split.description}", unit="B", unit_scale=True,
              disable=None) as progress:
        for doc in _checked(split.documents(), check):
            texts.append(doc.text)
            size += len(doc.text)
            if size >= ENCODE_BATCH_CHARS:
                yield _encode(texts, tokenizer, counts, progress)
                texts, size = [], 0
        if texts:
            yield _encode(texts, tokenizer, counts, progress)


def _checked(documents: Iterator[Document], check: Callable[[], None] | None
             ) -> Iterator[Document]:
    """`documents`, calling `check` (if given) before each."""
    for doc in documents:
        if check is not None:
            check()
        yield doc


def _encode(texts: list[str], tokenizer: Tokenizer, counts: dict[str, int],
            progress: tqdm) -> np.ndarray:
    """Documents → their tokens, each followed by EOS, as one array."""
    stream: list[int] = []
    for text, ids in zip(texts, tokenizer.encode_batch(texts), strict=True):
        stream += ids
        stream.append(tokenizer.eos_id)
        size = len(text.encode("utf-8"))
        counts["documents"] += 1
        counts["bytes"] += size
        progress.update(size)
    return np.array(stream, dtype=np.int64)


def _process(cfg: DataConfig, tokenizer: Tokenizer, process_index: int | None,
             process_count: int | None) -> tuple[int, int]:
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"tokenizer has vocab_size {tokenizer.vocab_size} but the data config "
                         f"says vocab_size {cfg.vocab_size}")
    if process_index is None or process_count is None:
        process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if cfg.batch_size % process_count:
        raise ValueError(f"batch_size {cfg.batch_size} (global) is not divisible by "
                         f"process_count {process_count}")
    return process_index, process_count


def _hash(identity: list) -> str:
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()
