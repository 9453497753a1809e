"""The attention cores under CEM's and Llama's attention mixers (`cem_jax.updates`), and the
choice among them: `attend` (softmax attention with a flash-style VJP whose value gradient folds
into the keys when values are keys), the block-causal core on it (XLA), the tied Pallas kernel
(`cem_jax.kernels`), JAX's splash attention for untied attention on a TPU and cuDNN's flash
attention; `attention_impl` picks one for an `impl` and the platform traced for."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cem_jax.config import CUDNN_MAX_HEAD_WIDTH
from cem_jax.energies import AttentionSpec
from cem_jax.sharding import logical_to_mesh, target_platform

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attend(q: Array, k: Array, v: Array, mask: Array, beta: float) -> Array:
    """o = softmax(β q kᵀ, masked) v, per batch and key head; the rows of q may hold several
    query heads of one group (GQA) and several positions.

    q [B,G,M,K], k [B,G,S,K], v [B,G,S,V], mask bool broadcastable to [B,G,M,S] (True = may
    attend; every row needs one True). Scores and softmax in fp32; returns [B,G,M,V] in q.dtype.
    Backward (flash-attention style, Dao et al. 2022): with δ = rowsum(do ⊙ o),
    ds = β p ⊙ (do vᵀ - δ), dq = ds k, dk = dsᵀ q, dv = pᵀ do; passing the same array as k and v
    (CEM: values are the keys) folds the value gradient into dk.
    """
    return _attend_fwd(q, k, v, mask, beta)[0]


def _attend_fwd(q, k, v, mask, beta):
    logits = jnp.matmul(q, k.swapaxes(-1, -2), preferred_element_type=jnp.float32)
    p = jax.nn.softmax(jnp.where(mask, logits * beta, -jnp.inf), axis=-1).astype(q.dtype)
    o = jnp.matmul(p, v)
    return o, (q, k, v, p, o)


def _attend_bwd(beta, residuals, do):
    q, k, v, p, o = residuals
    delta = jnp.sum(do.astype(jnp.float32) * o, axis=-1, keepdims=True)
    dp = jnp.matmul(do, v.swapaxes(-1, -2), preferred_element_type=jnp.float32)
    ds = (beta * p * (dp - delta)).astype(q.dtype)
    dq = jnp.matmul(ds, k)
    dk = jnp.matmul(ds.swapaxes(-1, -2), q)
    dv = jnp.matmul(p.swapaxes(-1, -2), do)
    return dq, dk, dv, None


attend.defvjp(_attend_fwd, _attend_bwd)


def causal_attention(q: Array, k: Array, v: Array, mask: Array, spec: AttentionSpec, *,
                      skip: bool = True) -> Array:
    """`attend` over query blocks of `spec.block_size`: q [B,G,R,T,K], k [B,G,S,K],
    v [B,G,S,V], mask [B|1,1,1,T,S] → o [B,G,R,T,V]. With `skip` (keys are the sequence itself)
    rows [lo, hi) read keys [0, hi) only; without (keys are cache slots) every slot, masked."""
    B, G, R, T, K = q.shape
    blocks = []
    for lo in range(0, T, spec.block_size):
        hi, n = min(lo + spec.block_size, T), min(spec.block_size, T - lo)
        end = hi if skip else k.shape[-2]
        qb = q[:, :, :, lo:hi].reshape(B, G, R * n, K)
        mb = jnp.broadcast_to(mask[..., lo:hi, :end], (mask.shape[0], 1, R, n, end))
        ob = attend(qb, k[:, :, :end], v[:, :, :end], mb.reshape(-1, 1, R * n, end), spec.beta)
        blocks.append(ob.reshape(B, G, R, n, -1))
    return jnp.concatenate(blocks, axis=-2)


def pallas_attention(q: Array, k: Array, segment_ids: Array | None, spec: AttentionSpec
                      ) -> Array:
    """The tied kernel on heads-major q [B,H,T,W], k [B,G,S,W] (W = K, or K + D with DPLR) and
    int [B,T] segment_ids; returns o [B,H,T,W] in q.dtype.

    The kernel is built for the platform traced for (`cem_jax.sharding.target_platform`:
    the mesh's device, so lowering for a TPU from a CPU host embeds the Mosaic kernel), and
    interpreted on CPU. Under a mesh of more than one device it runs per device in a
    `jax.shard_map` (`_per_device`: rows over data×fsdp, key heads over tensor when they
    divide it, query heads following their key heads, so h // (H/G) stays on the device).
    """
    # imported on use: Pallas stays off the xla/autodiff paths
    from cem_jax.kernels import tied_attention

    interpret = True if target_platform() == "cpu" else None

    def attend(q, k, segment_ids=None):
        o = tied_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), causal=True,
                           segment_ids=segment_ids, scale=spec.beta, interpret=interpret)
        return o.transpose(0, 2, 1, 3)

    return _per_device(attend, (q, k), segment_ids)


def splash_attention(q: Array, k: Array, v: Array, segment_ids: Array | None,
                     spec: AttentionSpec) -> Array:
    """Untied causal flash attention on a TPU: JAX's splash attention kernel
    (`jax.experimental.pallas.ops.tpu.splash_attention`, Pallas/Mosaic; what MaxText runs),
    the Llama baseline's core there. Heads-major q [B,H,T,K], k and v [B,G,T,K] (GQA: each key
    head's R = H/G query heads as one multi-query call), int [B,T] segment_ids; returns
    o [B,H,T,K] in q.dtype. The queries are scaled by β before the kernel (it takes none).
    Interpreted on CPU (the tests' reference check); under a mesh it runs per device in a
    `jax.shard_map` as `pallas_attention` does. Raises ValueError (the kernel's) for a T its
    blocks do not divide."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    interpret = target_platform() == "cpu"

    def attend(q, k, v, segment_ids=None):
        B, H, T, K = q.shape
        G = k.shape[1]
        mask = masks.MultiHeadMask([masks.CausalMask((T, T))] * (H // G))
        kernel = splash.make_splash_mqa(mask, head_shards=1, q_seq_shards=1,
                                        interpret=interpret)
        ids = None if segment_ids is None else splash.SegmentIds(q=segment_ids,
                                                                 kv=segment_ids)
        per_group = jax.vmap(kernel, in_axes=(0, 0, 0, None))
        o = jax.vmap(per_group, in_axes=(0, 0, 0, None if ids is None else 0))(
            (q * spec.beta).reshape(B, G, H // G, T, K), k, v, ids)
        return o.reshape(B, H, T, K).astype(q.dtype)

    return _per_device(attend, (q, k, v), segment_ids)


def _per_device(attend, heads: tuple[Array, ...], segment_ids: Array | None) -> Array:
    """`attend(*heads[, segment_ids])` (arrays [B, heads, T, ...]; the key heads' count is
    heads[1]'s) per device in a `jax.shard_map` under a mesh of more than one device, since
    XLA cannot partition a Mosaic (or Triton) call: each device attends over its own rows
    ("batch" → data×fsdp) and, when the key-head count divides "tensor", its own heads (query
    heads follow their key heads); an axis that does not divide is left whole
    (`cem_jax.sharding.logical_to_mesh`), computed on every device."""
    args = heads if segment_ids is None else (*heads, segment_ids)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.size <= 1:
        return attend(*args)
    rows, kv = logical_to_mesh(("batch", "kv_heads"), heads[1].shape[:2], mesh.shape)
    spec = jax.sharding.PartitionSpec(rows, kv, None, None)
    specs = (*[spec] * len(heads), jax.sharding.PartitionSpec(rows, None))
    # check_vma=False: the kernels' out_shape structs carry no varying-axes annotation
    return jax.shard_map(attend, mesh=mesh, in_specs=specs[:len(args)], out_specs=spec,
                         check_vma=False)(*args)


def attention_impl(impl: str, dtype, width: int, *, tied: bool) -> str:
    """The attention core an `impl` runs on the platform traced for
    (`cem_jax.sharding.target_platform`), for heads `width` wide (K, or K + D with DPLR) in
    compute `dtype`: "xla", "pallas", "splash" or "cudnn".

    "auto" is the fastest correct core there: on a GPU cuDNN's flash attention (bf16/fp16 and
    heads ≤ `CUDNN_MAX_HEAD_WIDTH`), else the tied Pallas kernel for tied attention; on a TPU
    the tied Pallas kernel for tied attention and JAX's splash attention for untied; else (CPU,
    untied attention on a GPU in fp32) the XLA core. "autodiff" attends with the XLA core where
    a closed form runs. "pallas" for untied attention is splash attention on a TPU and the XLA
    core elsewhere (the tied kernel's values are its keys). Raises ValueError for "cudnn" off
    a GPU, or in a dtype or head width cuDNN does not take.
    """
    platform = target_platform()
    on_gpu = platform in ("gpu", "cuda", "rocm")
    cudnn_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and width <= CUDNN_MAX_HEAD_WIDTH
    if impl == "auto":
        if on_gpu and cudnn_ok:
            return "cudnn"
        if platform == "tpu":
            return "pallas" if tied else "splash"
        return "pallas" if tied and platform != "cpu" else "xla"
    if impl == "cudnn" and not (on_gpu and cudnn_ok):
        raise ValueError(f"impl='cudnn' runs cuDNN's flash attention, which needs a GPU (this "
                         f"is {platform}), bfloat16 or float16 (here {jnp.dtype(dtype).name}) "
                         f"and heads at most {CUDNN_MAX_HEAD_WIDTH} wide (here {width}); use "
                         f"impl='auto' to pick the fastest path this platform has")
    if impl == "pallas" and not tied:
        return "splash" if platform == "tpu" else "xla"
    return "xla" if impl == "autodiff" else impl


def cudnn_attention(q: Array, k: Array, v: Array, segment_ids: Array | None,
                     spec: AttentionSpec) -> Array:
    """cuDNN's causal flash attention on heads-major q [B,H,T,K], k and v [B,G,S,K] (GQA:
    H = G·R) → o [B,H,T,K] in q.dtype. Packed documents (segment_ids int [B,T]) go in as
    cuDNN's segment offsets and lengths (`packed_segments`), causal within each; the public
    `jax.nn.dot_product_attention` has no segments, so this uses
    `jax._src.cudnn.fused_attention_stablehlo` (a private module: check it on JAX upgrades).
    """
    if segment_ids is None:
        o = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                         v.transpose(0, 2, 1, 3), scale=spec.beta,
                                         is_causal=True, implementation="cudnn")
        return o.transpose(0, 2, 1, 3)
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    offsets, lengths = packed_segments(segment_ids)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=spec.beta, mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BNTH")


def packed_segments(segment_ids: Array) -> tuple[Array, Array]:
    """cuDNN's packed layout of segment ids int [B,T] (a new segment wherever the id changes):
    (offsets int32 [B,T+1]: each segment's first position, then -1; lengths int32 [B,T]: each
    segment's length, then -1), T segments at most per row."""
    B, T = segment_ids.shape
    steps = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
    first = jnp.sort(jnp.where(starts, steps, T), axis=1)  # starts ascending, then T
    ends = jnp.concatenate([first[:, 1:], jnp.full((B, 1), T, jnp.int32)], axis=1)
    valid = first < T
    offsets = jnp.where(valid, first, -1).astype(jnp.int32)
    lengths = jnp.where(valid, ends - first, -1).astype(jnp.int32)
    return jnp.concatenate([offsets, jnp.full((B, 1), -1, jnp.int32)], axis=1), lengths
