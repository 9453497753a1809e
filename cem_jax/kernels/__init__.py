"""Pallas kernels of CEM's tied-key/value (values are keys) causal flash attention.

`tied_attention` is the public op (TPU: Pallas/Mosaic, GPU: Pallas/Triton, CPU: the `jnp`
reference, or either kernel with `interpret=True`); `tied_attention_reference` is the oracle.
What was verified where: see README.md beside this file.
"""

from cem_jax.kernels.common import BACKENDS, BlockSizes
from cem_jax.kernels.reference import tied_attention_reference
from cem_jax.kernels.tied_attention import tied_attention

__all__ = ["BACKENDS", "BlockSizes", "tied_attention", "tied_attention_reference"]
