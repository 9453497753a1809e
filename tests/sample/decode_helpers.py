"""Helpers of the decoding tests: tiny models with parameters far from their initialisation."""

from __future__ import annotations

from cem_jax.config import ModelConfig

TINY = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=32)
BASELINE = dict(tie_attention=False, tie_mlp=False, preconditioner="none")


def tiny_config(**overrides) -> ModelConfig:
    """A tiny ModelConfig (V=64, D=16, L=2, H=2, F=32) with `overrides`."""
    return ModelConfig(**{**TINY, **overrides})


