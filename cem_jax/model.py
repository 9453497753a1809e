"""The decoder-only language model: token embedding, L blocks (scanned), final norm, logits.

`CEMTransformer(cfg, rngs=nnx.Rngs(0))(tokens)` gives fp32 logits [B,T,V]. Under a mesh (the
train steps) the residual stream and the logits are split over the batch axes (`constrain`). With
`tie_attention=tie_mlp=False`, `preconditioner="none"`, `steps=1` it is the Llama of Hugging Face
`transformers` (DESIGN.md §1 "Baseline"); with tying on, every sub-layer is a CEM step.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.layers import BATCH_AXES, Block, RMSNorm, constrain, param
from cem_jax.updates import dense, rms_norm

Array = jax.Array


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
                 segment_ids: Array | None = None, *, return_energies: bool = False):
        """tokens int [B,T] → logits fp32 [B,T,V].

        positions int [B,T] (RoPE positions; default 0..T-1), segment_ids int [B,T] (packed
        documents: attention stays inside a document). With `return_energies`, also returns
        {"attention"|"mlp": fp32 [L, steps, 2, B, T]}: each tied sub-layer's per-token energy
        before and after each step (see `cem_jax.monitor`).
        """
        cfg = self.cfg
        # Under a mesh the residual stream [B,T,D] is pinned to the batch axes after the
        # embedding and after every block, and so are the logits [B,T,V] (V over "tensor", like
        # the head's "vocab" axis): weights sharded over "fsdp" get gathered, while each device
        # computes only its own rows.
        x = constrain(self.embed[...].astype(cfg.dtype)[tokens], BATCH_AXES, None, None)

        def apply(block, x):
            x, energies = block(x, positions, segment_ids, monitor=return_energies)
            return constrain(x, BATCH_AXES, None, None), energies

        if cfg.remat == "full":
            apply = nnx.remat(apply)
        if cfg.scan_layers:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
            def scan_blocks(block, x):
                return apply(block, x)

            x, energies = scan_blocks(self.blocks, x)
        else:
            per_layer = []
            for block in self.blocks:
                x, e = apply(block, x)
                per_layer.append(e)
            energies = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        h = rms_norm(x, self.final_norm.scale[...], cfg.norm_eps)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = dense(h, head.astype(h.dtype), preferred_element_type=jnp.float32)
        logits = constrain(logits, BATCH_AXES, None, "tensor")
        return (logits, energies) if return_energies else logits


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
