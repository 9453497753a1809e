"""The console scripts `cem-sample` and `cem-eval` (pyproject.toml [project.scripts]): each
parses its arguments (`cem_jax.arguments`) before it imports its module, and JAX with it, so
that `--help` and a usage error (exit status 2) answer at once; `python -m cem_jax.sample` and
`python -m cem_jax.evaluate` run the same commands. The other commands' modules import JAX only
once their arguments are parsed (`cem-train`: `cem_jax.train.main`).
"""

from __future__ import annotations

from collections.abc import Sequence

from cem_jax.arguments import eval_parser, sample_parser


def sample(argv: Sequence[str] | None = None) -> int:
    """`cem-sample` (`cem_jax.sample.main`); returns its exit status."""
    args = sample_parser().parse_args(argv)
    from cem_jax.sample import run_command

    return run_command(args)


def evaluate(argv: Sequence[str] | None = None) -> int:
    """`cem-eval` (`cem_jax.evaluate.main`); returns its exit status."""
    args = eval_parser().parse_args(argv)
    from cem_jax.evaluate import run_command

    return run_command(args)
