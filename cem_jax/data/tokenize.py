"""Tokenize a source once, in parallel, into a tokenized dataset (`cem_jax.data.shards`).

    manifest = tokenize_dataset(source, tokenizer, "gs://bucket/tokens/fineweb")

The source's units (`cem_jax.data.sources.Unit`) are tokenized by a pool of worker processes,
one unit at a time each, one tokenizer thread each (`workers`, default: every core; with one
worker the unit is tokenized here, with `threads` tokenizer threads). Each finished unit leaves
its shards and then its record, so an interrupted tokenization resumes at the units without a
record. Machines share the work by `part=(i, n)`: each takes the units i, i+n, i+2n, ... (a
pod's own hosts, or the tasks of a job of Apache Beam or Ray calling `tokenize_dataset` with
their index); whichever finds every unit finished writes the manifest, which joins them (its
content is the same whoever writes it).

Documents are assigned to the "documents" or the "held_out" split by a hash of (unit, index in
the unit), a fraction `held_out_fraction` of them held out: the same documents in every
process, run and machine. Empty documents are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import multiprocessing
import os
import pickle
import queue
import signal
from collections.abc import Callable
from typing import Any

from cem_jax.data import files, shards
from cem_jax.data.shards import DatasetError, Manifest, Shard, ShardWriter
from cem_jax.data.sources import Source, Unit, digest
from cem_jax.data.tokenizers import Tokenizer
from cem_jax.data.tokenizers.loading import tokenizer_from_files

ENCODE_BATCH_CHARS = 1 << 22  # characters handed to the tokenizer at once


def dataset_identity(source: Source, tokenizer: Tokenizer, held_out_fraction: float) -> str:
    """Hex digest of what a dataset holds: the layout version, the source's fingerprint, the
    tokenizer and the held-out fraction (a cache folder is named by it)."""
    return digest([shards.VERSION, source.fingerprint(), tokenizer.sha256,
                   float(held_out_fraction)])


def tokenize_dataset(source: Source, tokenizer: Tokenizer, root: str, *,
                     held_out_fraction: float = 0.0, workers: int | None = None,
                     threads: int | None = None, part: tuple[int, int] = (0, 1),
                     progress: Callable[[int, int], None] | None = None,
                     check: Callable[[], None] | None = None,
                     write_manifest: bool = True) -> Manifest | None:
    """Tokenize the units of `source` that are this `part`'s and not finished yet into the
    dataset folder `root`; returns its manifest once every unit is finished (None while other
    parts are not, or when `write_manifest` is False: the caller writes it later). A
    finished dataset is returned as it is.

    workers: processes (default: one per core, at most one per unit); threads: tokenizer
    threads of a single worker (default: every core; a tokenizer.json takes 1, one text at a
    time, or else its library's own pool: every core, or `RAYON_NUM_THREADS`). progress:
    called with (bytes done, bytes to do) of the units this call tokenizes, at the start and
    after each unit. check: a stop check, called before each
    document (one worker) or every fraction of a second (several: they are then
    interrupted); what it raises ends the tokenization, the finished units kept and nothing
    of the others. Raises DatasetError when `root` holds another dataset, ValueError naming
    the file when a document cannot be read, and when the whole source holds no text.
    """
    identity = dataset_identity(source, tokenizer, held_out_fraction)
    try:
        manifest = shards.read_manifest(root)
    except FileNotFoundError:
        manifest = None
    if manifest is not None:
        if manifest.identity != identity:
            raise DatasetError(f"{root} holds another tokenized dataset "
                               f"({manifest.source['description']}, tokenizer "
                               f"{manifest.tokenizer['sha256'][:12]}…): choose another folder")
        return manifest
    units = source.units()
    index, count = part
    todo = [u for u in units[index::count]
            if shards.read_unit_record(root, u.index, identity) is None]
    job = functools.partial(_tokenize_unit, root, source, tuple(tokenizer.files().items()),
                            identity, held_out_fraction)
    total, done = sum(u.size for u in todo), 0

    def finished(size: int) -> None:  # a unit of `size` bytes
        nonlocal done
        done += size
        if progress:
            progress(done, total)

    if progress:
        progress(0, total)
    workers = min(workers or os.cpu_count() or 1, max(len(todo), 1))
    if workers == 1:
        for unit in todo:
            job(unit, threads, check)
            finished(unit.size)
    else:
        _in_processes(job, todo, workers, finished, check)
    records = [shards.read_unit_record(root, u.index, identity) for u in units]
    if not write_manifest or any(r is None for r in records):
        return None
    return _write_manifest(root, source, tokenizer, held_out_fraction, identity, records)


def _in_processes(job: Callable, units: list[Unit], workers: int,
                  finished: Callable[[int], None],
                  check: Callable[[], None] | None) -> None:
    """`job(unit, 1, None)` for `units`, dealt round-robin to `workers` fresh processes
    (spawned: the caller may hold threads, JAX's among them, that a fork would copy
    half-alive), `finished` called with the bytes of each unit done. A worker's error is
    raised here; so is what `check` raises, after the workers are interrupted (SIGINT: the
    unit each was tokenizing leaves nothing)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_worker, args=(job, units[i::workers], results),
                             daemon=True) for i in range(workers)]
    for proc in procs:
        proc.start()
    try:
        for _ in units:
            kind, value = _next_result(results, procs, check)
            if kind == "error":
                raise value
            finished(value)
    except BaseException:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
        raise
    for proc in procs:
        proc.join()


def _next_result(results, procs: list, check: Callable[[], None] | None) -> tuple[str, Any]:
    """The next ("done", unit size) or ("error", exception) of the workers, calling `check`
    while waiting. Raises RuntimeError when a worker died without saying why."""
    while True:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            if check is not None:
                check()
            if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"a tokenization worker died (exit code {dead[0]}): the "
                                   f"finished units are kept; run the same command again"
                                   ) from None
            if all(p.exitcode is not None for p in procs):  # all gone, a result unsaid
                try:
                    return results.get(timeout=1)
                except queue.Empty:
                    raise RuntimeError("the tokenization workers ended with units left: the "
                                       "finished units are kept; run the same command again"
                                       ) from None


def _worker(job: Callable, units: list[Unit], results) -> None:
    """A worker process: its units one after another, each reported on `results`."""
    try:
        for unit in units:
            job(unit, 1, None)
            results.put(("done", unit.size))
    except KeyboardInterrupt:  # the parent's stop: nothing of this unit is left
        pass
    except Exception as err:  # raised in the parent: as itself when it can be sent
        try:
            pickle.dumps(err)
        except Exception:
            err = RuntimeError(f"{type(err).__name__}: {err}")
        results.put(("error", err))


def _tokenize_unit(root: str, source: Source, tokenizer_files: tuple[tuple[str, bytes], ...],
                   identity: str, held_out_fraction: float, unit: Unit,
                   threads: int | None, check: Callable[[], None] | None) -> None:
    """Tokenize one unit: its shards, then its record (the unit is finished once it exists);
    `check` is called before each document."""
    tokenizer = _tokenizer(tokenizer_files)
    dtype = shards.token_dtype(tokenizer.vocab_size)
    pending: list[tuple[int, str]] = []

    def flush(writer: ShardWriter) -> None:
        texts = [text for _, text in pending]
        for (i, text), ids in zip(pending, tokenizer.encode_batch(texts, num_threads=threads),
                                  strict=True):
            split = "held_out" if _held_out(unit.index, i, held_out_fraction) else "documents"
            writer.add(split, ids, len(text.encode("utf-8")))
        pending.clear()

    with ShardWriter(root, unit.index, dtype, tokenizer.eos_id) as writer:
        size = 0
        for i, doc in enumerate(source.documents(unit)):
            if check is not None:
                check()
            if doc.text:
                pending.append((i, doc.text))
                size += len(doc.text)
            if size >= ENCODE_BATCH_CHARS:
                flush(writer)
                size = 0
        flush(writer)
    shards.write_unit_record(root, unit.index, {"identity": identity, "unit": unit.index,
                                                "size": unit.size, "splits": writer.stats})


@functools.lru_cache(maxsize=4)
def _tokenizer(contents: tuple[tuple[str, bytes], ...]) -> Tokenizer:
    return tokenizer_from_files(dict(contents))


def _held_out(unit: int, document: int, fraction: float) -> bool:
    """Whether document `document` of unit `unit` is held out (a hash below `fraction`)."""
    if fraction <= 0:
        return False
    hashed = hashlib.blake2b(f"{unit}/{document}".encode(), digest_size=8).digest()
    return int.from_bytes(hashed, "little") < fraction * 2**64


def _write_manifest(root: str, source: Source, tokenizer: Tokenizer, held_out_fraction: float,
                    identity: str, records: list[dict]) -> Manifest:
    splits = {name: tuple(Shard(r["unit"], **r["splits"][name]) for r in records
                          if name in r["splits"]) for name in shards.SPLITS}
    if not any(splits.values()):
        raise ValueError(f"{source.description} is empty: it holds no text")
    tokenizer_file = tokenizer.file_name
    for name, content in tokenizer.files().items():
        files.write_bytes(files.join(root, name), content)
    manifest = Manifest(
        root, identity, {"spec": source.spec, "description": source.description,
                         "fingerprint": source.fingerprint()},
        {"kind": tokenizer.kind, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
         "eos_id": tokenizer.eos_id, "file": tokenizer_file}, float(held_out_fraction),
        shards.token_dtype(tokenizer.vocab_size).str, {k: v for k, v in splits.items() if v})
    shards.write_manifest(manifest)
    return manifest
