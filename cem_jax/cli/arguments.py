"""The argument parsers of the commands whose modules import JAX: `cem-train`, `cem-sample` and
`cem-eval`, and the argparse types the commands share. This module imports no JAX (an import
contract of pyproject.toml), so that `--help` and a usage error (exit status 2) answer at once:
each command (`cem_jax.cli.train`, `.sample`, `.evaluate`) parses its arguments with these, then
imports the library that runs it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

TRAIN_DESCRIPTION = ("`cem-train`: train a CEM (or Llama) language model on a device mesh, "
                     "resumably.")


def positive_int(text: str) -> int:
    """argparse type: `text` as an integer >= 1; raises argparse.ArgumentTypeError otherwise."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def count(text: str) -> int:
    """argparse type: `text` as an integer >= 0; raises argparse.ArgumentTypeError otherwise."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return int(text)


def non_negative_float(text: str) -> float:
    """argparse type: `text` as a number >= 0 (inf included, nan not); raises
    argparse.ArgumentTypeError otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def train_parser() -> argparse.ArgumentParser:
    """The arguments of `cem-train` (`cem_jax.cli.train`)."""
    parser = argparse.ArgumentParser(prog="cem-train", description=TRAIN_DESCRIPTION)
    parser.add_argument("--config", help="YAML config file (default: all defaults: the model, "
                        "data and optimizer of configs/shakespeare_cem.yaml, what `make train` "
                        "trains, in runs/default)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override config fields, e.g. run.steps=20 optimizer.lr=3e-3")
    parser.add_argument("--dry-run", action="store_true",
                        help="compile one train step on abstract inputs and print parameters, "
                             "mesh, batch, per-device memory and FLOPs; reads no data and "
                             "writes nothing")
    parser.add_argument("--target", metavar="NAME",
                        help="with --dry-run: the train step for a TPU or GPU topology this host "
                             "lacks, e.g. tpu-v5p-32, tpu-v6e-16, gpu-h200-8 "
                             "(cem_jax.train.targets.TARGETS): compiled by libtpu for a TPU "
                             "where it is installed (the tpu extra), with the compiler's memory "
                             "per chip, collectives and kernels; else lowered only")
    parser.add_argument("--num-slices", type=positive_int, metavar="N",
                        help="with --target: N slices of that topology joined by the "
                             "data-center network (the override mesh.num_slices=N; MaxText's "
                             "compile_topology_num_slices)")
    parser.add_argument("--lower-only", action="store_true",
                        help="with --target: lower the step without compiling it, even where "
                             "libtpu is installed (a second, not a minute; memory estimated)")
    return parser


def parse_train_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`cem-train`'s arguments; a usage error exits with status 2 (argparse's)."""
    parser = train_parser()
    args = parser.parse_args(argv)
    if args.target is not None and not args.dry_run:
        parser.error("--target needs --dry-run (it lowers for the target, it does not train)")
    if args.lower_only and args.target is None:
        parser.error("--lower-only needs --target (a dry run on this host's devices compiles "
                     "for them)")
    if args.num_slices is not None:
        if args.target is None:
            parser.error("--num-slices needs --target (on a real multislice job, set "
                         "mesh.num_slices)")
        args.overrides.append(f"mesh.num_slices={args.num_slices}")
    return args


def sample_parser() -> argparse.ArgumentParser:
    """The arguments of `cem-sample` (`cem_jax.cli.sample`)."""
    parser = argparse.ArgumentParser(prog="cem-sample", description="Generate text from a "
                                     "trained run with a cached, compiled decode loop.")
    _checkpoint_arguments(parser)
    parser.add_argument("--prompt", action="append", default=None,
                        help="prompt text; repeat for a batch (default: one empty prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=200,
                        help="tokens to generate per prompt (default: 200)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens; 0 = no limit (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens whose probabilities reach p "
                             "(nucleus); 1.0 = no limit (default: 1.0)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed of the sampling (default: 0)")
    parser.add_argument("--no-stop-at-eos", action="store_true",
                        help="keep generating after the end-of-document token")
    _steps_argument(parser, "decodes")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (one shows only when stdout is a terminal)")
    return parser


def eval_parser() -> argparse.ArgumentParser:
    """The arguments of `cem-eval` (`cem_jax.cli.evaluate`)."""
    parser = argparse.ArgumentParser(prog="cem-eval", description="Loss, perplexity and bits "
                                     "per byte of a checkpoint on a text.")
    _checkpoint_arguments(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--text", help="text to evaluate on: a file, a glob, or FORMAT:PATH "
                       "(text, jsonl, arrayrecord)")
    where.add_argument("--corpus", default="validation", choices=("validation", "milton"),
                       help="a built-in split of the run (default: validation)")
    parser.add_argument("--allow-invalid-utf8", action="store_true",
                        help="read invalid UTF-8 bytes as U+FFFD instead of refusing the text")
    _steps_argument(parser, "evaluates")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (one shows only on a terminal)")
    return parser


def _checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """--run and --step: the checkpoint a command reads."""
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")


def _steps_argument(parser: argparse.ArgumentParser, verb: str) -> None:
    """--steps N: the CEM steps per sub-layer at test time."""
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help=f"CEM steps per sub-layer (default: the trained count; the steps "
                        f"share their weights, so a run {verb} at any N; the checkpoint is not "
                        "changed)")
