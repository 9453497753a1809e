"""The study behind docs/results.md (`cem-study`, `cem_jax.cli.study`): CEM configs against a
Llama twin, each at the learning rate its own sweep picks, over enough seeds for an equivalence
test, at equal steps and equal training FLOPs, and over model size.

`plan` reads the study's YAML file and says which runs it needs; `records` trains one and writes
its per-run file (committed: the report is made from those files alone); `analysis` turns the
files into stability figures, paired differences and their tests (`cem_jax.stats`); `report`
writes the Markdown from its sections (`what_ran`, `sentences`, `tables`; their formatting in
`text`) and `figures` the PNGs.
"""
