"""Flax NNX layers: RMSNorm, CEM (tied) and Llama (untied) attention and gated MLP,
preconditioners, and the sub-layer / block that run the CEM steps (DESIGN.md §1).

The modules only hold parameters (with the logical axis names of `cem_jax.sharding`: "vocab",
"embed", "heads", "kv_heads", "mlp", "norm"; `None` = replicated); the math is the pure
functions of `cem_jax.energies` and `cem_jax.updates`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.energies import AttentionSpec, get_activation
from cem_jax.kvcache import Cache, KVCache
from cem_jax.updates import (
    Mixer,
    fold_preconditioner,
    llama_attention_mixer,
    precondition,
    run_steps,
    swiglu_mixer,
    tied_attention_mixer,
    tied_mlp_mixer,
)

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


class Attention(nnx.Module):
    """Multi-head / grouped-query attention, tied (CEM) or untied (Llama).

    Tied: query Wq [D,H,K], key Wk [D,G,K], and with interaction="dplr" a diagonal d [H,D]
    (diagonal="per_head") or [D] ("shared"), initialised to 0. Untied adds value Wv [D,G,K] and
    output Wo [H,K,D]. Weights start normal(0, init_std).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H, G, K = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_width
        std, dt = cfg.init_std, jnp.dtype(cfg.param_dtype)
        self.tied = cfg.tie_attention
        self.impl = cfg.impl
        self.spec = AttentionSpec(H, G, K, cfg.position == "rope", cfg.rope_theta,
                                  cfg.attention_block, cfg.rope_scaling)
        self.query = param(rngs, (D, H, K), ("embed", "heads", None), std=std, dtype=dt)
        self.key = param(rngs, (D, G, K), ("embed", "kv_heads", None), std=std, dtype=dt)
        if not self.tied:
            self.value = param(rngs, (D, G, K), ("embed", "kv_heads", None), std=std, dtype=dt)
            self.out = param(rngs, (H, K, D), ("heads", None, "embed"), std=std, dtype=dt)
        elif cfg.interaction == "dplr":
            shape, axes = ((H, D), ("heads", "embed")) if cfg.diagonal == "per_head" else \
                ((D,), ("embed",))
            self.diag = param(None, shape, axes, value=0.0, dtype=dt)

    def mixer(self, positions: Array | None, segment_ids: Array | None, dtype,
              out_scale: Array | None = None, cache: Cache | None = None) -> Mixer:
        """The sub-layer's `Mixer`; `out_scale` folds a preconditioner into the output (Wqᵀ/Wo);
        `cache` (this layer's `kvcache.Cache`, leaves [C,...]) is the context to read and write."""
        params = _values(self, ("query", "key", "value", "out", "diag"), dtype)
        if out_scale is not None:
            params["out_scale"] = out_scale.astype(dtype)
        if self.tied:
            return tied_attention_mixer(params, self.spec, positions, segment_ids, impl=self.impl,
                                        cache=cache)
        return llama_attention_mixer(params, self.spec, positions, segment_ids, impl=self.impl,
                                     cache=cache)


class MLP(nnx.Module):
    """Gated MLP, tied (CEM: gate Wg [D,F] doubles as the down projection Wgᵀ, up Wu [D,F]) or
    untied (SwiGLU: adds down Wdown [F,D])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F, std, dt = cfg.d_model, cfg.mlp_dim, cfg.init_std, jnp.dtype(cfg.param_dtype)
        self.tied = cfg.tie_mlp
        self.activation = get_activation(cfg.activation)
        self.gate = param(rngs, (D, F), ("embed", "mlp"), std=std, dtype=dt)
        self.up = param(rngs, (D, F), ("embed", "mlp"), std=std, dtype=dt)
        if not self.tied:
            self.down = param(rngs, (F, D), ("mlp", "embed"), std=std, dtype=dt)

    def mixer(self, positions: Array | None, segment_ids: Array | None, dtype,
              out_scale: Array | None = None, cache: Cache | None = None) -> Mixer:
        """The sub-layer's `Mixer`; `out_scale` folds a preconditioner into the output."""
        del positions, segment_ids, cache  # token-wise
        params = _values(self, ("gate", "up", "down"), dtype)
        if out_scale is not None:
            params["out_scale"] = out_scale.astype(dtype)
        return (tied_mlp_mixer if self.tied else swiglu_mixer)(params, self.activation)


class Preconditioner(nnx.Module):
    """P of the CEM step (`updates.precondition`): ρ starts at softplus⁻¹(1) so P starts at I
    (plus U Uᵀ with U ~ normal(0, init_std) [D,r] for "dplr")."""

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
        (`updates.fold_preconditioner`)."""
        return fold_preconditioner(self.kind, _values(self, ("rho",), jnp.float32), cfg.impl,
                                   cfg.gradient_wrt)


class SubLayer(nnx.Module):
    """Norm + mixer (attention or MLP) + preconditioner, run for `cfg.steps` CEM steps."""

    def __init__(self, cfg: ModelConfig, mixer: Attention | MLP, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = RMSNorm(cfg)
        self.mixer = mixer
        self.precond = Preconditioner(cfg, rngs=rngs)

    def __call__(self, x: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, *, cache: Cache | None = None,
                 monitor: bool = False):
        """x [B,T,D] → (x after the steps [B,T,D], energies [steps,2,B,T] or None, the
        updated `KVCache` [C,...] of an attention sub-layer given a `cache`, else None).

        A scalar or diagonal P is folded into the mixer's output projection where that is
        exact (`updates.fold_preconditioner`): the same update, computed on weights.
        """
        cfg = self.cfg
        out_scale = self.precond.folded(cfg)
        mixer = self.mixer.mixer(positions, segment_ids, x.dtype, out_scale, cache)
        precond = self.precond if out_scale is None else lambda u: u
        x, energies, contexts = run_steps(
            x, mixer, norm_scale=self.norm.scale[...], eps=self.norm.eps, precond=precond,
            steps=cfg.steps, impl=cfg.impl, gradient_wrt=cfg.gradient_wrt,
            recompute_context=cfg.recompute_context, monitor=monitor)
        if cache is None:
            return x, energies, None
        return x, energies, jax.tree.map(lambda *a: jnp.stack(a), *(
            KVCache(ctx.key, ctx.value, ctx.context) for ctx in contexts))


class Block(nnx.Module):
    """One Transformer block: an attention sub-layer then an MLP sub-layer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attention = SubLayer(cfg, Attention(cfg, rngs=rngs), rngs=rngs)
        self.mlp = SubLayer(cfg, MLP(cfg, rngs=rngs), rngs=rngs)

    def __call__(self, x: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, *, cache: Cache | None = None,
                 monitor: bool = False):
        """x [B,T,D] → (x [B,T,D], {"attention": energies, "mlp": energies}, the updated
        attention `KVCache` [C,...] or None) (see SubLayer; `cache` is this layer's)."""
        x, e_attn, cache = self.attention(x, positions, segment_ids, cache=cache,
                                          monitor=monitor)
        x, e_mlp, _ = self.mlp(x, positions, segment_ids, monitor=monitor)
        energies = {k: v for k, v in (("attention", e_attn), ("mlp", e_mlp)) if v is not None}
        return x, energies, cache
