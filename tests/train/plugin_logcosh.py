"""A user's module outside cem_jax, named by a config's `imports`: it registers the activation
σ = tanh, whose antiderivative is Φ(a) = log cosh(a) (Φ' = tanh), written stably."""

import jax
import jax.numpy as jnp

from cem_jax.energies import register_activation


def log_cosh(a: jax.Array) -> jax.Array:
    """log cosh(a) = |a| + log1p(e^{-2|a|}) - log 2, finite for any a."""
    return jnp.abs(a) + jnp.log1p(jnp.exp(-2.0 * jnp.abs(a))) - jnp.log(2.0)


register_activation("logcosh", jnp.tanh, log_cosh)
