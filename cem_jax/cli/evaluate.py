"""`cem-eval --run DIR [--step N] [--text FILE | --corpus validation|milton]`: loss, perplexity
and bits per byte of a run's model (`cem_jax.evaluate.evaluate_run`). The arguments are parsed
before JAX is imported, so `--help` and a usage error (exit status 2) answer at once; the library
is imported once they are.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cem_jax.cli.arguments import eval_parser
from cem_jax.cli.failures import failed


def main(argv: Sequence[str] | None = None) -> int:
    """`cem-eval`; returns the exit status (0 ok; 1 a crash, or object storage unreachable or
    failing: one line; 2 a usage error, or a run or text that cannot be read: a missing or
    corrupt run directory, checkpoint or text file)."""
    return run_command(eval_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """`main` on parsed arguments (`cem_jax.cli.arguments.eval_parser`)."""
    from cem_jax.checkpoint import CheckpointError
    from cem_jax.compilation_cache import use_compilation_cache
    from cem_jax.data import FetchError
    from cem_jax.evaluate import describe, evaluate_run
    from cem_jax.rundir import load_run, quiet_checkpoint_logs

    quiet_checkpoint_logs()
    try:
        run = load_run(args.run, args.step)
        use_compilation_cache(run.config)
        result = evaluate_run(run, args.text, args.corpus, progress=not args.no_progress,
                              allow_invalid_utf8=args.allow_invalid_utf8, steps=args.steps)
    except Exception as err:
        return failed("cem-eval", err, (FileNotFoundError, CheckpointError, FetchError,
                                        ValueError))
    recursion = f" with {args.steps} CEM steps per sub-layer" if args.steps else ""
    print(f"{args.text or args.corpus} at step {run.step}{recursion}: {describe(result)} "
          f"({result['tokens']:,} tokens, {result['bytes']:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
