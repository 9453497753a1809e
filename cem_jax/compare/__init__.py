"""A comparison (the `cem-compare` command, `cem_jax.cli.compare`): several configs trained alike,
once per seed, then tabulated against a baseline row: validation bits per byte as mean ±
standard deviation over the seeds, and the paired difference to the baseline with its 95%
interval, at equal steps or at equal training FLOPs; from each run's checkpoint, bits per byte
on an out-of-domain text, the energy descent of its CEM layers and test-time recursion.

`plan` says which runs the tables need (the steps of each budget, the baseline); `runs` trains
each in its own `cem-train` process, reused when finished and resumed when not; `analysis`
evaluates a finished run from its checkpoint, each result cached beside it; `report` writes the
Markdown tables and the PNGs. The study (`cem_jax.study`) trains its runs with `runs` and counts
their parameters and FLOPs with `report`.
"""
