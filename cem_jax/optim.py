"""The optimizer: optax AdamW, warmup + cosine learning rate, global-norm clipping, and weight
decay on weight matrices only.

The optimizer state's tree structure depends on no `OptimizerConfig` field (clipping off is an
`optax.identity()` in the clip's place, weight_decay 0 keeps its masked transform): a run
resumes from its checkpoint whatever optimizer setting changed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from cem_jax.config import ModelConfig
from cem_jax.train_config import OptimizerConfig

NO_DECAY = ("norm", "final_norm", "precond", "diag", "bias")  # path names exempt from decay


def check_trainable(cfg: ModelConfig) -> None:
    """Raise ValueError for weights stored in a dtype this optimizer cannot train
    (`model.param_dtype` bfloat16).

    optax applies each update in its parameter's dtype, and there is no float32 master copy: an
    update smaller than half a bfloat16 ulp of its weight (≈0.004 at 1.0) is rounded away, so
    norm scales and preconditioner step sizes stop learning without a sign (20 steps at lr 6e-4:
    0 of 320 norm-scale entries moved). Computing in bfloat16 (`model.dtype`) with float32
    storage keeps bfloat16 matmuls and costs 12 bytes of state per parameter; a bfloat16 copy
    beside a float32 master would cost 14 and save only the bytes of FSDP's all-gathers.
    """
    if jnp.dtype(cfg.param_dtype).itemsize < 4:
        raise ValueError(f"model.param_dtype = {cfg.param_dtype} stores the weights without a "
                         f"float32 master copy, so updates below half a {cfg.param_dtype} ulp "
                         f"are rounded away and the model stops learning: keep param_dtype: "
                         f"float32 and set model.dtype: bfloat16 to compute in bfloat16 (as "
                         f"configs/cem_full_100m.yaml does)")


def learning_rate(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The rate of step n = 1 … `total_steps`, as a function of the steps taken before it
    (n - 1, the count optax passes): lr·n/W over the first W = `warmup_steps` steps (so step 1
    already learns), then a cosine down to `lr·min_lr_ratio` at step `total_steps` (constant
    after). A warmup longer than the run is cut to it (the rate peaks at its last step)."""
    warmup = min(cfg.warmup_steps, total_steps)
    by_step = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup,
                                                 max(total_steps, warmup + 1),
                                                 end_value=cfg.lr * cfg.min_lr_ratio)
    return lambda taken: by_step(taken + 1)


def decay_mask(params) -> dict:
    """True for the parameters that get weight decay: every parameter whose path names none of
    `NO_DECAY` (embedding, head, attention and MLP projections)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in NO_DECAY for k in path), params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """chain(clip_by_global_norm(clip_norm), or identity when clip_norm is 0; AdamW(schedule,
    b1, b2, eps, weight_decay, mask=`decay_mask`)). Apply to gradients of a pure-dict
    parameter tree. Both clip stages keep an empty state: the state's structure is the same
    for every `cfg`."""
    clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, optax.adamw(learning_rate(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                                         eps=cfg.eps, weight_decay=cfg.weight_decay,
                                         mask=decay_mask))
