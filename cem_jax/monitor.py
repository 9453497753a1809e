"""Energy monitor: each layer's conditional energy before and after each of its CEM steps.

For notebooks and diagnostics: `energy_monitor(model, tokens)` runs the model once and reports,
per tied sub-layer, the mean per-token energy (DESIGN.md §1) at every step. Untied (Llama)
sub-layers have no energy and are absent from the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cem_jax.model import CEMTransformer

Array = jax.Array


def energy_monitor(model: CEMTransformer, tokens: Array, positions: Array | None = None,
                   segment_ids: Array | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Energies of one batch, averaged over its B·T tokens.

    tokens int [B,T] (positions, segment_ids as for the model). Returns
    {"attention"|"mlp": {"before": [L, steps], "after": [L, steps]}} as float64 numpy arrays,
    in the energy's units (nats scaled by 1/β for attention; see `cem_jax.energies`):
    "before"[l, k] = E(yᵏ | c), "after"[l, k] = E(yᵏ⁺¹ | c) for layer l and step k.
    With a small enough step (and `gradient_wrt="residual"`) after < before at every step.
    """
    _, energies = model(tokens, positions, segment_ids, return_energies=True)
    out = {}
    for name, e in energies.items():  # e: [L, steps, 2, B, T]
        mean = np.asarray(jnp.mean(e, axis=(-2, -1)), dtype=np.float64)
        out[name] = {"before": mean[:, :, 0], "after": mean[:, :, 1]}
    return out
