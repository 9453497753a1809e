"""The decoder-only language model: token embedding, L blocks (scanned), final norm, logits.

`CEMTransformer(cfg, rngs=nnx.Rngs(0))(tokens)` gives fp32 logits [B,T,V]. Under a mesh (the
train steps) the residual stream and the logits are split over the batch axes (`constrain`). With
`tie_attention=tie_mlp=False`, `preconditioner="none"`, `steps=1` it is the Llama of Hugging Face
`transformers` (DESIGN.md §1 "Baseline"); with tying on, every sub-layer is a CEM step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.kinds import check_decodable, model_kinds
from cem_jax.kvcache import Cache, KVCache, cache_contexts
from cem_jax.layers import Block, RMSNorm, param
from cem_jax.numerics import dense, rms_norm
from cem_jax.sharding import constrain

Array = jax.Array


class Output(NamedTuple):
    """The model's forward: `logits` fp32 [B,T,V] (None when not asked for), `hidden` the final
    norm's output h [B,T,D] in `cfg.dtype`, and `cache` the decode cache with the new tokens
    written in (None without one)."""

    logits: Array | None
    hidden: Array
    cache: Cache | None


class CEMTransformer(nnx.Module):
    """Decoder-only LM of CEM (or Llama) blocks chosen by `ModelConfig`.

    Parameters: embedding [V,D] ("vocab","embed"), blocks stacked on a leading "layers" axis
    [L,...] when `cfg.scan_layers` (applied with `nnx.scan`, optionally `nnx.remat`), final
    RMSNorm [D], and an output head [D,V] unless `tie_embeddings` (then logits = h Eᵀ).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           std=cfg.init_std, dtype=dt)
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def make_blocks(rngs):
                return Block(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                 std=cfg.init_std, dtype=dt)

    def __call__(self, tokens: Array, positions: Array | None = None,
                 segment_ids: Array | None = None, *, cache: Cache | None = None,
                 logits: bool = True, monitor: bool = False) -> Output:
        """tokens int [B,T] → `Output`: logits fp32 [B,T,V] (None with `logits=False`: the loss
        takes them from `hidden` in chunks, `cem_jax.loss`), the final norm's output h [B,T,D]
        in `cfg.dtype` (logits = h · `output_head()`) and, given a decode cache, that cache with
        the T tokens written in. One forward for training and decoding.

        positions int [B,T] (RoPE positions; default 0..T-1), segment_ids int [B,T] (packed
        documents: attention stays inside a document). With `monitor`, every sub-layer that has
        an energy records it (`nnx.sow` as `nnx.Intermediate` "energies"): run the model under
        `forward_with_energies` (or `nnx.capture`) to get them.

        With a decode `cache` (`init_cache`) the T tokens are new ones after what the cache
        holds; the returned cache has `length` + T. Positions then default to length …
        length+T-1 and say where documents start (a token at position p reads the p slots
        before its own, `cem_jax.kvcache`), so segment_ids must be None; attention over the
        cache is the closed form whatever `impl` is (the block-causal core and the Pallas kernel
        serve whole sequences). Only logits are computed against a cache: `monitor` or
        `logits=False` with a cache raises ValueError, and so do more tokens than the cache's
        free slots (where the length is concrete, outside jit).
        """
        cfg = self.cfg
        if cache is not None:
            _check_cache(cache, tokens.shape[1], segment_ids, monitor or not logits)
        # Under a mesh the residual stream [B,T,D] is pinned to "batch" after the embedding and
        # after every block, and so are the logits [B,T,V] (V split like the head's "vocab"):
        # weights sharded over "fsdp" get gathered, while each device computes its own rows.
        # The table is gathered before the lookup (its D over "fsdp" would otherwise make XLA
        # gather every row's activations when "fsdp" and "tensor" are both > 1).
        table = constrain(self.embed[...].astype(cfg.dtype), "vocab", None)
        x = constrain(table[tokens], "batch", "length", None)
        x, layers = self._blocks(x, positions, segment_ids, cache, monitor)
        h = rms_norm(x, self.final_norm.scale[...], cfg.norm_eps)
        out = None
        if logits:
            out = dense(h, self.output_head(), preferred_element_type=jnp.float32)
            out = constrain(out, "batch", "length", "vocab")
        return Output(out, h, None if cache is None else
                      Cache(layers, cache.length + tokens.shape[1]))

    def _blocks(self, x: Array, positions, segment_ids, cache: Cache | None, monitor: bool):
        """x [B,T,D] through the L blocks (scanned or in a loop) → (x, the cache's layers with
        the new tokens written in, or None)."""
        cfg = self.cfg

        def apply(block, x, layer_cache):
            if layer_cache is not None:
                layer_cache = Cache(layer_cache, cache.length)
            x, layer_cache = block(x, positions, segment_ids, cache=layer_cache, monitor=monitor)
            return constrain(x, "batch", "length", None), layer_cache

        if cfg.remat == "full":
            apply = nnx.remat(apply)
        layers = None if cache is None else cache.layers
        if cfg.scan_layers:
            @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            def scan_blocks(block, x, layer_cache):
                return apply(block, x, layer_cache)

            x, layers = scan_blocks(self.blocks, x, layers)
        else:
            written = []
            for i, block in enumerate(self.blocks):
                layer_cache = None if layers is None else jax.tree.map(lambda a, i=i: a[i],
                                                                       layers)
                x, layer_cache = apply(block, x, layer_cache)
                written.append(layer_cache)
            if layers is not None:
                layers = jax.tree.map(lambda *a: jnp.stack(a), *written)
        return x, layers

    def output_head(self) -> Array:
        """The output head [D,V] in `cfg.dtype` (the embedding transposed when
        `tie_embeddings`): logits = h · head."""
        head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return head.astype(self.cfg.dtype)


def forward_with_energies(model: CEMTransformer, tokens: Array, positions: Array | None = None,
                          segment_ids: Array | None = None) -> tuple[Output, dict[str, Array]]:
    """The forward (`CEMTransformer.__call__` with `monitor`) and the energies its sub-layers
    recorded: {"attention"|"mlp": fp32 [L, steps, 2, B, T]}, each sub-layer's per-token energy
    before and after each step (see `cem_jax.monitor`); a part with no energy (untied Llama) is
    absent. Works inside jit."""
    out, sown = nnx.capture(model, nnx.Intermediate)(tokens, positions, segment_ids,
                                                     monitor=True)
    layers: dict[str, dict[int, Array]] = defaultdict(dict)
    for path, value in nnx.to_flat_state(sown):
        part, (energies,) = str(path[-2]), value.get_value()
        layers[part][int(path[1]) if len(path) == 4 else 0] = energies
    stacked = {part: (by_layer[0] if model.cfg.scan_layers else
                      jnp.stack([by_layer[i] for i in sorted(by_layer)]))
               for part, by_layer in layers.items()}
    return out, stacked


def _check_cache(cache: Cache, new: int, segment_ids, beyond_logits: bool) -> None:
    """Raise ValueError for a forward a cache cannot serve: segment ids, energies asked for or
    logits not (`beyond_logits`), or more tokens than its slots hold (checked where the filled
    length is known: outside jit; under jit, size the cache for every token, as
    `cem_jax.sample.generate` does)."""
    if segment_ids is not None or beyond_logits:
        raise ValueError("with a decode cache, positions mark the documents (segment_ids "
                         "must be None) and only logits are computed (monitor must be False, "
                         "logits True): run the whole sequence without a cache "
                         "instead")
    if cache.layers.key is None:  # no kind keeps a cache: any number of tokens
        return
    slots = cache.layers.key.shape[-2]
    try:
        filled = int(jnp.max(cache.length))
    except jax.errors.ConcretizationTypeError:  # traced: the caller sized the cache
        filled = 0
    if filled + new > slots:
        raise ValueError(f"the decode cache holds {slots} slots per row and {filled} are "
                         f"filled: {new} more tokens do not fit; make it with init_cache(cfg, "
                         f"batch, slots) large enough for the whole sequence")


def init_cache(cfg: ModelConfig, batch: int, slots: int) -> Cache:
    """An empty decode cache of `slots` slots for `batch` rows in `cfg.dtype`, in the layout the
    attention kind declares (`cem_jax.kinds.Kind.cache`; the shapes: `cem_jax.kvcache`).
    Raises ValueError for a kind that cannot decode against a cache (`check_decodable`)."""
    for kind in model_kinds(cfg):
        check_decodable(kind, cfg)
    L, C, G, K = cfg.num_layers, cache_contexts(cfg), cfg.kv_heads, cfg.head_width
    layout, dt = model_kinds(cfg)[0].cache, jnp.dtype(cfg.dtype)
    key = None if layout == "none" else jnp.zeros((L, C, batch, G, slots, K), dt)
    value = jnp.zeros_like(key) if layout == "keys_values" else None
    context = (jnp.zeros((L, C, batch, slots, cfg.d_model), dt) if layout == "keys_context"
               else None)
    return Cache(KVCache(key, value, context), jnp.zeros((batch,), jnp.int32))


def count_params(model: nnx.Module) -> dict[str, int]:
    """Parameter counts by part: "embedding", "attention", "mlp", "norm", "preconditioner",
    "head" and "total" (integers; stacked layers counted L times)."""
    counts: dict[str, int] = defaultdict(int)
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        if "norm" in names or "final_norm" in names:
            part = "norm"
        elif "precond" in names:
            part = "preconditioner"
        elif "attention" in names:
            part = "attention"
        elif "mlp" in names:
            part = "mlp"
        else:
            part = {"embed": "embedding", "lm_head": "head"}[names[0]]
        counts[part] += int(value.size)
    counts["total"] = sum(counts.values())
    return dict(counts)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """`count_params` of the model of `cfg`, built abstractly (`nnx.eval_shape`: shapes only,
    nothing allocated, so a 100M model costs a second)."""
    return count_params(nnx.eval_shape(lambda: CEMTransformer(cfg, rngs=nnx.Rngs(0))))


def abstract_params(cfg: ModelConfig) -> tuple[dict, dict]:
    """(`jax.ShapeDtypeStruct`s, logical `PartitionSpec`s) of the parameters of the model of
    `cfg`, as pure dicts like `nnx.to_pure_dict(nnx.state(model))` (nothing is allocated; the
    logical names are `cem_jax.sharding`'s)."""
    state = nnx.state(nnx.eval_shape(lambda: CEMTransformer(cfg, rngs=nnx.Rngs(0))))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          nnx.to_pure_dict(state))
    return shapes, nnx.to_pure_dict(nnx.get_partition_spec(state))


def model_from_params(cfg: ModelConfig, params: dict) -> CEMTransformer:
    """A `CEMTransformer` of `cfg` holding the pure dict `params` (as
    `nnx.to_pure_dict(nnx.state(model))` gives: arrays, tracers or ShapeDtypeStructs, so it
    also serves inside jit). Raises ValueError naming the first parameter whose shape or dtype
    differs from what `cfg` builds, or that is missing or extra."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CEMTransformer(cfg, rngs=nnx.Rngs(0))))
    want, got = _shapes(nnx.to_pure_dict(state)), _shapes(params)
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            raise ValueError(f"parameter {name}: the config expects (shape, dtype) "
                             f"{want.get(name, 'nothing')}, got {got.get(name, 'nothing')}")
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _shapes(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(path): (tuple(x.shape), str(x.dtype))
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
