"""Energy monitor: each layer's conditional energy before and after each of its CEM steps, and
the learned preconditioners.

For notebooks and diagnostics: `energy_monitor(model, tokens)` runs the model once and reports,
per tied sub-layer, the mean per-token energy (DESIGN.md §1) at every step and the fraction of
tokens whose energy went down across the step. `descent_statistics(cfg, params, batches)` does
the same over evaluation batches (`cem_jax.data.make_eval_batches`), per token, counting only
the tokens their weights mark as real (one compiled forward per batch).
`preconditioner_stats(model)` gives each sub-layer's learned P. Untied (Llama) sub-layers have
no energy and are absent.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from cem_jax.config import ModelConfig
from cem_jax.model import CEMTransformer, forward_with_energies, model_from_params

Array = jax.Array


def _masked_sums(energies: dict[str, Array], mask: Array) -> dict[str, Array]:
    """Per-token energies {kind: [L, steps, 2, B, T]} and a bool mask [B,T] → {kind: fp32
    [3, L, steps]}: Σ E before, Σ E after and the count of tokens with after < before, over the
    masked tokens."""
    m = mask.astype(jnp.float32)
    return {kind: jnp.stack([jnp.sum(e[:, :, 0] * m, axis=(-2, -1)),
                             jnp.sum(e[:, :, 1] * m, axis=(-2, -1)),
                             jnp.sum((e[:, :, 1] < e[:, :, 0]) * m, axis=(-2, -1))])
            for kind, e in energies.items()}


def _means(sums: dict[str, np.ndarray], count: float) -> dict[str, dict[str, np.ndarray]]:
    """`_masked_sums` (accumulated, float64) over `count` tokens → the report's means."""
    out = {}
    for kind, (before, after, down) in sums.items():
        before, after = before / count, after / count
        out[kind] = {"before": before, "after": after, "change": after - before,
                     "down": down / count}
    return out


def energy_monitor(model: CEMTransformer, tokens: Array, positions: Array | None = None,
                   segment_ids: Array | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Energies of one batch, averaged over its B·T tokens (`descent_statistics` counts only
    the real tokens of evaluation batches).

    tokens int [B,T] (positions, segment_ids as for the model). Returns
    {"attention"|"mlp": {"before", "after", "change", "down": [L, steps]}} as float64 numpy
    arrays, in the energy's units (nats scaled by 1/β for attention; see `cem_jax.energies`):
    "before"[l, k] = mean E(yᵏ | c), "after"[l, k] = mean E(yᵏ⁺¹ | c) for layer l and step k,
    "change" = after - before, "down" = the fraction of tokens whose own energy went down.
    With `gradient_wrt="residual"` and a small enough step, after < before at every step; the
    default update (the y-gradient applied to x) is not guaranteed to descend (DESIGN.md §1).
    """
    _, energies = forward_with_energies(model, tokens, positions, segment_ids)
    sums = _masked_sums(energies, jnp.ones(tokens.shape, bool))
    return _means(jax.tree.map(lambda a: np.asarray(a, np.float64), sums), tokens.size)


def descent_statistics(cfg: ModelConfig, params: dict, batches: Iterable[dict]
                       ) -> dict[str, dict[str, np.ndarray]]:
    """`energy_monitor`'s report pooled over evaluation batches: the model of `cfg` holding
    `params` (a pure parameter dict, e.g. `cem_jax.rundir.Run.params`) run on each batch
    ("inputs", "positions", "segment_ids" int32 [B,T], "weights" fp32 [B,T], as
    `cem_jax.data.make_eval_batches` makes them), every token with weight > 0 counted once.

    Returns {"attention"|"mlp": {"before", "after", "change", "down": float64 [L, steps]}}
    (means over the counted tokens; "down": the fraction whose energy went down across step k
    of layer l). Raises ValueError if the batches count no token.
    """
    step = jax.jit(lambda params, batch: _masked_sums(forward_with_energies(
        model_from_params(cfg, params), batch["inputs"], batch["positions"],
        batch["segment_ids"])[1], batch["weights"] > 0))
    sums, count = None, 0
    for batch in batches:
        tokens = int(np.sum(np.asarray(batch["weights"]) > 0))
        if not tokens:
            continue
        batch = {k: batch[k] for k in ("inputs", "positions", "segment_ids", "weights")}
        part = jax.tree.map(lambda a: np.asarray(a, np.float64), step(params, batch))
        sums = part if sums is None else jax.tree.map(np.add, sums, part)
        count += tokens
    if not count:
        raise ValueError("the batches hold no token with weight > 0: nothing to measure")
    return _means(sums, count)


def preconditioner_stats(model: CEMTransformer) -> dict[str, dict[str, np.ndarray]]:
    """Each sub-layer's learned preconditioner P (`cem_jax.layers.Preconditioner`), per layer.

    Returns {"attention"|"mlp": {"mean", "min", "max": float64 [L] of P's diagonal
    softplus(ρ) (one value for "scalar"), and for "dplr" also "u_norm": float64 [L], the
    Frobenius norm ‖U‖ of its low-rank part}}; empty for `preconditioner: none`.
    """
    cfg = model.cfg
    if cfg.preconditioner == "none":
        return {}
    out = {}
    for kind in ("attention", "mlp"):
        diag = np.logaddexp(0.0, _stacked(model, kind, "rho").reshape(cfg.num_layers, -1))
        out[kind] = {"mean": diag.mean(1), "min": diag.min(1), "max": diag.max(1)}
        if cfg.preconditioner == "dplr":
            out[kind]["u_norm"] = np.sqrt(np.sum(_stacked(model, kind, "U")**2, axis=(1, 2)))
    return out


def _stacked(model: CEMTransformer, kind: str, name: str) -> np.ndarray:
    """Parameter `name` of every layer's `kind` preconditioner, float64 [L, ...]."""
    if model.cfg.scan_layers:  # the blocks' parameters are stacked already
        return np.asarray(getattr(getattr(model.blocks, kind).precond, name)[...], np.float64)
    return np.stack([np.asarray(getattr(getattr(b, kind).precond, name)[...], np.float64)
                     for b in model.blocks])
