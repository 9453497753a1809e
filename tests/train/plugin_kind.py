"""A user's module outside cem_jax, named by a config's `imports`: it registers a sub-layer kind
that is not an activation pair, the log-cosh pull of the token towards its context,

    E(y | c) = Σ_f log cosh((y W)_f - (c U)_f),   W, U [D,F]

with parameters and energy only: its update is -∇_y E = -W tanh(yW - cU) by `jax.grad`."""

import jax.numpy as jnp

from cem_jax.kinds import Kind, Param, register_kind


def params(cfg):
    return {"w": Param((cfg.d_model, cfg.mlp_dim), ("embed", "mlp")),
            "u": Param((cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))}


def energy(p, y, c, ctx):
    a = y @ p["w"] - c @ p["u"]
    return jnp.sum(jnp.logaddexp(a, -a) - jnp.log(2.0), axis=-1)  # log cosh, stably


register_kind(Kind("logcosh_pull", "mlp", params, energy))
