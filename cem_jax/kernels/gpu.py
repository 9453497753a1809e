"""GPU kernels (Pallas on Triton) of causal tied-key/value flash attention, forward and backward.

FlashAttention-2 (Dao, arXiv 2307.08691) specialised to CEM's values-are-keys attention
(DESIGN.md §1): one tensor k is read for both the scores and the weighted sum, and the backward
folds the value gradient into dk. The kernels read the op's own sequence-major layout (no
transposes: a tile is bq rows of one head, strided by H·Kp), every array already padded by
`cem_jax.kernels.tied_attention` (tiles divide the lengths; K padded to a power of two ≥ 16):

    q, do, o [B,Tp,H,Kp]   k [B,Sp,G,Kp]   lse, delta fp32 [B,H,Tp]   segment ids int32 [B,Tp]

Forward, grid (Tp/bq, B, H): one program keeps a query tile in registers and loops over key
tiles up to the diagonal (causal tiles above it are never visited; only tiles that straddle
it build the causal mask), with the online softmax; it writes o and lse = m + log l.
Backward (default, `fused_bwd`): one kernel, grid (Sp/bk, B, G): a program keeps a key tile
and its dk accumulator in registers and loops over the R query heads of its group and their
query tiles from the diagonal on; each pair's dq contribution is added atomically into an fp32
dq, cast to q.dtype afterwards. With p = exp(β q kᵀ - lse), δ = rowsum(do ⊙ o) - ḡ
(ḡ: the cotangent of lse), ds = β p ⊙ (do kᵀ - δ):

    dq = ds k,    dk = dsᵀ q + pᵀ do    (the second term is the value gradient, folded)

five tile matmuls per (query tile, key tile) pair (q kᵀ, do kᵀ, ds k, dsᵀ q, pᵀ do), the
FlashAttention-2 count. Split (`fused_bwd=False`, kept to time against): a dq kernel, grid
(Tp/bq, B, H), over key tiles, then the same key-tile kernel without dq; both recompute q kᵀ
and do kᵀ, 7 tile matmuls per pair, no atomics (bitwise reproducible dq).

Verified in interpret mode on CPU (`interpret=True`, how CI runs it; the atomic add is a plain
add there) and by lowering for CUDA on CPU (the kernels launched, their launch settings and the
tt.dot count of each loop). The split backward and the forward were verified compiled on an
H200 (jax 0.11.2: benchmarks/results/kernel_tests_h200.txt); the fused backward has not been
compiled on a GPU yet. Speed at B=4, T=4096, H=16, K=128, bf16:
benchmarks/results/attention_h200.txt (before the fused backward). JAX has deprecated Pallas'
Triton backend in favour of Mosaic GPU; this kernel still compiles and runs on jax 0.11.2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cem_jax.kernels.common import (
    MASK_VALUE,
    KernelParams,
    block_mask,
    dot_nn,
    dot_nt,
    dot_tn,
)

Array = jax.Array


LOG2E = 1.4426950408889634  # exp(x) = exp2(x·log2 e): the GPU's native exponential
LN2 = 0.6931471805599453


def _compiler_params(width: int, bq: int, bk: int, num_warps: int | None, num_stages: int):
    warps = num_warps or (4 if width <= 64 or bq * bk < 128 * 64 else 8)
    return plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)


def _last_first(n, count: int):
    """Query tile of grid step n. The grids put the tile axis first (consecutive programs
    share one head's keys in L2) and run the query tiles last-first, so that the longest
    causal rows start first."""
    return count - 1 - n


def _segments(refs, has_seg):
    return (refs[0], refs[1], refs[2:]) if has_seg else (None, None, refs)


def _fwd_kernel(q_ref, k_ref, *refs, p: KernelParams, has_seg: bool):
    sq_ref, sk_ref, (o_ref, lse_ref) = _segments(refs, has_seg)
    bq, bk = p.block_q, p.block_k
    num_k = k_ref.shape[0] // bk
    i = _last_first(pl.program_id(0), pl.num_programs(0))
    q = q_ref[...]
    rows = i * bq + jnp.arange(bq)[:, None]
    seg_q = sq_ref[...][:, None] if has_seg else None

    def body(j, carry, causal):  # m and s in base-2 units (s = β q·k · log2 e)
        acc, m, l = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        s = dot_nt(q, k) * (p.scale * LOG2E)
        cols = start + jnp.arange(bk)[None, :]
        seg_k = sk_ref[pl.ds(start, bk)][None, :] if has_seg else None
        mask = block_mask(rows, cols, seg_q, seg_k, causal=causal, kv_len=p.kv_len)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        e = jnp.exp2(s - m_new[:, None])
        if mask is not None:
            e = jnp.where(mask, e, 0.0)
        l = alpha * l + jnp.sum(e, axis=1)
        acc = alpha[:, None] * acc + dot_nn(e.astype(k.dtype), k)
        return acc, m_new, l

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = _causal_loops(body, init, *_kv_range(i, bq, bk, num_k, p.causal))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m * LN2 + jnp.log(l)


def _kv_range(i, bq, bk, num_k, causal):
    """Key tiles of query tile i: [0, full) lie wholly below the diagonal (no causal mask),
    [full, hi) straddle it; tiles from hi on are above it and never visited (hi None: no
    causal mask, all num_k tiles)."""
    if not causal:
        return num_k, None
    hi = jnp.minimum(lax.div((i + 1) * bq + bk - 1, bk), num_k)
    full = jnp.minimum(lax.div(i * bq + 1, bk), hi)
    return full, hi


def _causal_loops(body, carry, full, hi):
    carry = lax.fori_loop(0, full, functools.partial(body, causal=False), carry)
    if hi is not None:
        carry = lax.fori_loop(full, hi, functools.partial(body, causal=True), carry)
    return carry


def forward(q: Array, k: Array, seg_q: Array | None, seg_k: Array | None, p: KernelParams
            ) -> tuple[Array, Array]:
    """o [B,Tp,H,Kp] (q.dtype), lse fp32 [B,H,Tp] for padded inputs q [B,Tp,H,Kp],
    k [B,Sp,G,Kp]."""
    B, Tp, H, Kp = q.shape
    Sp, R, bq = k.shape[1], p.ratio, p.block_q
    num_q = Tp // bq
    has_seg = seg_q is not None
    row = lambda n, b, h: (b, _last_first(n, num_q), h, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((None, bq, None, Kp), row),
                pl.BlockSpec((None, Sp, None, Kp), lambda n, b, h: (b, 0, h // R, 0))]
    args = [q, k]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda n, b, h: (b, _last_first(n, num_q))),
                     pl.BlockSpec((None, Sp), lambda n, b, h: (b, 0))]
        args += [seg_q, seg_k]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, p=p, has_seg=has_seg),
        grid=(num_q, B, H),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, Kp), row),
                   pl.BlockSpec((None, None, bq),
                                lambda n, b, h: (b, h, _last_first(n, num_q)))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        compiler_params=_compiler_params(Kp, bq, p.block_k, p.num_warps, p.num_stages),
        interpret=p.interpret,
        name="cem_tied_attention_fwd_gpu",
    )(*args)


def _tile_grads(q, k, do, lse, delta, mask, scale):
    """p = exp(β q kᵀ - lse) (0 where masked) and ds = β p ⊙ (do kᵀ - δ), fp32 [bq,bk]: the
    two tile matmuls every backward kernel recomputes. lse comes in base-2 units (· log2 e)."""
    pr = jnp.exp2(dot_nt(q, k) * (scale * LOG2E) - lse)
    if mask is not None:
        pr = jnp.where(mask, pr, 0.0)
    return pr, scale * pr * (dot_nt(do, k) - delta)


def _dq_kernel(q_ref, k_ref, do_ref, lse_ref, delta_ref, *refs, p: KernelParams, has_seg: bool):
    """Split backward only: dq += ds k over the key tiles of one query tile (3 matmuls)."""
    sq_ref, sk_ref, (dq_ref,) = _segments(refs, has_seg)
    bq, bk = p.block_q_bwd, p.block_k_bwd
    num_k = k_ref.shape[0] // bk
    i = _last_first(pl.program_id(0), pl.num_programs(0))
    q, do = q_ref[...], do_ref[...]
    lse, delta = LOG2E * lse_ref[...][:, None], delta_ref[...][:, None]
    rows = i * bq + jnp.arange(bq)[:, None]
    seg_q = sq_ref[...][:, None] if has_seg else None

    def body(j, dq, causal):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        cols = start + jnp.arange(bk)[None, :]
        seg_k = sk_ref[pl.ds(start, bk)][None, :] if has_seg else None
        mask = block_mask(rows, cols, seg_q, seg_k, causal=causal, kv_len=p.kv_len)
        _, ds = _tile_grads(q, k, do, lse, delta, mask, p.scale)
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = _causal_loops(body, jnp.zeros(q.shape, jnp.float32),
                       *_kv_range(i, bq, bk, num_k, p.causal))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dk_kernel(q_ref, k_ref, do_ref, lse_ref, delta_ref, *refs, p: KernelParams, has_seg: bool):
    """dk += dsᵀ q + pᵀ do over the query tiles of one key tile, and with `p.fused_bwd` also
    dq += ds k, added atomically into the fp32 dq of the whole group (5 matmuls; split: 4)."""
    sq_ref, sk_ref, outs = _segments(refs, has_seg)
    if p.fused_bwd:
        _, dk_ref, dq_ref = outs  # the first is the zeros input that dq_ref aliases
    else:
        (dk_ref,) = outs
    bq, bk = p.block_q_bwd, p.block_k_bwd
    num_q = q_ref.shape[0] // bq
    j = pl.program_id(0)  # first-first: the first key tiles are read by the most queries
    k = k_ref[...]
    cols = j * bk + jnp.arange(bk)[None, :]
    seg_k = sk_ref[...][None, :] if has_seg else None
    if p.causal:  # query tiles [lo, full) straddle the diagonal, [full, num_q) see all of j
        lo = lax.div(j * bk, bq)
        full = jnp.minimum(lax.div((j + 1) * bk - 1 + bq - 1, bq), num_q)
        ranges = [(lo, full, True), (full, num_q, False)]
    else:
        ranges = [(0, num_q, False)]
    dk = jnp.zeros(k.shape, jnp.float32)
    for r in range(p.ratio):  # the query heads h = g·R + r that read this key head

        def body(i, dk, causal, r=r):
            start = pl.multiple_of(i * bq, bq)
            q = q_ref[pl.ds(start, bq), r, :]
            do = do_ref[pl.ds(start, bq), r, :]
            lse = LOG2E * lse_ref[r, pl.ds(start, bq)][:, None]
            delta = delta_ref[r, pl.ds(start, bq)][:, None]
            rows = start + jnp.arange(bq)[:, None]
            seg_q = sq_ref[pl.ds(start, bq)][:, None] if has_seg else None
            mask = block_mask(rows, cols, seg_q, seg_k, causal=causal, kv_len=p.kv_len)
            pr, ds = _tile_grads(q, k, do, lse, delta, mask, p.scale)
            ds = ds.astype(q.dtype)
            if p.fused_bwd:
                head = jnp.int32(r)  # not a Python int: the interpreter's atomic rule needs a shape
                plgpu.atomic_add(dq_ref, (pl.ds(start, bq), head, slice(None)), dot_nn(ds, k))
            return dk + dot_tn(ds, q) + dot_tn(pr.astype(do.dtype), do)

        for start, stop, causal in ranges:
            dk = lax.fori_loop(start, stop, functools.partial(body, causal=causal), dk)
    dk_ref[...] = dk.astype(dk_ref.dtype)


def backward(q: Array, k: Array, seg_q: Array | None, seg_k: Array | None, do: Array,
             lse: Array, delta: Array, p: KernelParams) -> tuple[Array, Array]:
    """(dq [B,Tp,H,Kp], dk [B,Sp,G,Kp]) from the padded inputs, do [B,Tp,H,Kp] and fp32
    lse, delta [B,H,Tp] (delta = rowsum(do ⊙ o) minus the cotangent of lse).

    Fused (`p.fused_bwd`): one kernel, grid (Sp/bk, B, G), adds dq in fp32 atomically (the
    order of the additions, hence dq's last bits, varies between runs) and dq is cast to
    q.dtype afterwards. Split: a dq kernel, grid (Tp/bq, B, H), then the dk kernel."""
    B, Tp, H, Kp = q.shape
    Sp, G = k.shape[1], k.shape[2]
    R, bq, bk = p.ratio, p.block_q_bwd, p.block_k_bwd
    num_q = Tp // bq
    has_seg = seg_q is not None
    group = lambda j, b, g: (b, 0, g, 0)  # noqa: E731  (the R query heads of key head g)
    key_tile = lambda j, b, g: (b, j, g, 0)  # noqa: E731
    dk_specs = [pl.BlockSpec((None, Tp, R, Kp), group),
                pl.BlockSpec((None, bk, None, Kp), key_tile),
                pl.BlockSpec((None, Tp, R, Kp), group),
                pl.BlockSpec((None, R, Tp), lambda j, b, g: (b, g, 0)),
                pl.BlockSpec((None, R, Tp), lambda j, b, g: (b, g, 0))]
    args = [q, k, do, lse, delta]
    if has_seg:
        dk_specs += [pl.BlockSpec((None, Tp), lambda j, b, g: (b, 0)),
                     pl.BlockSpec((None, bk), lambda j, b, g: (b, j))]
        args += [seg_q, seg_k]
    bwd_params = _compiler_params(Kp, bq, bk, p.num_warps_bwd, p.num_stages_bwd)
    dk_kernel = functools.partial(_dk_kernel, p=p, has_seg=has_seg)
    if p.fused_bwd:
        dq_spec = pl.BlockSpec((None, Tp, R, Kp), group)
        dk, dq = pl.pallas_call(
            dk_kernel, grid=(Sp // bk, B, G), in_specs=[*dk_specs, dq_spec],
            out_specs=[pl.BlockSpec((None, bk, None, Kp), key_tile), dq_spec],
            out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                       jax.ShapeDtypeStruct(q.shape, jnp.float32)],
            input_output_aliases={len(args): 1},  # dq starts as the zeros passed in
            compiler_params=bwd_params, interpret=p.interpret,
            name="cem_tied_attention_bwd_gpu",
        )(*args, jnp.zeros(q.shape, jnp.float32))
        return dq.astype(q.dtype), dk
    row = lambda n, b, h: (b, _last_first(n, num_q), h, 0)  # noqa: E731
    vec = lambda n, b, h: (b, h, _last_first(n, num_q))  # noqa: E731
    dq_specs = [pl.BlockSpec((None, bq, None, Kp), row),
                pl.BlockSpec((None, Sp, None, Kp), lambda n, b, h: (b, 0, h // R, 0)),
                pl.BlockSpec((None, bq, None, Kp), row),
                pl.BlockSpec((None, None, bq), vec), pl.BlockSpec((None, None, bq), vec)]
    if has_seg:
        dq_specs += [pl.BlockSpec((None, bq), lambda n, b, h: (b, _last_first(n, num_q))),
                     pl.BlockSpec((None, Sp), lambda n, b, h: (b, 0))]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, p=p, has_seg=has_seg),
        grid=(num_q, B, H), in_specs=dq_specs,
        out_specs=pl.BlockSpec((None, bq, None, Kp), row),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=bwd_params, interpret=p.interpret,
        name="cem_tied_attention_dq_gpu",
    )(*args)
    dk = pl.pallas_call(
        dk_kernel, grid=(Sp // bk, B, G), in_specs=dk_specs,
        out_specs=pl.BlockSpec((None, bk, None, Kp), key_tile),
        out_shape=jax.ShapeDtypeStruct(k.shape, k.dtype),
        compiler_params=bwd_params, interpret=p.interpret,
        name="cem_tied_attention_dk_gpu",
    )(*args)
    return dq, dk
