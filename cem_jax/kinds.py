"""Sub-layer kinds: what fills the attention and the MLP sub-layer of a block, by name, from one
registry (DESIGN.md §1–§2: a sub-layer is a gradient step on a conditional energy).

A `Kind` declares
  params(cfg)      its parameters: {name: `Param`(shape, logical axes, init)};
  energy           E(params, y, c, ctx) → fp32 [B,T], a pure function of the variable y [B,T,D]
                   and the fixed context c [B,T,D] (`Context` carries the config, positions,
                   segment ids and a decode cache), or None for a kind with no energy (the
                   untied Llama baseline);
  mixer            optionally the closed form: (params, ctx) → `updates.Mixer`; without one the
                   update is u = -∇_y E (`jax.grad`), the same oracle `impl="autodiff"` takes;
  folds_preconditioner  whether its mixer scales its output projection by params["out_scale"]
                   (P folded into the weights); otherwise the sub-layer applies P to u itself,
                   so P is never dropped;
  cache            its decode cache: "none" (the energy of token t reads y_t and c_t only),
                   "keys", "keys_values" or "keys_context" (`cem_jax.kvcache.KVCache`'s fields;
                   a closed-form mixer reads and writes it through ctx.cache);
  flops            (cfg, T) → (FLOPs per token per context, per step) of a forward pass, or None:
                   then XLA's cost analysis of one step on a [1,T,D] sequence (`kind_flops`).

The built-in kinds are registered below exactly as a user's are (`register_kind`):
cem_attention, cem_dplr_attention and llama_attention for the attention sub-layer; cem_mlp and
swiglu for the MLP. `ModelConfig.attention_kind` / `mlp_kind` choose them by name (by default
from tie_attention, interaction and tie_mlp). A user's kinds live in a module of their own that
the config's top-level `imports` names, so every command that loads the run registers them first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cem_jax.config import KIND_CACHES, KIND_NAMES, ModelConfig
from cem_jax.config_files import did_you_mean
from cem_jax.energies import AttentionSpec, attention_energy, get_activation, mlp_energy
from cem_jax.kvcache import Cache
from cem_jax.sharding import LOGICAL_RULES
from cem_jax.updates import (
    Mixer,
    llama_attention_mixer,
    swiglu_mixer,
    tied_attention_mixer,
    tied_mlp_mixer,
)

Array = jax.Array


class Param(NamedTuple):
    """One parameter of a kind: its shape, its logical axis names (`cem_jax.sharding`: "embed",
    "heads", "kv_heads", "mlp", "vocab", "norm", or None = replicated) and its initial value:
    init None draws normal(0, cfg.init_std), a number fills it with that constant."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: float | None = None


class Context(NamedTuple):
    """What a kind's energy and mixer read besides the parameters, y and c: the model config,
    positions int [B,T] (None: 0…T-1, or after the cache's length), segment_ids int [B,T]
    (packed documents; None: one document per row) and this sub-layer's decode cache (None for a
    whole sequence)."""

    cfg: ModelConfig
    positions: Array | None = None
    segment_ids: Array | None = None
    cache: Cache | None = None


@dataclasses.dataclass(frozen=True)
class Kind:
    """A sub-layer kind (module docstring). `role` is "attention" or "mlp": the config field
    (`attention_kind`, `mlp_kind`) and the place in a block it takes."""

    name: str
    role: str
    params: Callable[[ModelConfig], dict[str, Param]]
    energy: Callable[[dict, Array, Array, Context], Array] | None = None
    mixer: Callable[[dict, Context], Mixer] | None = None
    folds_preconditioner: bool = False
    cache: str = "none"
    flops: Callable[[ModelConfig, int], tuple[float, float]] | None = None


KINDS: dict[str, Kind] = {}
BUILT_IN: frozenset[str] = frozenset()  # the kinds registered below (set at the end)


def register_kind(kind: Kind, *, replace: bool = False) -> Kind:
    """Make `kind` selectable by its name in `ModelConfig.attention_kind` (role "attention") or
    `mlp_kind` (role "mlp"). Returns it. `replace=True` lets a kind of that name be defined again
    (a notebook cell edited and re-run; models built before use the new one when next traced).
    Raises ValueError for a built-in kind's name, a name already registered (without replace,
    or as another role), an unknown role or cache, a kind with neither energy nor mixer, a
    cache without a closed form to read it, or an MLP kind with a cache. A registration lives
    in the process that made it: name its module in the config's `imports`
    (`cem_jax.train_config.TrainConfig`). cem-train checks a user's kind before it trains
    (`check_kind`: a causal energy, a folded preconditioner honoured)."""
    problem = None
    if kind.name in BUILT_IN:
        problem = "is a built-in kind: pick another name"
    elif kind.name in KINDS and not replace:
        problem = "is already registered; pick another name (or pass replace=True)"
    elif kind.name in KINDS and KINDS[kind.name].role != kind.role:
        problem = f"is already registered as an {KINDS[kind.name].role} kind"
    elif kind.role not in KIND_NAMES:
        problem = f"has role {kind.role!r}; use one of {', '.join(KIND_NAMES)}"
    elif kind.cache not in KIND_CACHES:
        problem = f"has cache {kind.cache!r}; use one of {', '.join(KIND_CACHES)}"
    elif kind.energy is None and kind.mixer is None:
        problem = "has neither an energy nor a mixer: give it its energy"
    elif kind.cache != "none" and kind.mixer is None:
        problem = (f"declares cache {kind.cache!r} but no mixer to read it (the -grad of an "
                   f"energy reads c itself): give a closed-form mixer or use cache 'none'")
    elif kind.cache != "none" and kind.role == "mlp":
        problem = "is an MLP kind with a decode cache: only attention sub-layers keep one"
    if problem:
        raise ValueError(f"sub-layer kind {kind.name!r} {problem}")
    KINDS[kind.name] = kind
    if kind.name not in KIND_NAMES[kind.role]:
        KIND_NAMES[kind.role].append(kind.name)  # what ModelConfig accepts
    return kind


def get_kind(name: str) -> Kind:
    """The registered kind called `name`; raises ValueError listing the known ones and how a
    user's kind is registered."""
    if name not in KINDS:
        raise ValueError(f"unknown sub-layer kind {name!r}{did_you_mean(name, list(KINDS))} "
                         f"(known: {', '.join(KINDS)}; a kind of your own: register_kind in a "
                         f"module the config's imports names)")
    return KINDS[name]


def model_kinds(cfg: ModelConfig) -> tuple[Kind, Kind]:
    """(attention kind, MLP kind) of a model (`ModelConfig.kinds`)."""
    return tuple(get_kind(name) for name in cfg.kinds)


def build_mixer(kind: Kind, params: dict, ctx: Context) -> Mixer:
    """The `Mixer` of `kind` with `params` (arrays in the compute dtype, plus "out_scale" when
    the kind folds a preconditioner): its closed form, else u = -∇_y E with the context c as
    what `prepare` keeps. Energies are evaluated on whole sequences only (ctx.cache None)."""
    if kind.mixer is not None:
        mixer = kind.mixer(params, ctx)
        if mixer.energy is None and kind.energy is not None and ctx.cache is None:
            mixer = mixer._replace(energy=lambda y, c: kind.energy(params, y, c, ctx))
        return mixer

    def energy(y, c):
        return kind.energy(params, y, c, ctx)

    def direction(y, c):
        return -jax.grad(lambda y_: energy(y_, c).sum())(y)

    return Mixer(lambda c, index: c, direction, energy)


def _random_inputs(kind: Kind, cfg: ModelConfig, T: int = 4) -> tuple[dict, Array, Array]:
    """Random parameters of `kind` and random y, c [1,T,D] (fp32, fixed seed) for the checks."""
    keys = jax.random.split(jax.random.PRNGKey(0), len(kind.params(cfg)) + 2)
    params = {n: jax.random.normal(k, p.shape) * 0.5
              for (n, p), k in zip(kind.params(cfg).items(), keys[2:], strict=True)}
    y, c = (jax.random.normal(k, (1, T, cfg.d_model)) for k in keys[:2])
    return params, y, c


def _reach(kind: Kind, cfg: ModelConfig) -> tuple[Array, Array]:
    """|∂E_t/∂y_s| and |∂E_t/∂c_s| summed over D, each [T,S] on `_random_inputs`."""
    params, y, c = _random_inputs(kind, cfg)
    wrt_y, wrt_c = jax.jacobian(lambda y_, c_: kind.energy(params, y_, c_, Context(cfg))[0],
                                argnums=(0, 1))(y, c)
    return jnp.abs(wrt_y[:, 0]).sum(-1), jnp.abs(wrt_c[:, 0]).sum(-1)


def _leaks(reach: Array, allowed: Array) -> bool:
    return float((reach * ~allowed).max()) > 1e-6 * (float(reach.max()) + 1e-30)


def _check_energy_shape(kind: Kind, cfg: ModelConfig) -> None:
    """Raise ValueError unless `kind`'s energy runs on `_random_inputs` and gives [1,T]."""
    params, y, c = _random_inputs(kind, cfg)
    try:
        out = jax.eval_shape(lambda p, y_, c_: kind.energy(p, y_, c_, Context(cfg)), params, y, c)
    except Exception as err:  # the user's code: say where it failed, as a config error
        raise ValueError(f"sub-layer kind {kind.name!r}: its energy fails on a random input y, c "
                         f"{list(y.shape)}: {type(err).__name__}: {err}") from err
    if getattr(out, "shape", None) != y.shape[:2]:
        raise ValueError(f"sub-layer kind {kind.name!r}: its energy gives "
                         f"{getattr(out, 'shape', type(out).__name__)} for y, c {list(y.shape)}; "
                         f"E(params, y, c, ctx) must give one energy per token, [B,T] "
                         f"{list(y.shape[:2])}")


def check_params(kind: Kind, cfg: ModelConfig) -> None:
    """Raise ValueError, naming the kind and the parameter, unless each of `kind`'s parameters
    names one logical axis (a rule of `cem_jax.sharding.LOGICAL_RULES`, or None) per dimension
    (checked where a model's layer is built, `cem_jax.layers.KindParams`, and by `check_kind`)."""
    for name, param in kind.params(cfg).items():
        unknown = [a for a in param.axes if a is not None and a not in LOGICAL_RULES]
        if unknown or len(param.axes) != len(param.shape):
            raise ValueError(
                f"sub-layer kind {kind.name!r}: parameter {name!r} of shape {param.shape} names "
                f"logical axes {param.axes}; give one per dimension, each one of "
                f"{', '.join(n for n in LOGICAL_RULES if n not in ('batch', 'length'))} or None "
                f"(replicated)")


def check_kind(kind: Kind, cfg: ModelConfig) -> None:
    """Raise ValueError naming what is wrong with a user's `kind` in the model of `cfg`, checked
    on a random [1,4,D] sequence before a run trains: each parameter names one known logical
    axis (or None) per dimension, its energy must run and give one energy per token ([B,T]), at
    token t read y_t only and the context c_s of s ≤ t only (causal), and a mixer that declares
    `folds_preconditioner` must scale its update by params["out_scale"]."""
    check_params(kind, cfg)
    with jax.ensure_compile_time_eval():  # concrete even where a step is being traced
        if kind.energy is not None:
            _check_energy_shape(kind, cfg)
            wrt_y, wrt_c = _reach(kind, cfg)
            T = wrt_y.shape[0]
            if _leaks(wrt_y, jnp.eye(T, dtype=bool)):
                raise ValueError(f"sub-layer kind {kind.name!r}: its energy at a token reads "
                                 f"the variable y of other tokens; E(params, y, c, ctx)[t] may "
                                 f"read y_t and the context c_s (s ≤ t) only")
            if _leaks(wrt_c, jnp.tril(jnp.ones((T, T), bool))):
                raise ValueError(f"sub-layer kind {kind.name!r}: its energy at a token reads "
                                 f"the context of later tokens (not causal): mask c_s for s > t")
        if kind.mixer is not None and kind.folds_preconditioner:
            params, y, c = _random_inputs(kind, cfg)

            def update(params):
                mixer = kind.mixer(params, Context(cfg))
                return mixer.direction(y, mixer.prepare(c, 0))

            plain, scaled = update(params), update({**params, "out_scale": jnp.float32(0.5)})
            if float(jnp.abs(scaled - 0.5 * plain).max()) > 1e-5 * float(jnp.abs(plain).max()):
                raise ValueError(f"sub-layer kind {kind.name!r} declares folds_preconditioner "
                                 f"but its mixer's update does not scale with "
                                 f"params['out_scale'] (P would be lost): scale its output "
                                 f"projection by params.get('out_scale', 1.0), or leave "
                                 f"folds_preconditioner False")


def check_user_kinds(cfg: ModelConfig) -> None:
    """`check_kind` for each kind of the model of `cfg` that a user registered (the built-in
    ones are tested); cem-train and its dry run call it before anything compiles."""
    for kind in model_kinds(cfg):
        if kind.name not in BUILT_IN:
            check_kind(kind, cfg)


@functools.cache  # once per kind and config: init_cache asks at every decode
def check_decodable(kind: Kind, cfg: ModelConfig) -> None:
    """Raise ValueError if `kind` keeps no decode cache (cache "none") but its energy at token t
    reads the context c at other positions, which a cache-less decode step cannot give it
    (checked on `_random_inputs`: E_t must not move when c_s, s ≠ t, does)."""
    if kind.cache != "none" or kind.energy is None:
        return
    with jax.ensure_compile_time_eval():  # concrete even where a decode loop is being traced
        _, wrt_c = _reach(kind, cfg)
        leaks = _leaks(wrt_c, jnp.eye(wrt_c.shape[0], dtype=bool))
    if leaks:
        raise ValueError(f"sub-layer kind {kind.name!r} declares cache 'none' but its energy at "
                         f"a token reads the context at other tokens, so a decode step cannot "
                         f"compute it against a cache: give it a closed-form mixer that reads "
                         f"ctx.cache (and its cache layout), or evaluate whole sequences")


def kind_flops(kind: Kind, cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """FLOPs per token of a forward pass of `kind`: (per context, per step). A kind without
    `flops` is measured: XLA's cost analysis of one step (prepare + direction) on a [1,T,D]
    fp32 sequence, all of it counted per step."""
    if kind.flops is not None:
        return kind.flops(cfg, seq_len)
    shapes = {n: jax.ShapeDtypeStruct(p.shape, jnp.float32) for n, p in kind.params(cfg).items()}
    x = jax.ShapeDtypeStruct((1, seq_len, cfg.d_model), jnp.float32)

    def step(params, y):
        mixer = build_mixer(kind, params, Context(cfg))
        return mixer.direction(y, mixer.prepare(y, 0))

    cost = jax.jit(step).lower(shapes, x).cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return 0.0, float(cost.get("flops", 0.0)) / seq_len


# ----------------------------------------------------------------------------------------------
# The built-in kinds. Letters: D, H heads, G key heads, K head width, F, N = T the sequence.
# ----------------------------------------------------------------------------------------------


def attention_spec(cfg: ModelConfig) -> AttentionSpec:
    """The `AttentionSpec` of a model's attention sub-layers."""
    return AttentionSpec(cfg.num_heads, cfg.kv_heads, cfg.head_width, cfg.position == "rope",
                         cfg.rope_theta, cfg.attention_block, cfg.rope_scaling)


def _attention_params(cfg: ModelConfig, *, untied: bool = False, diag: bool = False
                      ) -> dict[str, Param]:
    D, H, G, K = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_width
    params = {"query": Param((D, H, K), ("embed", "heads", None)),
              "key": Param((D, G, K), ("embed", "kv_heads", None))}
    if untied:
        params["value"] = Param((D, G, K), ("embed", "kv_heads", None))
        params["out"] = Param((H, K, D), ("heads", None, "embed"))
    if diag:
        params["diag"] = (Param((H, D), ("heads", "embed"), 0.0) if cfg.diagonal == "per_head"
                          else Param((D,), ("embed",), 0.0))
    return params


def _attention_energy(params: dict, y: Array, c: Array, ctx: Context) -> Array:
    return attention_energy(params, y, c, spec=attention_spec(ctx.cfg), positions=ctx.positions,
                            segment_ids=ctx.segment_ids)


def _tied_attention(params: dict, ctx: Context) -> Mixer:
    return tied_attention_mixer(params, attention_spec(ctx.cfg), ctx.positions, ctx.segment_ids,
                                impl=ctx.cfg.impl, cache=ctx.cache)


def _attention_flops(cfg: ModelConfig, seq_len: int, *, untied: bool = False,
                     diag: bool = False) -> tuple[float, float]:
    """Keys (and values) 2·D·G·K each per context; per step the query 2·D·H·K, scores and p·k
    2·H·K·N each, the output 2·H·K·D; the DPLR diagonal head adds 2·D·N per head (once if
    shared) and p·c 2·H·D·N (attention counted over the full N, as PaLM's MFU does)."""
    D, H, G, K, N = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_width, seq_len
    per_step = 2 * D * H * K * 2 + 2 * H * K * N * 2
    if diag:
        per_step += 2 * D * N * (H if cfg.diagonal == "per_head" else 1) + 2 * H * D * N
    return float((2 if untied else 1) * 2 * D * G * K), float(per_step)


def _mlp_params(cfg: ModelConfig, *, untied: bool = False) -> dict[str, Param]:
    D, F = cfg.d_model, cfg.mlp_dim
    params = {"gate": Param((D, F), ("embed", "mlp")), "up": Param((D, F), ("embed", "mlp"))}
    if untied:
        params["down"] = Param((F, D), ("mlp", "embed"))
    return params


def _mlp_flops(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """Up 2·D·F per context; gate and down (Wgᵀ or Wdown) 2·D·F each per step."""
    return float(2 * cfg.d_model * cfg.mlp_dim), float(2 * 2 * cfg.d_model * cfg.mlp_dim)


register_kind(Kind(
    "cem_attention", "attention", _attention_params, _attention_energy, _tied_attention,
    folds_preconditioner=True, cache="keys", flops=_attention_flops))
register_kind(Kind(
    "cem_dplr_attention", "attention", lambda cfg: _attention_params(cfg, diag=True),
    _attention_energy, _tied_attention, folds_preconditioner=True, cache="keys_context",
    flops=lambda cfg, n: _attention_flops(cfg, n, diag=True)))
register_kind(Kind(
    "llama_attention", "attention", lambda cfg: _attention_params(cfg, untied=True), None,
    lambda p, ctx: llama_attention_mixer(p, attention_spec(ctx.cfg), ctx.positions,
                                         ctx.segment_ids, impl=ctx.cfg.impl, cache=ctx.cache),
    folds_preconditioner=True, cache="keys_values",
    flops=lambda cfg, n: _attention_flops(cfg, n, untied=True)))
register_kind(Kind(
    "cem_mlp", "mlp", _mlp_params,
    lambda p, y, c, ctx: mlp_energy(p, y, c, activation=get_activation(ctx.cfg.activation)),
    lambda p, ctx: tied_mlp_mixer(p, get_activation(ctx.cfg.activation)),
    folds_preconditioner=True, flops=_mlp_flops))
register_kind(Kind(
    "swiglu", "mlp", lambda cfg: _mlp_params(cfg, untied=True), None,
    lambda p, ctx: swiglu_mixer(p, get_activation(ctx.cfg.activation)),
    folds_preconditioner=True, flops=_mlp_flops))
BUILT_IN = frozenset(KINDS)
