"""The `impl` of the attention core: "auto" picks per platform traced for (the abstract mesh's
device, as lowering for a GPU or TPU from this CPU sets it), "cudnn" is refused with a clear
error where cuDNN cannot run, cuDNN's packed-document layout, and the CPU fallback of "auto"
training exactly like "xla". (cuDNN refuses to trace without a GPU: its numbers are tested
compiled in the device run, `benchmarks/gpu_kernels.sh`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from cem_jax.attention import attention_impl, packed_segments
from cem_jax.config import ModelConfig

DEVICES = {"gpu": AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
           "tpu": AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")}
BF16, F32 = jnp.bfloat16, jnp.float32


def _on(platform, impl, dtype, width, tied):
    if platform == "cpu":
        return attention_impl(impl, dtype, width, tied=tied)
    mesh = AbstractMesh((1,), ("data",), abstract_device=DEVICES[platform])
    with jax.sharding.use_abstract_mesh(mesh):
        return attention_impl(impl, dtype, width, tied=tied)


@pytest.mark.parametrize("platform, dtype, width, tied, expected", [
    ("gpu", BF16, 64, True, "cudnn"), ("gpu", BF16, 64, False, "cudnn"),
    ("gpu", BF16, 320, True, "pallas"),  # a DPLR head K + D is wider than cuDNN takes
    ("gpu", F32, 64, True, "pallas"), ("gpu", F32, 64, False, "xla"),
    ("tpu", BF16, 64, True, "pallas"), ("tpu", BF16, 64, False, "splash"),
    ("cpu", BF16, 64, True, "xla"), ("cpu", F32, 64, False, "xla"),
])
def test_auto_is_the_fastest_correct_core_of_the_platform(platform, dtype, width, tied,
                                                          expected):
    assert _on(platform, "auto", dtype, width, tied) == expected


@pytest.mark.parametrize("platform, dtype, width, what", [
    ("cpu", BF16, 64, "needs a GPU .this is cpu."), ("tpu", BF16, 64, "this is tpu"),
    ("gpu", F32, 64, r"here float32"), ("gpu", BF16, 320, r"here 320"),
])
def test_cudnn_where_it_cannot_run_is_a_clear_error(platform, dtype, width, what):
    with pytest.raises(ValueError, match=f"impl='cudnn' runs cuDNN.*{what}.*impl='auto'"):
        _on(platform, "cudnn", dtype, width, True)


def test_explicit_impls_are_kept_and_pallas_untied_is_splash_on_a_tpu():
    assert _on("gpu", "xla", BF16, 64, True) == "xla"
    assert _on("gpu", "cudnn", BF16, 64, False) == "cudnn"
    assert _on("cpu", "pallas", F32, 64, True) == "pallas"
    assert _on("tpu", "pallas", F32, 64, False) == "splash"
    assert _on("gpu", "pallas", F32, 64, False) == "xla"
    assert _on("cpu", "pallas", F32, 64, False) == "xla"
    assert _on("gpu", "autodiff", BF16, 64, True) == "xla"


def test_the_config_refuses_cudnn_with_float32_or_dplr():
    with pytest.raises(ValueError, match="'impl' = 'cudnn'.*dtype='bfloat16'"):
        ModelConfig(impl="cudnn")
    with pytest.raises(ValueError, match="K \\+ D = 320 wide, cuDNN takes at most 256"):
        ModelConfig(impl="cudnn", dtype="bfloat16", interaction="dplr", d_model=256, num_heads=4)
    assert ModelConfig(impl="cudnn", dtype="bfloat16").impl == "cudnn"


def test_packed_segments_are_cudnns_offsets_and_lengths():
    """Rows [1,1,2,3] and [1,1,2,0] (eval padding: id 0): segments start where the id
    changes; offsets are their starts then -1 (T+1 of them), lengths their sizes then -1."""
    offsets, lengths = jax.jit(packed_segments)(jnp.array([[1, 1, 2, 3], [1, 1, 2, 0]]))
    np.testing.assert_array_equal(offsets, [[0, 2, 3, -1, -1], [0, 2, 3, -1, -1]])
    np.testing.assert_array_equal(lengths, [[2, 1, 1, -1], [2, 1, 1, -1]])
    offsets, lengths = packed_segments(jnp.array([[5, 5, 5], [1, 2, 3]]))
    np.testing.assert_array_equal(offsets, [[0, -1, -1, -1], [0, 1, 2, -1]])
    np.testing.assert_array_equal(lengths, [[3, -1, -1], [1, 1, 1]])


def test_auto_on_this_cpu_is_the_xla_model_bit_for_bit():
    from flax import nnx

    from cem_jax.model import CEMTransformer, model_from_params

    tokens = jnp.arange(24).reshape(2, 12) % 50
    for tied in (True, False):
        kw = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=32,
                  tie_attention=tied, tie_mlp=tied)
        params = nnx.to_pure_dict(nnx.state(CEMTransformer(ModelConfig(**kw),
                                                           rngs=nnx.Rngs(0))))
        logits = {impl: model_from_params(ModelConfig(**kw, impl=impl), params)(tokens).logits
                  for impl in ("xla", "auto")}
        np.testing.assert_array_equal(logits["auto"], logits["xla"])


def test_splash_attention_matches_the_xla_core_interpreted():
    """The Llama baseline's TPU core, JAX's splash attention (interpreted here), against the
    blocked XLA core: GQA (4 query heads over 2 key heads) on two packed documents, output and
    the gradients of q, k and v, fp32."""
    from cem_jax.attention import causal_attention, splash_attention
    from cem_jax.energies import AttentionSpec

    B, H, G, T, K = 2, 4, 2, 256, 64
    spec = AttentionSpec(num_heads=H, num_kv_heads=G, head_dim=K)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in
               enumerate([(B, H, T, K), (B, G, T, K), (B, G, T, K)]))
    seg = jnp.concatenate([jnp.zeros((B, 100), jnp.int32), jnp.ones((B, T - 100), jnp.int32)], 1)
    visible = jnp.tril(jnp.ones((T, T), bool)) & (seg[:, :, None] == seg[:, None, :])

    def xla(q, k, v):
        o = causal_attention(q.reshape(B, G, H // G, T, K), k, v, visible[:, None, None], spec)
        return o.reshape(B, H, T, K)

    def loss(core):
        return lambda q, k, v: jnp.sum(jnp.sin(core(q, k, v)))

    splash = lambda q, k, v: splash_attention(q, k, v, seg, spec)  # noqa: E731
    np.testing.assert_allclose(splash(q, k, v), xla(q, k, v), atol=2e-6)
    for got, want in zip(jax.grad(loss(splash), (0, 1, 2))(q, k, v),
                         jax.grad(loss(xla), (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(got, want, atol=5e-5)


@pytest.mark.device
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN runs on a GPU only (the "
                    "device run, benchmarks/gpu_kernels.sh)")
@pytest.mark.parametrize("tied", [True, False])
def test_cudnn_matches_xla_on_a_gpu(tied):
    """Compiled on a GPU: bf16 loss and gradients with cuDNN's attention equal the XLA core's
    on packed documents (segment ids) with GQA, to bf16 tolerance."""
    import optax
    from flax import nnx

    from cem_jax.model import CEMTransformer, model_from_params

    kw = dict(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
              mlp_dim=256, tie_attention=tied, tie_mlp=tied, dtype="bfloat16")
    params = nnx.to_pure_dict(nnx.state(CEMTransformer(ModelConfig(**kw), rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, 256, (2, 129)), jnp.int32)
    segments = np.repeat([[1, 2, 3, 3], [1, 1, 2, 2]], [40, 30, 30, 28], axis=1)  # [2,128]
    starts = np.maximum.accumulate(np.where(np.diff(segments, prepend=0) != 0,
                                            np.arange(128), 0), axis=1)
    positions, segments = jnp.asarray(np.arange(128) - starts), jnp.asarray(segments)

    def loss(params, impl):
        logits = model_from_params(ModelConfig(**kw, impl=impl), params)(
            tokens[:, :-1], positions, segments).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    (want, g_want), (got, g_got) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(
        params, impl) for impl in ("xla", "cudnn"))
    assert abs(float(got) - float(want)) < 2e-2 * abs(float(want))
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 5e-2 * float(jnp.max(jnp.abs(b))) + 1e-6
