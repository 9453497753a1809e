"""Helpers shared by the tests: tolerances, explicit reference matrices, random parameters."""

import math

import jax
import numpy as np
from flax import nnx

from cem_jax.config import ModelConfig
from cem_jax.model import CEMTransformer


def assert_close_to_scale(got, want, tol=1e-5):
    """max |got - want| ≤ tol · max |want| (error relative to the output scale)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want)), 1e-12)
    err = np.max(np.abs(got - want)) / scale
    assert err <= tol, f"relative max error {err:.3g} > {tol}"


def rotation_matrix(pos, K, theta=10000.0):
    """Explicit RoPE matrix R_t [K,K] in the half-split (Hugging Face Llama) convention."""
    half = K // 2
    R = np.zeros((K, K))
    for i in range(half):
        ang = pos * theta ** (-i / half)
        c, s = math.cos(ang), math.sin(ang)
        R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    return R


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Parameters of the model's shapes (numpy, in `cfg.param_dtype`): weights normal(0, 0.3),
    norm scales 1 + normal(0, 0.1), preconditioner ρ softplus⁻¹(1) + normal(0, 0.3), DPLR
    diagonals normal(0, 0.3): far from the 0 / identity starts, with logits of order 1. (Made
    from the abstract model: creating a model eagerly takes seconds.)"""
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: CEMTransformer(cfg, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(seed)

    def draw(path, a):
        noise = rng.normal(size=a.shape).astype(np.float32)
        name = path[-1].key
        if name == "scale":
            return (1 + 0.1 * noise).astype(a.dtype)
        return ((math.log(math.e - 1) if name == "rho" else 0.0) + 0.3 * noise).astype(a.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")  # ids 0 and 1 of `train_byte_level_bpe`'s


def train_byte_level_bpe(texts: list[str], vocab_size: int, path) -> None:
    """Write to `path` a GPT-2-style byte-level BPE tokenizer.json of exactly `vocab_size` ids
    trained offline on `texts` with the `tokenizers` library: BPE_SPECIAL_TOKENS, the 256 byte
    symbols, then merges (no normalizer, no prefix space: it encodes any text losslessly)."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = sorted({w.strip(".,\n").lower() for t in texts for w in t.split()})[:16]
    pairs = " ".join(a + b for a, b in itertools.product(words, words))  # merges to learn
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([*texts, pairs], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(BPE_SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    tokenizer.save(str(path))
