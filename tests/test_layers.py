"""CEM blocks against Llama blocks built from the same (tied) weights; parameter counts; what the
registry of sub-layer kinds refuses, and the built-in kinds' FLOPs against XLA's count."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close_to_scale, rotation_matrix

from cem_jax.config import ModelConfig
from cem_jax.kinds import KINDS, Kind, Param, get_kind, kind_flops, register_kind
from cem_jax.layers import Block
from cem_jax.model import CEMTransformer, count_params

SMALL = dict(vocab_size=50, d_model=16, num_layers=2, num_heads=4, mlp_dim=24,
             preconditioner="none", init_std=0.3, attention_block=4)


def tied_and_llama_blocks(position, G=4):
    """A tied CEM block with random norm scales, and the untied Llama block whose
    Wv := Wk, Wo := Wqᵀ, Wdown := Wgᵀ (all other weights copied)."""
    common = dict(SMALL, num_kv_heads=G, position=position)
    tied = Block(ModelConfig(**common), rngs=nnx.Rngs(0))
    llama = Block(ModelConfig(**common, tie_attention=False, tie_mlp=False), rngs=nnx.Rngs(1))
    for sub in ("attention", "mlp"):
        scale = 1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(len(sub)), (16,))
        getattr(tied, sub).norm.scale[...] = scale
        getattr(llama, sub).norm.scale[...] = scale
    ta, la = tied.attention.mixer, llama.attention.mixer
    la.query[...], la.key[...], la.value[...] = ta.query[...], ta.key[...], ta.key[...]
    la.out[...] = jnp.transpose(ta.query[...], (1, 2, 0))
    tm, lm = tied.mlp.mixer, llama.mlp.mixer
    lm.gate[...], lm.up[...], lm.down[...] = tm.gate[...], tm.up[...], tm.gate[...].T
    return tied, llama


@pytest.mark.parametrize("G", [4, 2], ids=["mha", "gqa"])
def test_tied_nope_block_is_llama_block_with_tied_weights(G):
    tied, llama = tied_and_llama_blocks("none", G)
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 9, 16))
    assert_close_to_scale(tied(x)[0] - x, llama(x)[0] - x)


def test_tied_rope_attention_differs_by_the_relative_rotation_of_values():
    # CEM: u_t = Σ_h Wq_h Σ_s p_ts R_{s-t} Wk c_s   (R_tᵀ R_s = R_{s-t});
    # "Llama with tied weights" has no R_{s-t}: u_t = Σ_h Wq_h Σ_s p_ts Wk c_s.
    tied, llama = tied_and_llama_blocks("rope")
    x = jax.random.normal(jax.random.PRNGKey(3), (1, 6, 16))
    cem = np.asarray(tied.attention(x)[0] - x, np.float64)[0]
    ll = np.asarray(llama.attention(x)[0] - x, np.float64)[0]
    mixer = tied.attention.mixer
    Wq, Wk = np.asarray(mixer.query[...], np.float64), np.asarray(mixer.key[...], np.float64)
    scale = np.asarray(tied.attention.norm.scale[...], np.float64)
    xs = np.asarray(x, np.float64)[0]
    c = xs / np.sqrt(np.mean(xs**2, -1, keepdims=True) + 1e-5) * scale
    T, (D, H, K) = c.shape[0], Wq.shape
    want_cem, want_llama = np.zeros((T, D)), np.zeros((T, D))
    for t in range(T):
        for h in range(H):
            q = rotation_matrix(t, K) @ (c[t] @ Wq[:, h])
            keys = np.stack([rotation_matrix(s, K) @ (c[s] @ Wk[:, h]) for s in range(t + 1)])
            logits = keys @ q / math.sqrt(K)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            relative = sum(p[s] * rotation_matrix(s - t, K) @ (c[s] @ Wk[:, h])
                           for s in range(t + 1))
            plain = sum(p[s] * (c[s] @ Wk[:, h]) for s in range(t + 1))
            want_cem[t] += Wq[:, h] @ relative
            want_llama[t] += Wq[:, h] @ plain
    assert_close_to_scale(cem, want_cem, 1e-5)
    assert_close_to_scale(ll, want_llama, 1e-5)
    assert np.max(np.abs(cem - ll)) > 1e-2 * np.max(np.abs(ll))  # RoPE makes them differ
    np.testing.assert_allclose(cem[0], ll[0], atol=1e-5)  # t = 0 attends to s = 0 only


def test_parameter_counts_tied_attention_half_tied_mlp_two_thirds():
    def counts(**kw):
        return count_params(CEMTransformer(ModelConfig(**dict(SMALL, **kw)), rngs=nnx.Rngs(0)))

    for G in (4, 2, 1):
        llama = counts(tie_attention=False, tie_mlp=False, num_kv_heads=G)
        cem = counts(num_kv_heads=G)
        assert 2 * cem["attention"] == llama["attention"]
        assert 3 * cem["mlp"] == 2 * llama["mlp"]
        D, H, K, F, L = 16, 4, 4, 24, 2
        assert cem["attention"] == L * D * K * (H + G)
        assert llama["mlp"] == L * 3 * D * F
        assert cem["total"] == sum(v for k, v in cem.items() if k != "total")
    dplr = counts(interaction="dplr", preconditioner="dplr", preconditioner_rank=3)
    assert dplr["attention"] == 2 * (16 * 4 * (4 + 4) + 4 * 16)
    assert dplr["preconditioner"] == 2 * 2 * (16 + 16 * 3)


def test_register_kind_refuses_what_cannot_be_a_layer():
    params = lambda cfg: {"w": Param((cfg.d_model,), ("embed",))}  # noqa: E731
    energy = lambda p, y, c, ctx: jnp.sum(y * p["w"] * c, -1)  # noqa: E731
    with pytest.raises(ValueError, match="'cem_mlp' is a built-in kind"):
        register_kind(Kind("cem_mlp", "mlp", params, energy), replace=True)
    register_kind(Kind("k0", "attention", params, energy), replace=True)
    with pytest.raises(ValueError, match="'k0' is already registered; pick another name"):
        register_kind(Kind("k0", "attention", params, energy))
    with pytest.raises(ValueError, match="role 'ffn'; use one of attention, mlp"):
        register_kind(Kind("k1", "ffn", params, energy))
    with pytest.raises(ValueError, match="neither an energy nor a mixer"):
        register_kind(Kind("k2", "mlp", params))
    with pytest.raises(ValueError, match="declares cache 'keys' but no mixer"):
        register_kind(Kind("k3", "attention", params, energy, cache="keys"))
    with pytest.raises(ValueError, match="already registered as an attention kind"):
        register_kind(Kind("k0", "mlp", params, energy), replace=True)
    assert not {"k1", "k2", "k3"} & set(KINDS)


def test_the_built_in_kinds_flops_are_the_cost_analysis_of_their_step():
    # the analytic counts (MFU's) against XLA's count of one closed-form step, T = 64
    cfg = ModelConfig(d_model=64, num_heads=4, mlp_dim=96, attention_block=64)
    for name in ("cem_mlp", "swiglu"):
        kind = get_kind(name)
        per_context, per_step = kind_flops(kind, cfg, 64)
        measured = kind_flops(dataclasses.replace(kind, flops=None), cfg, 64)[1]
        assert abs(per_context + per_step - measured) <= 0.05 * measured, (name, measured)
