"""A tokenized dataset: the token shards of one source and the manifest that joins them, in a
folder on a local disk or a bucket (`cem_jax.data.files`). `cem_jax.data.tokenize` writes it,
`TokenStream` reads it.

Layout of a dataset folder ROOT:

    ROOT/manifest.json         the dataset, written last: a dataset exists once it does
    ROOT/tokenizer.*           its tokenizer (`tokenizer.model` or `tokenizer.json`)
    ROOT/units/UUUUU.json      a unit of work's record, written after the unit's shards
    ROOT/SPLIT/UUUUU.bin       the unit's tokens of SPLIT, little-endian uint16 (V ≤ 65536) or
                               uint32: SPLIT is "documents", or "held_out" (documents held out
                               for validation, `held_out_fraction`)
    ROOT/SPLIT/UUUUU.docs      its documents' sizes: uint32 pairs (tokens with their EOS, bytes)

Packing. A shard holds, for each of its documents, EOS and then the document's tokens; a split
is its shards in unit order followed by one more EOS:

    EOS d1 EOS d2 ... EOS dn EOS

(the stream of `cem_jax.data.pipeline`). The manifest gives every shard's tokens, documents,
UTF-8 bytes and SHA-256; reading checks sizes (cheap: a truncated shard is named) and token ids
(an id past the vocabulary is named), and `verify` checks every checksum.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np

from cem_jax.data import files

VERSION = 1  # bump when the layout or the packing changes
FORMAT = "cem_jax tokenized dataset"
MANIFEST = "manifest.json"
SPLITS = ("documents", "held_out")
OPEN_SHARDS = 64  # local shards a TokenStream keeps open


class DatasetError(ValueError):
    """A tokenized dataset is missing, of another kind, or damaged (the message names it)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype holding ids < vocab_size."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(split: str, unit: int, suffix: str = ".bin") -> str:
    """"documents/00042.bin": a shard's path inside its dataset."""
    return f"{split}/{unit:05d}{suffix}"


def unit_record_name(unit: int) -> str:
    return f"units/{unit:05d}.json"


class ShardWriter:
    """The shards of one unit, one per split that gets a document, written as documents come:

        with ShardWriter(root, unit, dtype, eos_id) as writer:
            writer.add("documents", ids, num_bytes)
        writer.stats   # {split: {"tokens", "documents", "bytes", "sha256"}}

    A shard appears whole or not at all (`files.writing`): nothing of a unit whose block
    raised (an interrupted or failed tokenization) is left."""

    def __init__(self, root: str, unit: int, dtype: np.dtype, eos_id: int):
        self.root, self.unit, self.dtype, self.eos = root, unit, dtype, eos_id
        self.stack = ExitStack()
        self.out: dict[str, Any] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        self.sizes: dict[str, list[tuple[int, int]]] = {}
        self.digests: dict[str, Any] = {}

    def __enter__(self) -> ShardWriter:
        return self

    def add(self, split: str, ids: list[int], num_bytes: int) -> None:
        """Document `ids` (its tokens, without EOS) of `num_bytes` UTF-8 bytes into `split`."""
        if split not in self.out:
            self.out[split] = self.stack.enter_context(
                files.writing(files.join(self.root, shard_name(split, self.unit))))
            self.stats[split] = {"tokens": 0, "documents": 0, "bytes": 0}
            self.sizes[split], self.digests[split] = [], hashlib.sha256()
        data = np.asarray([self.eos, *ids], self.dtype).tobytes()
        self.out[split].write(data)
        self.digests[split].update(data)
        stats = self.stats[split]
        stats["tokens"] += len(ids) + 1
        stats["documents"] += 1
        stats["bytes"] += num_bytes
        self.sizes[split].append((len(ids) + 1, num_bytes))

    def __exit__(self, *exc) -> None:
        self.stack.__exit__(*exc)  # on an error: every open shard is discarded
        if exc[0] is not None:
            return
        for split, sizes in self.sizes.items():
            files.write_bytes(files.join(self.root, shard_name(split, self.unit, ".docs")),
                              np.asarray(sizes, "<u4").tobytes())
            self.stats[split]["sha256"] = self.digests[split].hexdigest()


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard of a split, as the manifest lists it."""

    unit: int
    tokens: int
    documents: int
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A dataset's manifest: its `identity` (what was tokenized, with what: a hex digest), the
    source's description, the tokenizer's {"kind", "sha256", "vocab_size", "eos_id", "file"},
    the token `dtype`, and each split's shards."""

    root: str
    identity: str
    source: dict[str, Any]
    tokenizer: dict[str, Any]
    held_out_fraction: float
    dtype: str
    splits: dict[str, tuple[Shard, ...]]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "identity": self.identity,
                "source": self.source, "tokenizer": self.tokenizer,
                "held_out_fraction": self.held_out_fraction, "dtype": self.dtype,
                "splits": {name: [dataclasses.asdict(s) for s in shards]
                           for name, shards in self.splits.items()}}


def read_manifest(root: str) -> Manifest:
    """The manifest of the dataset in folder `root`. Raises FileNotFoundError when it has none
    (not a dataset, or its tokenization is unfinished), DatasetError when it is unreadable or
    written by another version of cem_jax."""
    path = files.join(root, MANIFEST)
    try:
        values = json.loads(files.read_bytes(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{root} holds no tokenized dataset ({MANIFEST} is missing: "
                                f"not a dataset, or its tokenization has not finished)") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path} is not valid JSON ({err}): tokenize again") from None
    if not isinstance(values, dict) or values.get("format") != FORMAT:
        raise DatasetError(f"{path} is not the manifest of a cem_jax tokenized dataset")
    if values.get("version") != VERSION:
        raise DatasetError(f"{root} was tokenized by another version of cem_jax (layout "
                           f"{values.get('version')}, this one reads {VERSION}): tokenize again")
    return Manifest(root, values["identity"], values["source"], values["tokenizer"],
                    values["held_out_fraction"], values["dtype"],
                    {name: tuple(Shard(**s) for s in shards)
                     for name, shards in values["splits"].items()})


def write_manifest(manifest: Manifest) -> None:
    files.write_bytes(files.join(manifest.root, MANIFEST),
                      json.dumps(manifest.to_json(), indent=1).encode())


def read_unit_record(root: str, unit: int, identity: str) -> dict[str, Any] | None:
    """The record of a finished unit of dataset `identity`, or None (not finished, or written
    for another dataset: tokenized again)."""
    try:
        record = json.loads(files.read_bytes(files.join(root, unit_record_name(unit))))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("identity") == identity else None


def write_unit_record(root: str, unit: int, record: dict[str, Any]) -> None:
    files.write_bytes(files.join(root, unit_record_name(unit)), json.dumps(record).encode())


class TokenStream:
    """One split of a dataset as one token stream, EOS d1 EOS d2 ... EOS dn EOS, read by ranges
    (`read`; many at once, `read_many`, as a step's rows are): local shards by `os.pread` of
    the range alone (a memory map would pull its neighbourhood into the process's memory,
    megabytes per row read at random), shards on a bucket by byte-range requests, those of one
    `read_many` concurrently. Nothing is read at start; a shard is opened on first use
    (`OPEN_SHARDS` of them stay open). Safe to read from several threads.

    Raises DatasetError naming the shard when one is damaged: its size is not the manifest's
    (a local one: checked when it is first opened; one on a bucket: a read past its end) or
    it holds an id ≥ `vocab_size` (checked on every read).
    """

    def __init__(self, manifest: Manifest, split: str, vocab_size: int,
                 limit: int | None = None):
        self.manifest, self.split, self.vocab_size = manifest, split, vocab_size
        self.shards = manifest.splits.get(split, ())
        self.dtype = np.dtype(manifest.dtype)
        self.eos_id = int(manifest.tokenizer["eos_id"])
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards])
        self.total = int(self.starts[-1]) if limit is None else min(limit, int(self.starts[-1]))
        self._remote = files.is_url(manifest.root)  # shards on a bucket, or local ones
        self._open: dict[int, int] = {}  # shard → file descriptor, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tokens in the stream: the shards' (their first `limit`, when given: a limit at a
        document's end keeps the stream's packing) and the final EOS."""
        return self.total + 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, int32 [stop - start]. Raises IndexError unless
        0 ≤ start ≤ stop ≤ len."""
        return self.read_many([start], [stop])[0]

    def read_many(self, starts: list[int], stops: list[int]) -> list[np.ndarray]:
        """Tokens [starts[k], stops[k]) of the stream for each k, int32 arrays, read together:
        a range crossing shards is read from each, and the ranges in shards on a bucket go out
        at once as concurrent requests (`files.read_ranges`: a step's rows cost about one
        request's latency, not one each). Raises IndexError unless 0 ≤ start ≤ stop ≤ len for
        each, ValueError when the lists differ in length."""
        if len(starts) != len(stops):
            raise ValueError(f"{len(starts)} starts and {len(stops)} stops")
        total, outs = self.total, []
        pieces: list[tuple[int, int, int, int, int]] = []  # (range, at in it, shard, lo, hi)
        for k, (start, stop) in enumerate(zip(starts, stops, strict=True)):
            start, stop = int(start), int(stop)
            if not 0 <= start <= stop <= len(self):
                raise IndexError(f"tokens [{start}, {stop}) of a stream of {len(self)}")
            out = np.empty(stop - start, np.int32)
            if start <= total < stop:
                out[total - start] = self.eos_id  # the final EOS
            at = start
            while at < min(stop, total):
                i = int(np.searchsorted(self.starts, at, side="right")) - 1  # holds token `at`
                lo, hi = int(self.starts[i]), min(stop, int(self.starts[i + 1]))
                pieces.append((k, at - start, i, at - lo, hi - lo))
                at = hi
            outs.append(out)
        for (k, at, i, lo, hi), data in zip(pieces, self._read_pieces(pieces), strict=True):
            outs[k][at:at + hi - lo] = self._checked(i, lo, hi, data)
        return outs

    def _read_pieces(self, pieces: list[tuple[int, int, int, int, int]]) -> list[bytes]:
        """The bytes of tokens [lo, hi) of shard i of each piece (_, _, i, lo, hi)."""
        size = self.dtype.itemsize
        if self._remote:
            return files.read_ranges([self.path(i) for _, _, i, _, _ in pieces],
                                     [lo * size for _, _, _, lo, _ in pieces],
                                     [hi * size for _, _, _, _, hi in pieces])
        with self._lock:  # no other thread closes a descriptor meanwhile
            return [os.pread(self._descriptor(i), (hi - lo) * size, lo * size)
                    for _, _, i, lo, hi in pieces]

    def _checked(self, i: int, lo: int, hi: int, data: bytes) -> np.ndarray:
        """Tokens [lo, hi) of shard `i`, read as `data`, checked (size and ids)."""
        tokens = np.frombuffer(data, self.dtype)
        if len(tokens) != hi - lo:
            raise DatasetError(f"shard {self.path(i)} is damaged: it ends before token {hi} of "
                               f"the {self.shards[i].tokens} the manifest gives; {self._fix}")
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise DatasetError(f"shard {self.path(i)} is damaged: it holds token id "
                               f"{int(tokens.max())} (near token {lo + int(tokens.argmax())}), "
                               f"past the vocabulary of {self.vocab_size}; {self._fix}")
        return tokens

    def _descriptor(self, i: int) -> int:
        """An open descriptor of local shard `i`, its size checked when it is opened."""
        if i not in self._open:
            path, expected = files.local(self.path(i)), self.shards[i].tokens * self.dtype.itemsize
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise DatasetError(f"shard {path} is missing: {self._fix}") from None
            if (size := os.fstat(fd).st_size) != expected:
                os.close(fd)
                raise DatasetError(f"shard {path} is damaged: {size:,} bytes, the manifest "
                                   f"gives {expected:,}; {self._fix}")
            if len(self._open) >= OPEN_SHARDS:
                os.close(self._open.pop(next(iter(self._open))))
            self._open[i] = fd
        return self._open[i]

    def path(self, i: int) -> str:
        """The file of shard `i`."""
        return files.join(self.manifest.root, shard_name(self.split, self.shards[i].unit))

    @property
    def _fix(self) -> str:
        return (f"`cem-data verify {self.manifest.root}` checks every shard; tokenize the "
                f"dataset again (delete the folder)")

    def document_sizes(self) -> Iterator[tuple[int, int]]:
        """(tokens with the EOS before it, UTF-8 bytes) of each document in order."""
        for shard in self.shards:
            data = files.read_bytes(files.join(self.manifest.root,
                                               shard_name(self.split, shard.unit, ".docs")))
            yield from np.frombuffer(data, "<u4").reshape(-1, 2).tolist()


def verify(root: str) -> list[str]:
    """Check every shard of the dataset in `root` against its manifest (size and SHA-256);
    returns one line per damaged or missing shard (none: the dataset is whole)."""
    manifest = read_manifest(root)
    dtype = np.dtype(manifest.dtype)
    problems = []
    for split, shards in manifest.splits.items():
        for shard in shards:
            path = files.join(root, shard_name(split, shard.unit))
            try:
                data = files.read_bytes(path)
            except FileNotFoundError:
                problems.append(f"{path}: missing")
                continue
            if len(data) != shard.tokens * dtype.itemsize:
                problems.append(f"{path}: {len(data):,} bytes, the manifest gives "
                                f"{shard.tokens * dtype.itemsize:,}")
            elif hashlib.sha256(data).hexdigest() != shard.sha256:
                problems.append(f"{path}: SHA-256 differs from the manifest's (corrupt)")
    return problems
