"""Shared pieces of the tied-attention kernels: block sizes, validation, padding, masks.

Letters as in DESIGN.md: B batch, T query length, S key length, H query heads, G key heads
(GQA, H = G·R: query head h reads key head h // R), K head width.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from cem_jax.sharding import target_platform

Array = jax.Array

BACKENDS = ("tpu", "gpu", "xla")

# A finite "minus infinity" for masked logits: exp(MASK - m) underflows to 0 without the
# inf - inf = nan of a true -inf when a whole block of a row is masked.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the tied flash-attention kernels (rows of q and of k per program).

    block_q, block_k: query / key tile of the forward pass.
    block_q_bwd, block_k_bwd: query / key tile of the backward kernels.
    num_warps, num_stages: Triton launch settings of the GPU forward kernel (None: 4 warps
      for a tile of at most 64×64, else 8; 2 software-pipelining stages); unused on TPU.
    num_warps_bwd, num_stages_bwd: the same for the GPU backward kernels.
    fused_bwd: GPU backward as one kernel that adds dq atomically (5 tile matmuls per query
      tile × key tile pair) instead of a dq and a dk kernel that both recompute the scores
      (7); unused on TPU, whose backward is always the two kernels (README.md says why).
    Blocks are clipped to the (padded) sequence length, so short sequences use one tile.
    Compiled TPU runs want multiples of 128 for the key tiles (lane width) and of 8 for the
    query tiles; compiled GPU (Triton) runs need powers of two ≥ 16 (checked at the call).
    Raises `ValueError` for a block that is not a positive multiple of 8, a non-positive
    num_warps / num_stages, or a non-bool fused_bwd.
    """

    block_q: int = 128
    block_k: int = 128
    block_q_bwd: int = 128
    block_k_bwd: int = 128
    num_warps: int | None = None
    num_stages: int = 2
    num_warps_bwd: int | None = None
    num_stages_bwd: int = 2
    fused_bwd: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 8 or v % 8:
                raise ValueError(f"BlockSizes.{name} = {v!r}: must be an int ≥ 8, "
                                 "a multiple of 8")
        for name in ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"BlockSizes.{name} = {v!r}: must be a positive int")
        if not isinstance(self.fused_bwd, bool):
            raise ValueError(f"BlockSizes.fused_bwd = {self.fused_bwd!r}: must be a bool")

    @property
    def blocks(self) -> tuple[int, int, int, int]:
        """(block_q, block_k, block_q_bwd, block_k_bwd)."""
        return self.block_q, self.block_k, self.block_q_bwd, self.block_k_bwd

    @classmethod
    def get_default(cls, backend: str) -> BlockSizes:
        """Defaults per backend: TPU 128/128 (MXU and lane width); GPU 64 × 64 tiles with 4
        warps, forward and backward, 3 pipelining stages forward and 2 backward (the fastest
        of the settings timed on an H200 at K = 128 in bf16: 3 stages took the forward from
        0.668 to 0.628 ms and the backward from 1.85 to 2.30 ms,
        benchmarks/results/attention_h200.txt); XLA: unused."""
        if backend == "gpu":
            return cls(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64, num_stages=3,
                       num_stages_bwd=2)
        return cls()


def validate(q, k, causal, segment_ids, scale, block_sizes, backend) -> None:
    """Check every argument of `tied_attention` before dispatch; raise `ValueError` (shapes,
    dtypes, values) or `TypeError` (non-arrays) naming the argument and what is allowed."""
    for name, x in (("q", q), ("k", k)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            layout = "[B,T,H,K]" if name == "q" else "[B,S,G,K]"
            raise ValueError(f"{name} must have rank 4 {layout}, got shape {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype (float32, bfloat16, float16), "
                             f"got {x.dtype}")
        if 0 in x.shape:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    (B, T, H, K), (Bk, S, G, Kk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"batch mismatch: q has B={B}, k has B={Bk}")
    if Kk != K:
        raise ValueError(f"head width mismatch: q has K={K}, k has K={Kk} (values are the keys, "
                         "so both must have the same width)")
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of key heads G={G} (GQA)")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape") or tuple(segment_ids.shape) != (B, T):
            shape = getattr(segment_ids, "shape", type(segment_ids).__name__)
            raise ValueError(f"segment_ids must have shape [B,T] = {(B, T)}, got {shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be an integer dtype, got {segment_ids.dtype}")
        if S != T:
            raise ValueError(f"segment_ids need self-attention (S == T), got T={T}, S={S}")
    if scale is not None and not (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS} or None")


def resolve_backend(backend: str | None, interpret) -> tuple[str, object]:
    """(backend, interpret) after defaults: backend None picks by the `target_platform()`
    ("tpu" on TPU, "gpu" on a GPU; on CPU "xla", or the "gpu" kernel interpreted when
    `interpret` is set); interpret None means True exactly when a Pallas backend is asked for
    on CPU."""
    platform = target_platform()
    on_cpu = platform not in ("tpu", "gpu", "cuda", "rocm")
    if backend is None:
        if platform == "tpu":
            backend = "tpu"
        elif not on_cpu:
            backend = "gpu"
        else:
            backend = "gpu" if interpret else "xla"
    if interpret is None:
        interpret = on_cpu and backend != "xla"
    return backend, interpret


def clip_block(block: int, n: int, least: int) -> int:
    """The tile actually used along a length-n axis: at most the next power of two ≥ n (and
    ≥ `least`), so a short sequence runs as one tile."""
    return min(block, max(least, 1 << (n - 1).bit_length()))


def check_compiled_gpu_blocks(bs: BlockSizes) -> None:
    """Compiled Triton tiles must be powers of two ≥ 16 (the tensor-core dot's smallest
    shape); raise `ValueError` naming the field otherwise."""
    for name, v in zip(("block_q", "block_k", "block_q_bwd", "block_k_bwd"), bs.blocks,
                       strict=True):
        if v < 16 or v & (v - 1):
            raise ValueError(f"BlockSizes.{name} = {v}: the compiled GPU kernel needs powers "
                             "of two ≥ 16 (e.g. 16, 32, 64, 128)")


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_axis(x: Array, axis: int, size: int, mode: str = "constant") -> Array:
    """Pad axis `axis` of x at the end to `size` (zeros, or the edge value with mode="edge")."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


def block_mask(rows: Array, cols: Array, seg_q: Array | None, seg_k: Array | None, *,
               causal: bool, kv_len: int | None) -> Array | None:
    """Boolean [bq,bk] "may attend" mask from absolute row ids [bq,1], column ids [1,bk],
    and segment ids [bq,1] / [1,bk] (None when absent); None when nothing is masked.
    kv_len: the true key length when the keys were padded past it (else None)."""
    mask = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if causal:
        mask = both(mask, cols <= rows)
    if kv_len is not None:
        mask = both(mask, cols < kv_len)
    if seg_q is not None:
        mask = both(mask, seg_q == seg_k)
    return mask


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """Static settings shared by the forward and backward kernels (hashable: they are
    `nondiff_argnums` of the custom VJP). Arrays reaching a kernel are already padded:
    q [B,H,Tp,Kp], k [B,G,Sp,Kp] with Tp, Sp multiples of every query / key tile."""

    causal: bool
    scale: float
    kv_len: int | None  # true S when keys were padded past it, else None
    ratio: int  # R = H // G
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int | None = None
    num_stages: int = 2
    num_warps_bwd: int | None = None
    num_stages_bwd: int = 2
    fused_bwd: bool = True
    interpret: object = False


def dot_nt(a: Array, b: Array) -> Array:
    """a [m,k] · b [n,k]ᵀ → fp32 [m,n] (contract the last axes, no explicit transpose)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_precision(a))


def dot_tn(a: Array, b: Array) -> Array:
    """a [k,m]ᵀ · b [k,n] → fp32 [m,n]."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_precision(a))


def dot_nn(a: Array, b: Array) -> Array:
    """a [m,k] · b [k,n] → fp32 [m,n]."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_precision(a))


def _precision(a: Array):
    # fp32 inputs: full fp32 products (no TF32 / bf16 passes), so fp32 results match the
    # reference to ~1e-6; low-precision inputs use the native MXU / tensor-core path.
    return jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
