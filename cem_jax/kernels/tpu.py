"""TPU kernels (Pallas/Mosaic TPU) of causal tied-key/value flash attention, forward and backward.

FlashAttention-2 (Dao, arXiv 2307.08691) specialised to CEM's values-are-keys attention
(DESIGN.md §1). `forward` and `backward` take the op's sequence-major arrays (q [B,Tp,H,Kp],
k [B,Sp,G,Kp]) and transpose them to the heads-major layout the kernels tile (a tile's last two
axes are sequence × K), every array already padded by `cem_jax.kernels.tied_attention` (tiles
divide the lengths; K padded to the 128-lane width):

    q, do, o [B,H,Tp,Kp]   k [B,G,Sp,Kp]   lse, delta fp32 [B,H,Tp,1]
    segment ids int32: queries [B,Tp,1] (sublane-major), keys [B,1,Sp] (lane-major)

The TPU pipeline streams blocks through VMEM: the innermost grid axis is the reduction
("arbitrary"), its accumulators live in VMEM scratch and are written out on its last step.

- forward, grid (B, H, Tp/bq, Sp/bk): online softmax over key tiles; m, l, acc in scratch.
- dq, grid (B, H, Tp/bq, Sp/bk): dq += β ds k over key tiles.
- dk, grid (B, G, Sp/bk, R·Tp/bq): dk += β dsᵀ q + pᵀ do over the R query heads of the group
  and their query tiles (the value gradient folded into dk).

The backward stays two kernels, 7 tile matmuls per (query tile, key tile) pair (dq and dk both
recompute q kᵀ and do kᵀ; the GPU kernel fuses them into 5): a Mosaic TPU program owns its
output blocks and has no atomic add, so a fused kernel would have to keep one side's gradient
for the whole sequence in VMEM (dk: S·Kp fp32 per key head, 8·S·Kp bytes with its double-
buffered output: 28 MiB at S = 4096 for a DPLR concatenated head, K + D = 64 + 768 padded to
Kp = 896 lanes, over the 16-32 MiB scoped VMEM) or write one partial dq per key tile to HBM
and sum them (splash attention's `use_fused_bwd_kernel`: S/bk times the size of dq). Neither
can be measured without a TPU.

Causal: tiles strictly above the diagonal skip their compute (`pl.when`) and their index maps
repeat the last useful block, so the pipeline issues no copy for them; only tiles that straddle
the diagonal build the causal mask.

Verified in this repository in interpret mode on CPU (`interpret=True` and
`pltpu.InterpretParams()`, the TPU interpreter), and compiled by Mosaic for v4, v5e, v5p and
v6e with libtpu on CPU (README.md beside this file); never run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cem_jax.kernels.common import (
    MASK_VALUE,
    KernelParams,
    block_mask,
    dot_nn,
    dot_nt,
)

Array = jax.Array

MIB = 2**20
# The scoped VMEM Mosaic gives a kernel by default, by device kind (what its compile error,
# CompileTimeScopedVmemOom, names as the limit; read with libtpu 0.0.42): 32 MiB on v6e,
# 16 MiB on v4, v5e and v5p.
SCOPED_VMEM = {"TPU v6 lite": 32 * MIB}
SCOPED_VMEM_DEFAULT = 16 * MIB
_F32 = 4


def vmem_lower_bound(p: KernelParams, Kp: int, itemsize: int) -> dict[str, int]:
    """Bytes of VMEM each kernel ({"fwd", "dq", "dk"}) cannot do without at these tiles: one
    buffer of each pipelined block, its fp32 accumulator scratch and one fp32 score tile.
    A lower bound only: Mosaic double-buffers the blocks and keeps several score-sized
    temporaries, so what it needs is higher, by 1.1-3x where it ran out at 16 MiB (fp32,
    K = 256: the dk kernel at 1024 x 512 tiles needed 16.1 MiB against this 5.5; the forward
    at 1024 x 1024 needed 20.8 against 8.0); tiles under it can still fail to compile.
    `benchmarks/results/tpu_compile.txt` lists the compiler's figure beside it per case."""
    bq, bk = p.block_q, p.block_k
    fwd = (2 * bq + bk) * Kp * itemsize + bq * Kp * _F32 + bq * bk * _F32
    bq, bk = p.block_q_bwd, p.block_k_bwd
    dq = (3 * bq + bk) * Kp * itemsize + bq * Kp * _F32 + bq * bk * _F32
    dk = (2 * bq + 2 * bk) * Kp * itemsize + bk * Kp * _F32 + bq * bk * _F32
    return {"fwd": fwd, "dq": dq, "dk": dk}


def check_vmem(p: KernelParams, Kp: int, itemsize: int, device_kind: str) -> None:
    """Raise ValueError, before anything compiles, when a kernel's `vmem_lower_bound` is over
    the scoped VMEM of `device_kind` (`SCOPED_VMEM`), naming the kernel, both sizes and the
    fix."""
    limit = SCOPED_VMEM.get(device_kind, SCOPED_VMEM_DEFAULT)
    tiles = {"fwd": ("block_q, block_k", p.block_q, p.block_k),
             "dq": ("block_q_bwd, block_k_bwd", p.block_q_bwd, p.block_k_bwd)}
    tiles["dk"] = tiles["dq"]
    for kernel, need in vmem_lower_bound(p, Kp, itemsize).items():
        if need > limit:
            names, bq, bk = tiles[kernel]
            raise ValueError(
                f"tied attention's {kernel} kernel needs at least {need / MIB:.1f} MiB of VMEM "
                f"with its tiles (BlockSizes.{names} = {bq}, {bk}; K padded to {Kp}, "
                f"{itemsize}-byte inputs), over the {limit // MIB} MiB of scoped VMEM that "
                f"Mosaic gives a kernel on a {device_kind or 'TPU'}: use smaller blocks (the "
                f"default BlockSizes fit every case of benchmarks/tpu_compile.py)")


def _visible(i, j, bq, bk):
    """Query tile i and key tile j share at least one causal (s ≤ t) pair."""
    return j * bk <= (i + 1) * bq - 1


def _compiler_params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _segments(refs, has_seg):
    return (refs[0], refs[1], refs[2:]) if has_seg else (None, None, refs)


def _run_tile(i, j, bq, bk, p: KernelParams, step):
    """Run step(causal) for tile (i, j): without the causal mask where the tile lies wholly
    below the diagonal, with it where the tile straddles it, not at all above it."""
    if not p.causal:
        step(False)
        return
    below = (j + 1) * bk - 1 <= i * bq
    pl.when(below)(functools.partial(step, False))
    pl.when(jnp.logical_and(_visible(i, j, bq, bk), jnp.logical_not(below)))(
        functools.partial(step, True))


def _tile_mask(i, j, bq, bk, sq_ref, sk_ref, p: KernelParams, causal: bool):
    rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    seg_q = sq_ref[...] if sq_ref is not None else None
    seg_k = sk_ref[...] if sk_ref is not None else None
    return block_mask(rows, cols, seg_q, seg_k, causal=causal, kv_len=p.kv_len)


def _fwd_kernel(q_ref, k_ref, *refs, p: KernelParams, has_seg: bool):
    sq_ref, sk_ref, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _segments(refs, has_seg)
    bq, bk = p.block_q, p.block_k
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def _step(causal):
        k = k_ref[...]
        s = dot_nt(q_ref[...], k) * p.scale
        mask = _tile_mask(i, j, bq, bk, sq_ref, sk_ref, p, causal)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        e = jnp.exp(s - m_new)
        if mask is not None:
            e = jnp.where(mask, e, 0.0)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(e, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + dot_nn(e.astype(k.dtype), k)
        m_sc[...] = m_new

    _run_tile(i, j, bq, bk, p, _step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / l).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l)


def _segment_arrays(seg: Array | None, Sp: int):
    if seg is None:
        return []
    return [seg[:, :, None], seg[:, None, :Sp]]


def _heads(x: Array) -> Array:
    """[B,T,N,K] <-> [B,N,T,K] (its own inverse)."""
    return x.transpose(0, 2, 1, 3)


def forward(q: Array, k: Array, seg_q: Array | None, seg_k: Array | None, p: KernelParams
            ) -> tuple[Array, Array]:
    """o [B,Tp,H,Kp] (q.dtype), lse fp32 [B,H,Tp] for padded inputs q [B,Tp,H,Kp],
    k [B,Sp,G,Kp]."""
    o, lse = _forward(_heads(q), _heads(k), seg_q, seg_k, p)
    return _heads(o), lse


def _forward(q: Array, k: Array, seg_q: Array | None, seg_k: Array | None, p: KernelParams
             ) -> tuple[Array, Array]:
    """o [B,H,Tp,Kp], lse [B,H,Tp] in the heads-major layout."""
    del seg_k  # self-attention: the same ids (validated upstream)
    B, H, Tp, Kp = q.shape
    Sp, R, bq, bk = k.shape[2], p.ratio, p.block_q, p.block_k
    has_seg = seg_q is not None

    def kv_block(i, j):  # skipped causal tiles re-use the last useful block: no new copy
        return jnp.minimum(j, ((i + 1) * bq - 1) // bk) if p.causal else j

    row = lambda b, h, i, j: (b, h, i, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((None, None, bq, Kp), row),
                pl.BlockSpec((None, None, bk, Kp),
                             lambda b, h, i, j: (b, h // R, kv_block(i, j), 0))]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq, 1), lambda b, h, i, j: (b, i, 0)),
                     pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, kv_block(i, j)))]
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, p=p, has_seg=has_seg),
        grid=(B, H, Tp // bq, Sp // bk),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, bq, Kp), row),
                   pl.BlockSpec((None, None, bq, 1), row)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, Kp), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=p.interpret,
        name="cem_tied_attention_fwd_tpu",
    )(q, k, *_segment_arrays(seg_q, Sp))
    return o, lse[..., 0]


def _dq_kernel(q_ref, k_ref, do_ref, lse_ref, delta_ref, *refs, p: KernelParams, has_seg: bool):
    sq_ref, sk_ref, (dq_ref, dq_sc) = _segments(refs, has_seg)
    bq, bk = p.block_q_bwd, p.block_k_bwd
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def _step(causal):
        k = k_ref[...]
        pr = jnp.exp(dot_nt(q_ref[...], k) * p.scale - lse_ref[...])
        mask = _tile_mask(i, j, bq, bk, sq_ref, sk_ref, p, causal)
        if mask is not None:
            pr = jnp.where(mask, pr, 0.0)
        ds = pr * (dot_nt(do_ref[...], k) - delta_ref[...])
        dq_sc[...] += dot_nn(ds.astype(k.dtype), k)

    _run_tile(i, j, bq, bk, p, _step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (p.scale * dq_sc[...]).astype(dq_ref.dtype)


def _dk_kernel(q_ref, k_ref, do_ref, lse_ref, delta_ref, *refs, p: KernelParams, has_seg: bool,
               num_q: int):
    sq_ref, sk_ref, (dk_ref, dk_sc) = _segments(refs, has_seg)
    bq, bk = p.block_q_bwd, p.block_k_bwd
    j, n = pl.program_id(2), pl.program_id(3)
    i = n % num_q

    @pl.when(n == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)

    def _step(causal):
        q, do, k = q_ref[...], do_ref[...], k_ref[...]
        pr = jnp.exp(dot_nt(q, k) * p.scale - lse_ref[...])
        mask = _tile_mask(i, j, bq, bk, sq_ref, sk_ref, p, causal)
        if mask is not None:
            pr = jnp.where(mask, pr, 0.0)
        ds = pr * (dot_nt(do, k) - delta_ref[...])
        # Explicit transposes (XLU) then plain matmuls: the form Mosaic lowers most directly.
        dk_sc[...] += (p.scale * dot_nn(ds.astype(q.dtype).T, q)
                       + dot_nn(pr.astype(do.dtype).T, do))

    _run_tile(i, j, bq, bk, p, _step)

    @pl.when(n == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)


def backward(q: Array, k: Array, seg_q: Array | None, seg_k: Array | None, do: Array,
             lse: Array, delta: Array, p: KernelParams) -> tuple[Array, Array]:
    """(dq [B,Tp,H,Kp], dk [B,Sp,G,Kp]) from the padded inputs, do [B,Tp,H,Kp] and fp32
    lse, delta [B,H,Tp] (delta = rowsum(do ⊙ o) minus the cotangent of lse)."""
    dq, dk = _backward(_heads(q), _heads(k), seg_q, do=_heads(do), lse=lse, delta=delta, p=p)
    return _heads(dq), _heads(dk)


def _backward(q: Array, k: Array, seg_q: Array | None, *, do: Array, lse: Array, delta: Array,
              p: KernelParams) -> tuple[Array, Array]:
    """dq [B,H,Tp,Kp], dk [B,G,Sp,Kp] in the heads-major layout."""
    B, H, Tp, Kp = q.shape
    G, Sp = k.shape[1], k.shape[2]
    R, bq, bk = p.ratio, p.block_q_bwd, p.block_k_bwd
    num_q, num_k = Tp // bq, Sp // bk
    has_seg = seg_q is not None
    lse, delta = lse[..., None], delta[..., None]
    segs = _segment_arrays(seg_q, Sp)
    args = [q, k, do, lse, delta, *segs]

    # dq: grid (B, H, query tile, key tile), reducing over key tiles.
    def kv_block(i, j):
        return jnp.minimum(j, ((i + 1) * bq - 1) // bk) if p.causal else j

    row = lambda b, h, i, j: (b, h, i, 0)  # noqa: E731
    dq_specs = [pl.BlockSpec((None, None, bq, Kp), row),
                pl.BlockSpec((None, None, bk, Kp),
                             lambda b, h, i, j: (b, h // R, kv_block(i, j), 0)),
                pl.BlockSpec((None, None, bq, Kp), row),
                pl.BlockSpec((None, None, bq, 1), row), pl.BlockSpec((None, None, bq, 1), row)]
    if has_seg:
        dq_specs += [pl.BlockSpec((None, bq, 1), lambda b, h, i, j: (b, i, 0)),
                     pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, kv_block(i, j)))]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, p=p, has_seg=has_seg),
        grid=(B, H, num_q, num_k), in_specs=dq_specs,
        out_specs=pl.BlockSpec((None, None, bq, Kp), row),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, Kp), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=p.interpret, name="cem_tied_attention_dq_tpu",
    )(*args)

    # dk: grid (B, G, key tile, R·query tiles), reducing over the group's heads and tiles.
    def q_block(j, n):  # skipped causal tiles re-use the first useful block: no new copy
        i = n % num_q
        return jnp.maximum(i, (j * bk) // bq) if p.causal else i

    qrow = lambda b, g, j, n: (b, g * R + n // num_q, q_block(j, n), 0)  # noqa: E731
    krow = lambda b, g, j, n: (b, g, j, 0)  # noqa: E731
    dk_specs = [pl.BlockSpec((None, None, bq, Kp), qrow),
                pl.BlockSpec((None, None, bk, Kp), krow),
                pl.BlockSpec((None, None, bq, Kp), qrow),
                pl.BlockSpec((None, None, bq, 1), qrow), pl.BlockSpec((None, None, bq, 1), qrow)]
    if has_seg:
        dk_specs += [pl.BlockSpec((None, bq, 1), lambda b, g, j, n: (b, q_block(j, n), 0)),
                     pl.BlockSpec((None, 1, bk), lambda b, g, j, n: (b, 0, j))]
    dk = pl.pallas_call(
        functools.partial(_dk_kernel, p=p, has_seg=has_seg, num_q=num_q),
        grid=(B, G, num_k, R * num_q), in_specs=dk_specs,
        out_specs=pl.BlockSpec((None, None, bk, Kp), krow),
        out_shape=jax.ShapeDtypeStruct(k.shape, k.dtype),
        scratch_shapes=[pltpu.VMEM((bk, Kp), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=p.interpret, name="cem_tied_attention_dk_tpu",
    )(*args)
    return dq, dk
