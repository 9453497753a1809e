"""Flax NNX layers: RMSNorm, the parameters of a sub-layer kind, preconditioners, and the
sub-layer / block that run the CEM steps (DESIGN.md §1).

The modules only hold parameters (with the logical axis names of `cem_jax.sharding`: "vocab",
"embed", "heads", "kv_heads", "mlp", "norm"; `None` = replicated); the math is the pure
functions of `cem_jax.kinds`, `cem_jax.energies` and `cem_jax.updates`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.kinds import Context, Kind, build_mixer, get_kind, model_kinds
from cem_jax.kvcache import Cache, KVCache
from cem_jax.preconditioners import fold_preconditioner, precondition
from cem_jax.updates import run_steps

Array = jax.Array


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str | None, ...], *,
          std: float | None = None, value: float = 0.0, dtype=jnp.float32) -> nnx.Param:
    """A parameter with logical axis names: normal(0, std) when `std` is given, else `value`."""
    if std is not None:
        init = jax.random.normal(rngs.params(), shape, dtype) * std
    else:
        init = jnp.full(shape, value, dtype)
    return nnx.Param(init, out_sharding=axes, eager_sharding=False)


def _values(module: nnx.Module, names: tuple[str, ...], dtype) -> dict[str, Array]:
    """The parameters `names` of a module that exist, cast to the compute dtype."""
    return {n: getattr(module, n)[...].astype(dtype) for n in names if hasattr(module, n)}


class RMSNorm(nnx.Module):
    """RMSNorm over D with a learned scale [D] initialised to 1."""

    def __init__(self, cfg: ModelConfig):
        self.eps = cfg.norm_eps
        self.scale = param(None, (cfg.d_model,), ("norm",), value=1.0,
                           dtype=jnp.dtype(cfg.param_dtype))


class KindParams(nnx.Module):
    """The parameters a sub-layer kind declares (`cem_jax.kinds.Kind.params`), one attribute
    each under the kind's names (so that checkpoints and exports see e.g. `mixer.query`),
    created in the kind's order: normal(0, init_std) or the kind's constant. Raises ValueError
    for a parameter name that cannot be an attribute here."""

    def __init__(self, cfg: ModelConfig, kind: Kind, *, rngs: nnx.Rngs):
        self.kind = kind.name
        dt = jnp.dtype(cfg.param_dtype)
        specs = kind.params(cfg)
        self.names = tuple(specs)
        for name, spec in specs.items():
            if not name.isidentifier() or name in ("kind", "names", "values"):
                raise ValueError(f"sub-layer kind {kind.name!r} names a parameter {name!r}: "
                                 f"use a Python identifier other than kind, names, values")
            setattr(self, name, param(rngs, spec.shape, spec.axes, dtype=dt,
                                      std=cfg.init_std if spec.init is None else None,
                                      value=spec.init or 0.0))

    def values(self, dtype) -> dict[str, Array]:
        """The parameters by name, cast to the compute dtype."""
        return _values(self, self.names, dtype)


class Preconditioner(nnx.Module):
    """P of the CEM step (`preconditioners.precondition`): ρ starts at softplus⁻¹(1) so P
    starts at I (plus U Uᵀ with U ~ normal(0, init_std) [D,r] for "dplr")."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kind = cfg.preconditioner
        dt, one = jnp.dtype(cfg.param_dtype), math.log(math.e - 1.0)
        if self.kind == "scalar":
            self.rho = param(None, (), (), value=one, dtype=dt)
        elif self.kind in ("diag", "dplr"):
            self.rho = param(None, (cfg.d_model,), ("norm",), value=one, dtype=dt)
        if self.kind == "dplr":
            self.U = param(rngs, (cfg.d_model, cfg.preconditioner_rank), ("embed", None),
                           std=cfg.init_std, dtype=dt)

    def __call__(self, u: Array) -> Array:
        return precondition(self.kind, _values(self, ("rho", "U"), jnp.float32), u)

    def folded(self, cfg: ModelConfig) -> Array | None:
        """P's diagonal to fold into the mixer's output projection, or None
        (`preconditioners.fold_preconditioner`)."""
        return fold_preconditioner(self.kind, _values(self, ("rho",), jnp.float32), cfg.impl,
                                   cfg.gradient_wrt)


class SubLayer(nnx.Module):
    """Norm + a sub-layer kind's parameters + preconditioner, run for `cfg.steps` CEM steps."""

    def __init__(self, cfg: ModelConfig, kind: Kind, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = RMSNorm(cfg)
        self.mixer = KindParams(cfg, kind, rngs=rngs)
        self.precond = Preconditioner(cfg, rngs=rngs)

    def __call__(self, x: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, *, cache: Cache | None = None,
                 monitor: bool = False):
        """x [B,T,D] → (x after the steps [B,T,D], the updated `KVCache` [C,...] of a
        sub-layer given a `cache`, else None). With `monitor`, a kind with an energy records
        its per-token energies fp32 [steps,2,B,T] before and after each step (`nnx.sow`,
        `nnx.Intermediate` "energies"; `cem_jax.model.forward_with_energies`).

        A scalar or diagonal P is folded into the output projection of a kind that declares
        `folds_preconditioner`, where that is exact (`preconditioners.fold_preconditioner`):
        the same update, computed on weights. Any other P is applied to the kind's update.
        """
        cfg = self.cfg
        kind = get_kind(self.mixer.kind)
        params = self.mixer.values(x.dtype)
        out_scale = self.precond.folded(cfg) if kind.folds_preconditioner else None
        if out_scale is not None:
            params["out_scale"] = out_scale.astype(x.dtype)
        mixer = build_mixer(kind, params, Context(cfg, positions, segment_ids, cache))
        precond = self.precond if out_scale is None else lambda u: u
        x, energies, contexts = run_steps(
            x, mixer, norm_scale=self.norm.scale[...], eps=self.norm.eps, precond=precond,
            steps=cfg.steps, impl=cfg.impl, gradient_wrt=cfg.gradient_wrt,
            recompute_context=cfg.recompute_context, monitor=monitor)
        if energies is not None:
            self.sow(nnx.Intermediate, "energies", energies)
        if cache is None or kind.cache == "none":
            return x, None
        return x, jax.tree.map(lambda *a: jnp.stack(a), *(
            KVCache(ctx.key, ctx.value, ctx.context) for ctx in contexts))


class Block(nnx.Module):
    """One Transformer block: an attention sub-layer then an MLP sub-layer, of the kinds the
    config names (`cem_jax.kinds`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        attention, mlp = model_kinds(cfg)
        self.attention = SubLayer(cfg, attention, rngs=rngs)
        self.mlp = SubLayer(cfg, mlp, rngs=rngs)

    def __call__(self, x: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, *, cache: Cache | None = None,
                 monitor: bool = False):
        """x [B,T,D] → (x [B,T,D], the updated attention `KVCache` [C,...] or None) (see
        SubLayer; `cache` is this layer's)."""
        x, cache = self.attention(x, positions, segment_ids, cache=cache, monitor=monitor)
        x, _ = self.mlp(x, positions, segment_ids, monitor=monitor)
        return x, cache
