"""Tied-attention Pallas kernels against the `jnp` reference, the energy definition and the model.

The same test class runs once per kernel: interpreted on CPU (how CI tests them, here) and,
when the hardware is present, compiled. Tolerances (relative to the output's scale):
fp32 1e-5 for outputs, energies and gradients; bf16 inputs 2e-2 against the fp32 reference of
the same bf16 inputs (bf16 rounds p and ds before the second matmuls, as FlashAttention does).
Broader hypothesis sweeps are marked slow (`make test-all`).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close_to_scale
from hypothesis import given, settings
from hypothesis import strategies as st

from cem_jax.config import ModelConfig
from cem_jax.energies import AttentionSpec, attention_energy, default_positions, rope
from cem_jax.kernels import BlockSizes, tied_attention, tied_attention_reference
from cem_jax.model import CEMTransformer
from cem_jax.updates import tied_attention_mixer

PLATFORM = jax.default_backend()
# (backend, interpret): both kernels interpreted everywhere, compiled where the chip exists.
RUNS = [("gpu", True), ("tpu", True)]
GPU_RUNS = [("gpu", True)]
if PLATFORM == "gpu":
    RUNS.append(("gpu", False))
    GPU_RUNS.append(("gpu", False))
if PLATFORM == "tpu":
    RUNS.append(("tpu", False))
SMALL_BLOCKS = BlockSizes(block_q=16, block_k=8, block_q_bwd=8, block_k_bwd=16)
# Compiled Triton tiles are powers of two ≥ 16; still several tiles on the short test lengths.
SMALL_BLOCKS_COMPILED_GPU = BlockSizes(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)


def inputs(B, T, H, G, K, *, S=None, dtype=jnp.float32, seed=0):
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (B, T, H, K), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S or T, G, K), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (B, T, H, K), jnp.float32)  # weights of the scalar loss
    return q, k, w


def segments(B, T, seed=0):
    """Random packed documents: ids non-decreasing along T, several per row."""
    starts = jax.random.bernoulli(jax.random.PRNGKey(seed + 7), 0.2, (B, T))
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def outputs_and_grads(fn, q, k, w):
    """o, energy and (dq, dk) of the scalar loss Σ w⊙o + 0.1·Σ energy (both outputs get a
    cotangent, so the energy's backward is checked too)."""

    def loss(q, k):
        o, e = fn(q, k)
        return jnp.sum(w * o.astype(jnp.float32)) + 0.1 * jnp.sum(e), (o, e)

    (_, (o, e)), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(q, k)
    return o, e, grads


def reference(causal=True, segment_ids=None, scale=None):
    def fn(q, k):
        K = q.shape[-1]
        beta = 1.0 / K**0.5 if scale is None else scale
        o, lse = tied_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                          causal=causal, segment_ids=segment_ids, scale=beta)
        return o, -lse / beta
    return fn


def assert_matches_reference(backend, interpret, q, k, w, *, tol, causal=True, segment_ids=None,
                             block_sizes="small", scale=None):
    """block_sizes: a `BlockSizes`, None (the backend's defaults) or "small" (several tiles)."""
    if block_sizes == "small":
        compiled_gpu = backend == "gpu" and not interpret
        block_sizes = SMALL_BLOCKS_COMPILED_GPU if compiled_gpu else SMALL_BLOCKS

    def kernel(q, k):
        return tied_attention(q, k, causal=causal, segment_ids=segment_ids, scale=scale,
                              return_energy=True, block_sizes=block_sizes, backend=backend,
                              interpret=interpret)

    o, e, (dq, dk) = outputs_and_grads(kernel, q, k, w)
    ro, re, (rdq, rdk) = outputs_and_grads(reference(causal, segment_ids, scale), q, k, w)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert e.shape == (q.shape[0], q.shape[2], q.shape[1]) and e.dtype == jnp.float32
    assert dq.dtype == q.dtype and dk.dtype == k.dtype
    for name, got, want in (("o", o, ro), ("energy", e, re), ("dq", dq, rdq), ("dk", dk, rdk)):
        try:
            assert_close_to_scale(got, want, tol)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


@pytest.mark.parametrize("backend,interpret", RUNS,
                         ids=[f"{b}-{'interpret' if i else 'compiled'}" for b, i in RUNS])
class TestTiedAttentionKernel:
    """One class, run per kernel and mode (the Pallas ops' pattern, DESIGN.md §5)."""

    def test_gqa2_segments_ragged_length(self, backend, interpret):
        # T = 37: not a multiple of any tile; 3 query and 5 key tiles; documents cross tiles.
        q, k, w = inputs(2, 37, 4, 2, 12)
        assert_matches_reference(backend, interpret, q, k, w, tol=1e-5, scale=0.3,
                                 segment_ids=segments(2, 37))

    def test_single_token_gqa4(self, backend, interpret):
        q, k, w = inputs(1, 1, 4, 1, 8)
        assert_matches_reference(backend, interpret, q, k, w, tol=1e-5)

    @pytest.mark.slow
    def test_mha_several_tiles(self, backend, interpret):
        q, k, w = inputs(1, 24, 2, 2, 16, seed=3)
        assert_matches_reference(backend, interpret, q, k, w, tol=1e-5)

    def test_bfloat16(self, backend, interpret):
        q, k, w = inputs(1, 20, 4, 2, 16, dtype=jnp.bfloat16, seed=1)
        assert_matches_reference(backend, interpret, q, k, w, tol=2e-2,
                                 segment_ids=segments(1, 20, seed=1))

    @pytest.mark.slow
    @settings(max_examples=12, deadline=None)
    @given(B=st.integers(1, 2), T=st.integers(1, 40), G=st.sampled_from([1, 2]),
           R=st.sampled_from([1, 2, 4]), K=st.sampled_from([4, 8, 12, 32]),
           with_segments=st.booleans(), seed=st.integers(0, 100))
    def test_hypothesis_fp32(self, backend, interpret, B, T, G, R, K, with_segments, seed):
        q, k, w = inputs(B, T, G * R, G, K, seed=seed)
        seg = segments(B, T, seed) if with_segments else None
        assert_matches_reference(backend, interpret, q, k, w, tol=1e-5, segment_ids=seg)

    @pytest.mark.slow
    @settings(max_examples=6, deadline=None)
    @given(T=st.integers(1, 40), R=st.sampled_from([1, 2, 4]), with_segments=st.booleans(),
           seed=st.integers(0, 100))
    def test_hypothesis_bfloat16(self, backend, interpret, T, R, with_segments, seed):
        q, k, w = inputs(2, T, 2 * R, 2, 16, dtype=jnp.bfloat16, seed=seed)
        seg = segments(2, T, seed) if with_segments else None
        assert_matches_reference(backend, interpret, q, k, w, tol=2e-2, segment_ids=seg)

    @pytest.mark.slow
    @pytest.mark.parametrize("T,S", [(13, 13), (9, 21), (21, 9)])
    def test_non_causal_cross_lengths(self, backend, interpret, T, S):
        q, k, w = inputs(1, T, 4, 2, 8, S=S, seed=5)
        assert_matches_reference(backend, interpret, q, k, w, tol=1e-5, causal=False)

    @pytest.mark.slow
    def test_default_blocks_long_sequence(self, backend, interpret):
        q, k, w = inputs(1, 300, 2, 1, 64, seed=2)
        assert_matches_reference(backend, interpret, q, k, w, tol=1e-5, block_sizes=None,
                                 segment_ids=segments(1, 300, seed=2))


def test_tpu_kernel_in_tpu_interpreter():
    """The TPU kernel in Pallas' TPU interpreter (simulated VMEM, scratch and DMA; out-of-bounds
    reads raise), forward and backward."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, w = inputs(1, 20, 2, 1, 8, seed=4)
    assert_matches_reference("tpu", pltpu.InterpretParams(), q, k, w, tol=1e-5,
                             segment_ids=segments(1, 20, seed=4),
                             block_sizes=BlockSizes(8, 8, 8, 8))


def test_energy_is_the_interaction_energy():
    """Σ_h energy of the kernel on the rotated queries and keys = `attention_energy` (§1)."""
    B, T, D, H, G, K = 2, 11, 12, 4, 2, 6
    kq, kk, ky, kc = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"query": 0.3 * jax.random.normal(kq, (D, H, K)),
              "key": 0.3 * jax.random.normal(kk, (D, G, K))}
    y, c = jax.random.normal(ky, (B, T, D)), jax.random.normal(kc, (B, T, D))
    seg = segments(B, T, seed=2)
    spec = AttentionSpec(H, G, K)
    pos = default_positions(B, T)


    @jax.jit
    def rotated(y, c):  # the rotated queries and keys, as the kernel wants them: [B,T,N,K]
        q = rope(jnp.einsum("btd,dhk->bhtk", y, params["query"]), pos)
        k = rope(jnp.einsum("btd,dgk->bgtk", c, params["key"]), pos)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)

    q, k = rotated(y, c)
    blocks = SMALL_BLOCKS_COMPILED_GPU if PLATFORM == "gpu" else SMALL_BLOCKS
    kernel = jax.jit(lambda q, k: tied_attention(q, k, segment_ids=seg, return_energy=True,
                                                 backend="gpu", block_sizes=blocks))
    _, energy = kernel(q, k)
    want = jax.jit(lambda y, c: attention_energy(params, y, c, spec=spec, segment_ids=seg))(y, c)
    assert_close_to_scale(energy.sum(axis=1), want, 1e-5)


def test_cpu_default_backend_is_the_reference():
    q, k, _ = inputs(1, 9, 2, 1, 8)
    o = jax.jit(tied_attention)(q, k)
    o_ref, _ = jax.jit(tied_attention_reference)(q, k)
    if PLATFORM == "cpu":
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    else:
        assert_close_to_scale(o, o_ref, 1e-5)


@pytest.mark.parametrize("q_shape,k_shape,kwargs,match", [
    ((1, 8, 3, 8), (1, 8, 2, 8), {}, "multiple of key heads"),
    ((1, 8, 4, 8), (1, 8, 2, 6), {}, "head width mismatch"),
    ((8, 4, 8), (1, 8, 2, 8), {}, "rank 4"),
    ((1, 8, 4, 8), (1, 8, 2, 8, 1), {}, "rank 4"),
    ((2, 8, 4, 8), (1, 8, 2, 8), {}, "batch mismatch"),
    ((1, 8, 4, 8), (1, 8, 2, 8), {"segment_ids": jnp.zeros((1, 7), jnp.int32)}, "segment_ids"),
    ((1, 8, 4, 8), (1, 8, 2, 8), {"segment_ids": jnp.zeros((1, 8))}, "integer"),
    ((1, 8, 4, 8), (1, 9, 2, 8), {"segment_ids": jnp.zeros((1, 8), jnp.int32)}, "S == T"),
    ((1, 8, 4, 8), (1, 8, 2, 8), {"scale": -1.0}, "scale"),
    ((1, 8, 4, 8), (1, 8, 2, 8), {"backend": "cuda"}, "unknown backend"),
    ((1, 8, 4, 8), (1, 8, 2, 8), {"block_sizes": (128, 128)}, "BlockSizes"),
    ((1, 0, 4, 8), (1, 0, 2, 8), {}, "empty"),
    ((1, 8, 4, 8), (1, 8, 2, 8),
     {"backend": "gpu", "interpret": False, "block_sizes": BlockSizes(block_k=24)},
     "block_k = 24: the compiled GPU kernel needs powers of two ≥ 16"),
])
def test_bad_arguments_raise_clear_errors(q_shape, k_shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tied_attention(jnp.zeros(q_shape), jnp.zeros(k_shape), **kwargs)


@pytest.mark.parametrize("backend,interpret", GPU_RUNS,
                         ids=[f"{b}-{'interpret' if i else 'compiled'}" for b, i in GPU_RUNS])
def test_gpu_split_backward(backend, interpret):
    """`fused_bwd=False`: the dq and dk kernels that recompute p (no atomics) stay correct."""
    q, k, w = inputs(1, 21, 4, 2, 8, seed=6)
    blocks = SMALL_BLOCKS_COMPILED_GPU if not interpret else SMALL_BLOCKS
    assert_matches_reference(backend, interpret, q, k, w, tol=1e-5,
                             segment_ids=segments(1, 21, seed=6),
                             block_sizes=dataclasses.replace(blocks, fused_bwd=False))


def _triton_calls(fn, *args) -> dict[str, tuple[int, int, set[int]]]:
    """Lower jit(fn) for CUDA (no GPU needed) and read each Triton custom call: kernel name →
    (num_warps, num_stages, the set of tt.dot counts of its loop bodies), the dots counted
    in the Triton IR that Pallas serializes into the call (MLIR bytecode)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context  # a Triton-aware context

    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir()
    calls = [op for op in _walk(module.operation) if op.name == "stablehlo.custom_call"]
    found = {}
    for call in calls:
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        if "ir" not in config:
            pytest.skip("this JAX compiles Triton while lowering; the Triton IR is not readable")
        with _new_ir_context():
            kernel = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
        dots = {sum(op.name == "tt.dot" for op in _walk(loop))
                for loop in _walk(kernel.operation) if loop.name == "scf.for"}
        name = re.fullmatch(r"cem_tied_attention_(\w+)_gpu", ir.StringAttr(config["name"]).value)
        assert name and name[1] not in found
        found[name[1]] = (ir.IntegerAttr(config["num_warps"]).value,
                          ir.IntegerAttr(config["num_stages"]).value, dots)
    return found


def _walk(op):
    """Every operation nested in op (depth first)."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from _walk(child.operation)


@pytest.mark.parametrize("block_sizes, expected", [
    # the GPU defaults: 3 stages forward, 2 backward; one fused backward kernel, 5 tile
    # matmuls per (query tile, key tile) pair: s = q kᵀ, dp = do kᵀ, ds k, dsᵀ q, pᵀ do
    (None, {"fwd": (4, 3, {2}), "bwd": (4, 2, {5})}),
    (BlockSizes(64, 64, 32, 32, num_warps=8, num_stages=4, num_warps_bwd=2, num_stages_bwd=1),
     {"fwd": (8, 4, {2}), "bwd": (2, 1, {5})}),
    # split: the dq (3) and dk (4) kernels both recompute s and dp: 7 per pair
    (BlockSizes(64, 64, 64, 64, fused_bwd=False),
     {"fwd": (4, 2, {2}), "dq": (4, 2, {3}), "dk": (4, 2, {4})}),
])
def test_gpu_kernels_are_launched_with_their_own_warps_and_stages(block_sizes, expected):
    """Lowered for CUDA (no GPU needed): the Triton kernels launched for forward + backward,
    each with its own (num_warps, num_stages), and the tile matmuls (tt.dot) in each loop
    body: 2 in the forward, 5 in the fused backward (7 across the split dq and dk kernels)."""
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def loss(q, k):
        o = tied_attention(q, k, backend="gpu", interpret=False, block_sizes=block_sizes)
        return jnp.sum(o.astype(jnp.float32))

    assert _triton_calls(jax.grad(loss, (0, 1)), q, q) == expected


def test_bad_dtypes_raise_clear_errors():
    with pytest.raises(ValueError, match="floating dtype"):
        tied_attention(jnp.zeros((1, 8, 2, 8), jnp.int32), jnp.zeros((1, 8, 2, 8), jnp.int32))
    with pytest.raises(ValueError, match="same dtype"):
        tied_attention(jnp.zeros((1, 8, 2, 8)), jnp.zeros((1, 8, 2, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="multiple of 8"):
        BlockSizes(block_q=12)
    with pytest.raises(ValueError, match="fused_bwd = 1: must be a bool"):
        BlockSizes(fused_bwd=1)


@pytest.mark.parametrize("diag,use_rope,G", [
    ("per_head", True, 2),
    pytest.param("shared", False, 4, marks=pytest.mark.slow),
    pytest.param(None, True, 1, marks=pytest.mark.slow),
])
def test_pallas_update_equals_autodiff_energy_gradient(diag, use_rope, G):
    """The CEM attention update through the kernel (DPLR concatenated head, RoPE un-rotation,
    GQA, packed documents) equals -∇_y of the energy definition."""
    B, T, D, H, K = 2, 9, 12, 4, 6
    kq, kk, kd, ky = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"query": 0.3 * jax.random.normal(kq, (D, H, K)),
              "key": 0.3 * jax.random.normal(kk, (D, G, K))}
    if diag is not None:
        params["diag"] = 0.3 * jax.random.normal(kd, (H, D) if diag == "per_head" else (D,))
    y, c = jax.random.normal(ky, (2, B, T, D))
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 3], [1] * T])
    pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0, 1], list(range(T))])
    spec = AttentionSpec(H, G, K, use_rope, block_size=4)
    mixer = tied_attention_mixer(params, spec, pos, seg, impl="pallas")
    got = jax.jit(lambda y, c: mixer.direction(y, mixer.prepare(c, 0)))(y, c)
    want = -jax.grad(lambda y_: mixer.energy(y_, c).sum())(y)
    assert_close_to_scale(got, want, 1e-5)


@pytest.mark.parametrize("steps", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_model_training_step_pallas_equals_xla(steps):
    """One optimizer step of a DPLR + RoPE + GQA model with packed documents (and 1 or 2 CEM
    steps per sub-layer): impl="pallas" (kernel, interpreted on CPU) equals impl="xla"."""
    cfg = dict(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=24,
               init_std=0.2, interaction="dplr", steps=steps, attention_block=4)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 11), 0, 32)
    seg = jnp.array([[1] * 4 + [2] * 6, [3] * 10], jnp.int32)

    def loss_fn(m, tokens):
        logits = m(tokens[:, :-1], segment_ids=seg).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def train_step(impl):
        m = CEMTransformer(ModelConfig(**cfg, impl=impl), rngs=nnx.Rngs(0))
        _set_diagonals(m)  # non-zero, so the DPLR half of the concatenated head matters
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(m, tokens)
        params, tx = nnx.state(m, nnx.Param), optax.adam(1e-2)
        updates, _ = tx.update(grads, tx.init(params), params)
        return loss, grads, optax.apply_updates(params, updates)

    loss_p, grads_p, params_p = train_step("pallas")
    loss_x, grads_x, params_x = train_step("xla")
    assert_close_to_scale(loss_p, loss_x, 1e-5)
    for gp, gx in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_x), strict=True):
        assert_close_to_scale(gp, gx, 1e-5)
    for pp, px in zip(jax.tree.leaves(params_p), jax.tree.leaves(params_x), strict=True):
        assert_close_to_scale(pp, px, 1e-5)


def _set_diagonals(m):
    for path, value in nnx.iter_graph(m):
        if path and path[-1] == "diag" and isinstance(value, nnx.Param):
            value[...] = 0.3 * jax.random.normal(jax.random.PRNGKey(1), value[...].shape)
