"""The command-line entry points: `cem-train`, `cem-data`, `cem-sample`, `cem-eval`,
`cem-export`, `cem-import`, `cem-compare` and `cem-study`, one module each (`cem-export` and
`cem-import` share `export.py`).

Each parses its arguments (`cem_jax.cli.arguments`, which loads no JAX, so `--help` answers at
once) before it imports the library it drives. Nothing below this package imports it: training,
evaluation, sampling and export are library code that a notebook calls the same way.
"""
