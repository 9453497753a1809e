"""The CEM sub-layer: its preconditioner P, its step loop, and the Flax NNX modules that hold
its parameters (DESIGN.md §1).

A sub-layer with input x⁰ [B,T,D] fixes the context c = RMSNorm(x⁰) and takes `steps` steps

    xᵏ⁺¹ = xᵏ + P·u(yᵏ | c),   yᵏ = RMSNorm(xᵏ),   u = -∇_y E(y | c)   (k = 0 … steps-1)

`run_steps` is that loop and the one dispatch point between implementations: `impl="autodiff"`
takes u from `-jax.grad` of the kind's energy, every other impl from its closed form (a
`cem_jax.updates.Mixer`, built by `cem_jax.kinds`). `precondition` applies P, and
`fold_preconditioner` says when P can be folded into the mixer's output projection instead.

The modules (RMSNorm, KindParams, Preconditioner, SubLayer, Block) only hold parameters, with
the logical axis names of `cem_jax.sharding` ("vocab", "embed", "heads", "kv_heads", "mlp",
"norm"; `None` = replicated), and call the functions above.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax.config import IMPLS, ModelConfig
from cem_jax.kinds import Context, Kind, build_mixer, check_params, get_kind, model_kinds
from cem_jax.kvcache import Cache, KVCache
from cem_jax.numerics import dense, rms_norm, rms_norm_vjp
from cem_jax.updates import Mixer

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# The preconditioner P and the step loop.
# ----------------------------------------------------------------------------------------------


def precondition(kind: str, params: dict, u: Array) -> Array:
    """P·u for u [B,T,D] (DESIGN.md §1, "lightweight preconditioner").

    none: P = I. scalar: P = softplus(ρ)·I, ρ []. diag: P = diag(softplus(ρ)), ρ [D].
    dplr: P = diag(softplus(ρ)) + U Uᵀ, ρ [D], U [D,r] (positive definite for any U).
    Raises `ValueError` for an unknown kind.
    """
    if kind == "none":
        return u
    if kind not in ("scalar", "diag", "dplr"):
        raise ValueError(f"unknown preconditioner {kind!r}; use none, scalar, diag or dplr")
    out = jax.nn.softplus(params["rho"]).astype(u.dtype) * u
    if kind == "dplr":
        U = params["U"].astype(u.dtype)
        out = out + dense(dense(u, U), U.T)
    return out


def fold_preconditioner(kind: str, params: dict, impl: str, gradient_wrt: str) -> Array | None:
    """P's diagonal as fp32 [] (scalar) or [D] (diag) to fold into a mixer's output projection
    (params["out_scale"]: `diag(s) W u` costs a [D,·] weight scaling instead of a [B,T,D]
    product and its backward), or None where P cannot be folded: "none" and "dplr", the
    autodiff oracle (its direction is -∇E, not a projection), and a diagonal P with
    gradient_wrt="residual" (which does not commute with the RMSNorm VJP applied after).
    """
    if kind not in ("scalar", "diag") or impl == "autodiff":
        return None
    if kind == "diag" and gradient_wrt == "residual":
        return None
    return jax.nn.softplus(params["rho"].astype(jnp.float32))


def run_steps(x0: Array, mixer: Mixer, *, norm_scale: Array, eps: float,
              precond: Callable[[Array], Array], steps: int = 1, impl: str = "xla",
              gradient_wrt: str = "normalized", recompute_context: bool = False,
              monitor: bool = False) -> tuple[Array, Array | None, list]:
    """Apply one CEM sub-layer to the residual stream x0 [B,T,D]; returns (x_T, energies,
    contexts).

    precond: u ↦ P·u (`precondition`), or the identity when P is already folded into the
      mixer's output projection (`fold_preconditioner`, as `SubLayer` does).
    impl: "autodiff" uses -jax.grad of `mixer.energy` (mixers without an energy, untied or
      cached, use their direction); every other impl ("xla", "pallas", "cudnn", "auto") is the
      closed form `mixer.direction`, whose attention core the mixer was built with.
    gradient_wrt: "normalized" (u = -∇_y E) or "residual" (u = -∇_x E(RMSNorm(x) | c)).
    recompute_context: c = RMSNorm(xᵏ) at every step instead of RMSNorm(x⁰).
    monitor: also return energies fp32 [steps, 2, B, T]: E(yᵏ | cᵏ) before and E(yᵏ⁺¹ | cᵏ)
      after each step (None for mixers without an energy or when monitor is False).
    contexts: what `mixer.prepare` returned for each context, in order (one, or `steps` with
      recompute_context; none under autodiff): a cached attention mixer's updated cache.
    Raises `ValueError` for an unknown impl or gradient_wrt.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; use one of {IMPLS}")
    if gradient_wrt not in ("normalized", "residual"):
        raise ValueError(f"unknown gradient_wrt {gradient_wrt!r}; use normalized or residual")
    use_autodiff = impl == "autodiff" and mixer.energy is not None

    def norm(x):
        return rms_norm(x, norm_scale, eps)

    def direction(x, y, c, prepared):
        if use_autodiff:
            if gradient_wrt == "residual":
                return -jax.grad(lambda x_: mixer.energy(norm(x_), c).sum())(x)
            return -jax.grad(lambda y_: mixer.energy(y_, c).sum())(y)
        u = mixer.direction(y, prepared)
        return rms_norm_vjp(x, norm_scale, eps, u) if gradient_wrt == "residual" else u

    def prepare(c):
        if not use_autodiff:
            contexts.append(mixer.prepare(c, len(contexts)))
        return contexts[-1] if contexts else None

    x, c = x0, norm(x0)
    contexts: list = []
    prepared = prepare(c)
    energies = []
    for k in range(steps):
        y = c if k == 0 else norm(x)
        if recompute_context and k > 0:
            c = y
            prepared = prepare(c)
        x_next = x + precond(direction(x, y, c, prepared))
        if monitor and mixer.energy is not None:
            energies.append(jnp.stack([mixer.energy(y, c), mixer.energy(norm(x_next), c)]))
        x = x_next
    return x, (jnp.stack(energies) if energies else None), contexts


# ----------------------------------------------------------------------------------------------
# The modules that hold a sub-layer's parameters.
# ----------------------------------------------------------------------------------------------


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
    for a parameter name that cannot be an attribute here, and for one whose logical axes are
    unknown or do not match its shape (`cem_jax.kinds.check_params`)."""

    def __init__(self, cfg: ModelConfig, kind: Kind, *, rngs: nnx.Rngs):
        self.kind = kind.name
        dt = jnp.dtype(cfg.param_dtype)
        check_params(kind, cfg)
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
    """P of the CEM step (`precondition`): ρ starts at softplus⁻¹(1) so P
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
        (`fold_preconditioner`)."""
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
        `folds_preconditioner`, where that is exact (`fold_preconditioner`):
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
