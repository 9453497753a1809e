"""cem_jax: Causal Energy Minimization Transformers in JAX/Flax (DESIGN.md; arXiv 2605.07588).

The curated public API, imported when first used (`import cem_jax` itself loads no JAX):

    configs         ModelConfig, TrainConfig, OptimizerConfig, MeshConfig, load_config
    building blocks Kind, Param, Context, Mixer, register_kind, get_kind (sub-layer kinds: an
                    energy becomes a layer; a Mixer is a kind's closed form),
                    register_activation (a σ with its antiderivative Φ)
    model           CEMTransformer, Output, init_cache, forward_with_energies
    training        Trainer (the compiled train and eval steps), make_mesh
    runs            load_run (a run directory's config, tokenizer and parameters)
    diagnostics     energy_monitor, descent_statistics

Everything else lives in its module (`cem_jax.energies`, `cem_jax.updates`, `cem_jax.data`, ...).
"""

import importlib

_API = {
    "ModelConfig": "cem_jax.config", "TrainConfig": "cem_jax.train_config",
    "OptimizerConfig": "cem_jax.train_config", "MeshConfig": "cem_jax.train_config",
    "load_config": "cem_jax.train_config", "Kind": "cem_jax.kinds", "Param": "cem_jax.kinds",
    "Context": "cem_jax.kinds", "Mixer": "cem_jax.updates", "register_kind": "cem_jax.kinds",
    "get_kind": "cem_jax.kinds",
    "register_activation": "cem_jax.energies", "CEMTransformer": "cem_jax.model",
    "init_cache": "cem_jax.model", "Output": "cem_jax.model",
    "forward_with_energies": "cem_jax.model", "Trainer": "cem_jax.train.step",
    "make_mesh": "cem_jax.sharding", "load_run": "cem_jax.rundir",
    "energy_monitor": "cem_jax.monitor", "descent_statistics": "cem_jax.monitor",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'cem_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)


def __dir__() -> list[str]:
    return __all__
