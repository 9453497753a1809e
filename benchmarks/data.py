"""The data path at pod scale, on this CPU: tokenization on one core against all of them, the
reader's tokens/s per process against what training consumes, and start-up (time, memory) of a
tokenized dataset 10x larger than another.

    python benchmarks/data.py [--repeats 3] [--corpus-mb 24] [--small-gb 0.1] [--large-gb 1]

(1) Tokenization (`cem_jax.data.tokenize.tokenize_dataset`, what `cem-data tokenize` runs): a
corpus of 8 text files cut from Shakespeare's training works (`--corpus-mb` MB in all),
tokenized with one worker of one thread and with the defaults (a worker process per core),
interleaved `--repeats` times; medians and their ratio. Twice: with the `make train` tokenizer
(sentencepiece BPE, 2,048 pieces) and with a Hugging Face byte-level BPE `tokenizer.json` of
GPT-2's kind (8,192 pieces, trained here on the same text with the `tokenizers` library).
(2) The reader: `make_train_iterator` over the large dataset below, the rows one host of a
v5p-32 reads per step of `configs/cem_full_100m.yaml` (512 rows over 4 hosts: 128 x 1024
tokens), batches per second as tokens/s, against the ~1M tokens/s such a host trains the 100M
model on (`--host-tokens-per-s`).
(3) Start-up: in a fresh process each, the time from opening the dataset (`load_tokens`) to the
first batch and the growth of the process's resident memory by then and after 200 batches, for
synthetic datasets of `--small-gb` and `--large-gb` (random tokens in 64 MB shards, written
directly; no tokenization). Flat start-up means no whole-corpus hash or read at start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cem_jax.data import (
    DataConfig,
    build_tokenizer,
    load_tokenizer,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument("--small-gb", type=float, default=0.1)
    parser.add_argument("--large-gb", type=float, default=1.0)
    parser.add_argument("--reader-batches", type=int, default=100)
    parser.add_argument("--host-tokens-per-s", type=float, default=1.0e6)
    args = parser.parse_args()
    cfg = DataConfig(vocab_size=2048)
    tokenizer = build_tokenizer(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
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
        tokenizer.save(work / tokenizer.file_name)
        figures = {}
        for name, size in (("small", args.small_gb), ("large", args.large_gb)):
            synthetic_dataset(work / name, size, tokenizer)
            figures[name] = start_up(work / name, work / tokenizer.file_name)
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
        reader = reader_tokens_per_s(work / "large", tokenizer, args.reader_batches)
        print(f"reader, one process, 128 x 1024 rows per batch: {reader:,.0f} tokens/s, "
              f"{reader / args.host_tokens_per_s:.1f}x a v5p-32 host's training "
              f"({args.host_tokens_per_s:,.0f} tokens/s; goal >= 10M tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
