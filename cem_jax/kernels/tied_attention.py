"""The public tied-attention op: validation, padding, backend dispatch and the custom VJP.

CEM attention (DESIGN.md §1) is attention whose values are its keys:

    o_t = Σ_{s≤t} softmax_s(β q_t·k_s) k_s,     E_t = -(1/β) log Σ_{s≤t} exp(β q_t·k_s)

The flash kernels (FlashAttention-2, Dao 2023, arXiv 2307.08691) read one tensor for keys and
values, keep the per-row log-sum-exp for their backward pass and return it as the energy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from cem_jax.kernels import gpu, tpu
from cem_jax.kernels.common import (
    BlockSizes,
    KernelParams,
    check_compiled_gpu_blocks,
    clip_block,
    pad_axis,
    resolve_backend,
    round_up,
    validate,
)
from cem_jax.kernels.reference import tied_attention_reference
from cem_jax.sharding import target_device_kind

Array = jax.Array

_KERNELS = {"tpu": tpu, "gpu": gpu}


def tied_attention(q: Array, k: Array, *, causal: bool = True, segment_ids: Array | None = None,
                   scale: float | None = None, return_energy: bool = False,
                   block_sizes: BlockSizes | None = None, backend: str | None = None,
                   interpret=None):
    """Causal tied-key/value flash attention: values are the keys (CEM, DESIGN.md §1).

    Args:
      q: queries [B,T,H,K], float32 / bfloat16 / float16.
      k: keys, which are also the values, [B,S,G,K], same dtype; H % G == 0 (GQA: query
        head h reads key head h // (H/G), as Hugging Face `repeat_kv`).
      causal: query t reads keys s ≤ t (top-left aligned when S != T).
      segment_ids: int [B,T] ids of packed documents (needs S == T); attention stays inside a
        document. Every query must see at least one key (true for causal self-attention).
      scale: β, the inverse temperature (default 1/√K).
      return_energy: also return the energy -(1/β)·logsumexp_s(β q_t·k_s), fp32 [B,H,T]
        (differentiable too). Summed over heads it is `cem_jax.energies.attention_energy`
        when q, k are the rotated queries and keys of a CEM layer.
      block_sizes: `BlockSizes` (default `BlockSizes.get_default(backend)`).
      backend: "tpu" (Pallas/Mosaic TPU), "gpu" (Pallas/Triton), "xla" (the `jnp` reference,
        differentiated by autodiff) or None: by the platform traced for (TPU → "tpu",
        GPU → "gpu", CPU → "xla", or "gpu" interpreted when `interpret` is set): the device
        of the abstract mesh in context when it has one (lowering for a TPU from a CPU host),
        else `jax.default_backend()` (`cem_jax.sharding.target_platform`).
      interpret: run the Pallas kernel in interpret mode (CPU); None = True exactly when that
        platform is the CPU.
        For "tpu" a `jax.experimental.pallas.tpu.InterpretParams` selects the TPU interpreter.

    Returns:
      o [B,T,H,K] in q.dtype, or (o, energy fp32 [B,H,T]) with return_energy.

    Any length works: T and S are padded to a multiple of the tiles (padded keys are masked),
    K to the lane width (TPU: 128) or a power of two (GPU), and the result sliced back.
    Gradients (dq, dk) come from the backward Pallas kernels through `jax.custom_vjp`; the
    value gradient is folded into dk. The kernels cannot be differentiated twice.

    Raises:
      ValueError: wrong rank, non-float or mismatched dtypes, H % G != 0, mismatched batch or
        head width, bad segment_ids, scale, block_sizes or backend; block sizes that are not
        powers of two ≥ 16 for the compiled GPU kernel; tiles whose VMEM is over what Mosaic
        gives a compiled TPU kernel (`cem_jax.kernels.tpu.check_vmem`, before compiling).
    """
    validate(q, k, causal, segment_ids, scale, block_sizes, backend)
    backend, interpret = resolve_backend(backend, interpret)
    B, T, H, K = q.shape
    S, G = k.shape[1], k.shape[2]
    beta = 1.0 / math.sqrt(K) if scale is None else float(scale)
    if backend == "xla":
        o, lse = tied_attention_reference(q, k, causal=causal, segment_ids=segment_ids,
                                          scale=beta)
    else:
        bs = block_sizes or BlockSizes.get_default(backend)
        least = 8
        if backend == "gpu" and not interpret:
            check_compiled_gpu_blocks(bs)
            least = 16
        bq, bqb = clip_block(bs.block_q, T, least), clip_block(bs.block_q_bwd, T, least)
        bk, bkb = clip_block(bs.block_k, S, least), clip_block(bs.block_k_bwd, S, least)
        Tp = round_up(T, math.lcm(bq, bqb))
        Sp = round_up(S, math.lcm(bk, bkb))
        if S == T:  # self-attention: one padded length, so segment ids pair up
            Tp = Sp = round_up(T, math.lcm(bq, bqb, bk, bkb))
        Kp = round_up(K, 128) if backend == "tpu" else max(16, 1 << (K - 1).bit_length())
        params = KernelParams(causal=causal, scale=beta, kv_len=S if Sp != S else None,
                              ratio=H // G, block_q=bq, block_k=bk, block_q_bwd=bqb,
                              block_k_bwd=bkb, num_warps=bs.num_warps,
                              num_stages=bs.num_stages, num_warps_bwd=bs.num_warps_bwd,
                              num_stages_bwd=bs.num_stages_bwd, fused_bwd=bs.fused_bwd,
                              interpret=interpret)
        if backend == "tpu" and not interpret:
            tpu.check_vmem(params, Kp, q.dtype.itemsize, target_device_kind())
        qp = pad_axis(pad_axis(q, 1, Tp), 3, Kp)  # no copy when nothing needs padding
        kp = pad_axis(pad_axis(k, 1, Sp), 3, Kp)
        seg = None
        if segment_ids is not None:  # pad with the edge id: padded rows still see a key
            seg = pad_axis(segment_ids.astype(jnp.int32), 1, Tp, mode="edge")
        o, lse = _flash(qp, kp, seg, backend, params)
        o = o[:, :T, :, :K]
        lse = lse[:, :, :T]
    if return_energy:
        return o, -lse / beta
    return o


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, seg, backend, params):
    """(o [B,Tp,H,Kp], lse [B,H,Tp]) of the padded problem on one Pallas backend."""
    return _KERNELS[backend].forward(q, k, seg, seg, params)


def _flash_fwd(q, k, seg, backend, params):
    o, lse = _KERNELS[backend].forward(q, k, seg, seg, params)
    return (o, lse), (q, k, seg, o, lse)


def _flash_bwd(backend, params, residuals, cotangents):
    q, k, seg, o, lse = residuals
    do, dlse = cotangents
    # δ = rowsum(do ⊙ o) - ∂L/∂lse: the lse cotangent enters ds = p ⊙ (dp - δ) like δ does.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B,Tp,H]
    delta = delta.transpose(0, 2, 1) - dlse.astype(jnp.float32)
    dq, dk = _KERNELS[backend].backward(q, k, seg, seg, do.astype(q.dtype), lse, delta, params)
    return dq, dk, None


_flash.defvjp(_flash_fwd, _flash_bwd)
