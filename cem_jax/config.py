"""Model configuration: one validated dataclass and the enumerations of its fields (this module,
like the other config modules, imports no JAX: a launcher, a data tool or a config reader loads
none). Every check raises `ValueError` naming the field, the value and what is allowed
(DESIGN.md §1 gives the meaning of each CEM option); reading YAML files, their `base:` chains
and `section.key=value` overrides is `cem_jax.config_files`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from cem_jax.config_files import check_field_types, did_you_mean, load_section, require

# The enumerations of the model section (this module imports no JAX: a reader of configs, a
# launcher or a data tool, loads none). ACTIVATION_NAMES: the activations `cem_jax.energies`
# defines; `register_activation` adds to it.
ACTIVATION_NAMES = ["silu", "gelu", "relu"]
IMPLS = ("autodiff", "xla", "pallas", "cudnn", "auto")
ROPE_TYPES = ("default", "linear", "llama3")
CUDNN_MAX_HEAD_WIDTH = 256  # cuDNN flash attention's widest head (Hopper, cuDNN 9)
# The built-in sub-layer kinds by role and the flags that describe each: a config without
# attention_kind / mlp_kind takes the kind whose flags it has (the hf export writes them
# back). `cem_jax.kinds` registers them; KIND_NAMES are the kinds ModelConfig accepts, which
# `register_kind` adds a user's to. KIND_CACHES: the decode caches a kind may keep.
BUILT_IN_KINDS = {
    "attention": {"cem_attention": {"tie_attention": True, "interaction": "lowrank"},
                  "cem_dplr_attention": {"tie_attention": True, "interaction": "dplr"},
                  "llama_attention": {"tie_attention": False}},
    "mlp": {"cem_mlp": {"tie_mlp": True}, "swiglu": {"tie_mlp": False}},
}
KIND_NAMES = {role: list(kinds) for role, kinds in BUILT_IN_KINDS.items()}
KIND_CACHES = ("none", "keys", "keys_values", "keys_context")

# ModelConfig fields that choose how the same function is computed (a resumed run may change
# them): the attention implementation, the closed form's query block, rematerialization, the
# loss's chunk.
NOT_IN_MATH = ("impl", "attention_block", "remat", "loss_chunks")



@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are rescaled to stretch a model's context, named and computed as
    the `rope_type`s of Hugging Face transformers (`modeling_rope_utils.py`, v5):

      default  no scaling
      linear   every frequency divided by `factor` (position interpolation: positions / factor)
      llama3   (Llama 3.1) by wavelength λ = 2π/ω against the pretraining context N =
               `original_max_position`: λ < N/high_freq_factor kept, λ > N/low_freq_factor
               divided by `factor`, in between (1-s)·ω/factor + s·ω with
               s = (N/λ - low_freq_factor) / (high_freq_factor - low_freq_factor)

    `ModelConfig` validates the values (its `rope_*` fields); the defaults are no scaling.
    The frequencies: `cem_jax.energies.rope_frequencies`.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


INTERACTIONS = ("lowrank", "dplr")
DIAGONALS = ("per_head", "shared")
PRECONDITIONERS = ("none", "scalar", "diag", "dplr")
POSITIONS = ("rope", "none")
GRADIENT_WRT = ("normalized", "residual")
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only language model of CEM (or Llama baseline) blocks.

    Shapes use the letters of DESIGN.md: D = `d_model`, H = `num_heads`, G = `num_kv_heads`,
    K = `head_dim` (default D // H), F = `mlp_dim`, V = `vocab_size`, L = `num_layers`.

    CEM options (DESIGN.md §1):
      attention_kind, mlp_kind: the sub-layer kinds by name (`cem_jax.kinds`: "cem_attention",
        "cem_dplr_attention", "llama_attention"; "cem_mlp", "swiglu"; or one registered with
        `cem_jax.kinds.register_kind` in a module the config's `imports` names). None (the
        default) picks the built-in one that tie_attention and interaction (tie_mlp) describe;
        a kind given by name leaves those at their defaults.
      tie_attention: attention as the gradient of the interaction energy (value = key,
        output = query transposed); False gives Llama attention with free Wq, Wk, Wv, Wo.
      tie_mlp: gated MLP as the gradient of the element-wise energy (down = gateᵀ).
      interaction: "lowrank" (rank-K heads) or "dplr" (adds a diagonal term yᵀ diag(d_h) c).
      diagonal: "per_head" (one d_h ∈ R^D per head) or "shared" (one d for all heads).
      preconditioner: "none" | "scalar" | "diag" | "dplr" (positive definite by construction).
      preconditioner_rank: rank r of the low-rank part of the "dplr" preconditioner.
      steps: gradient steps per sub-layer with the same weights (T ≥ 1; 1 = a pre-norm block).
      recompute_context: re-normalize the context from the current residual at every step
        (default False: the context is the sub-layer's input, a conditional energy).
      gradient_wrt: "normalized" (gradient in y = RMSNorm(x), as a pre-norm block does) or
        "residual" (through the norm, with respect to x; a true descent step on x).
      position: "rope" or "none" (NoPE).
      rope_theta: RoPE's base θ (frequencies θ^(-2i/K)).
      rope_type: RoPE's frequency scaling, as Hugging Face names it: "default" (none),
        "linear" (frequencies / rope_factor) or "llama3" (Llama 3.1: by wavelength, with
        rope_factor, rope_low_freq_factor, rope_high_freq_factor and the pretraining context
        rope_original_max_position); formulas in `RopeScaling`.
      activation: σ of the MLP, "silu" | "gelu" | "relu" or one added with
        `cem_jax.energies.register_activation` (its antiderivative Φ is the MLP energy's).
      impl: "autodiff" (-jax.grad of the energy), "xla" (closed form), "pallas" (closed
        form with tied attention in the fused Pallas kernel, interpret mode on CPU, slow;
        untied attention on a TPU in JAX's splash attention kernel, elsewhere XLA's),
        "cudnn" (attention in cuDNN's flash attention: a GPU, bfloat16, heads ≤ 256 wide) or
        "auto" (the fastest of these for the platform, `cem_jax.attention.attention_impl`); all
        agree, and a resumed run may change it (`NOT_IN_MATH`).
      attention_block: query block of the xla attention's causal block skipping (speed only).
      loss_chunks: how many chunks of the sequence the loss takes the logits in (training and
        evaluation hold [B, ⌈T / loss_chunks⌉, V] fp32 logits at once, `cem_jax.loss`; memory
        and speed only: the loss is the same).
    """

    # The defaults are the tiny CEM model of configs/shakespeare_cem.yaml (`make train`, and
    # `cem-train` without --config; the other sections' defaults are that file's too), but for
    # scan_layers: a scan compiles a deep model once, where that file unrolls its 4 small layers
    # (faster on a CPU).
    vocab_size: int = 2048
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int = 352
    activation: str = "silu"
    attention_kind: str | None = None
    mlp_kind: str | None = None
    tie_attention: bool = True
    tie_mlp: bool = True
    interaction: str = "lowrank"
    diagonal: str = "per_head"
    preconditioner: str = "scalar"
    preconditioner_rank: int = 4
    steps: int = 1
    recompute_context: bool = False
    gradient_wrt: str = "normalized"
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    impl: str = "xla"
    attention_block: int = 128
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: str = "none"
    loss_chunks: int = 4
    # Values computed from the fields that a config may name by mistake, and what sets them
    # (`cem_jax.config_files.from_dict` says so).
    SET_THROUGH: ClassVar[dict[str, str]] = {"kinds": "attention_kind and mlp_kind",
                                             "kv_heads": "num_kv_heads", "head_width": "head_dim"}

    def __post_init__(self):
        self.validate()

    @property
    def kv_heads(self) -> int:
        """G, the number of key heads (defaults to H: multi-head attention)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_width(self) -> int:
        """K, the width of one head (defaults to D // H)."""
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    def resolved(self) -> ModelConfig:
        """The same model with the defaults that null stands for written out (num_kv_heads = G,
        head_dim = K): two configs of one model compare equal so (cem-import writes them)."""
        return dataclasses.replace(self, num_kv_heads=self.kv_heads, head_dim=self.head_width)

    @property
    def rope_scaling(self) -> RopeScaling:
        """The `rope_*` scaling fields as the `RopeScaling` of the attention layers."""
        return RopeScaling(self.rope_type, self.rope_factor, self.rope_low_freq_factor,
                           self.rope_high_freq_factor, self.rope_original_max_position)

    @property
    def kinds(self) -> tuple[str, str]:
        """The names of the attention and the MLP sub-layer kinds (`cem_jax.kinds`)."""
        def kind(role: str) -> str:
            return getattr(self, f"{role}_kind") or next(
                name for name, flags in BUILT_IN_KINDS[role].items()
                if all(getattr(self, k) == v for k, v in flags.items()))

        return kind("attention"), kind("mlp")

    def validate(self) -> None:
        """Raise `ValueError` naming the first field that is out of range or inconsistent."""
        check_field_types(self)
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "steps",
                     "preconditioner_rank", "attention_block", "rope_original_max_position",
                     "loss_chunks"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name,
                     getattr(self, name), "a positive integer")
        for name, allowed in (("activation", tuple(ACTIVATION_NAMES)),
                              ("interaction", INTERACTIONS),
                              ("diagonal", DIAGONALS), ("preconditioner", PRECONDITIONERS),
                              ("position", POSITIONS), ("impl", IMPLS),
                              ("gradient_wrt", GRADIENT_WRT), ("dtype", DTYPES),
                              ("param_dtype", DTYPES), ("remat", REMAT),
                              ("rope_type", ROPE_TYPES)):
            value = getattr(self, name)
            require(value in allowed, name, value, "one of " + ", ".join(repr(a) for a in allowed)
                    + did_you_mean(value, [a for a in allowed if isinstance(a, str)]))
        if self.head_dim is None:
            require(self.d_model % self.num_heads == 0, "d_model", self.d_model,
                     f"divisible by num_heads={self.num_heads} (or set head_dim explicitly)")
        else:
            require(isinstance(self.head_dim, int) and self.head_dim >= 1, "head_dim",
                     self.head_dim, "a positive integer or null")
        if self.position == "rope":
            require(self.head_width % 2 == 0, "head_dim", self.head_width,
                     "even when position='rope' (RoPE rotates pairs of features)")
        g = self.kv_heads
        require(isinstance(g, int) and g >= 1 and self.num_heads % g == 0, "num_kv_heads", g,
                 f"a positive divisor of num_heads={self.num_heads} (GQA)")
        for name in ("rope_theta", "norm_eps", "init_std", "rope_factor", "rope_low_freq_factor"):
            require(float(getattr(self, name)) > 0, name, getattr(self, name), "> 0")
        require(self.rope_high_freq_factor > self.rope_low_freq_factor, "rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"> rope_low_freq_factor = {self.rope_low_freq_factor} (llama3 scaling)")
        if self.rope_type == "default":
            require(self.rope_factor == 1.0, "rope_factor", self.rope_factor,
                    "1.0 with rope_type='default' (set rope_type to 'linear' or 'llama3' to "
                    "scale RoPE)")
        else:
            require(self.position == "rope", "rope_type", self.rope_type,
                    "'default' with position='none' (there is no RoPE to scale)")
        if self.impl == "cudnn":
            require(self.dtype == "bfloat16", "impl", self.impl, "used with dtype='bfloat16' "
                    "(cuDNN's flash attention takes bf16/fp16): set dtype or impl='auto'")
            require(self.kinds[0] != "cem_dplr_attention", "impl", self.impl,
                    f"not 'cudnn' with the cem_dplr_attention kind (interaction='dplr'): its "
                    f"heads are K + D = {self.head_width + self.d_model} wide, cuDNN takes at most "
                    f"{CUDNN_MAX_HEAD_WIDTH}; use impl='pallas', 'xla' or 'auto'")
        self._check_kinds()
        require(self.interaction == "lowrank" or self.tie_attention, "interaction",
                self.interaction, "'lowrank' when tie_attention is false (the diagonal term "
                "belongs to the CEM attention energy)")

    def _check_kinds(self) -> None:
        """A kind named by `attention_kind` / `mlp_kind` is registered for its role, and the
        flags it replaces are left at their defaults."""
        for role, kinds in BUILT_IN_KINDS.items():
            field = f"{role}_kind"
            name = getattr(self, field)
            if name is None:
                continue
            flags = sorted({flag for described in kinds.values() for flag in described})
            require(name in KIND_NAMES[role], field, name,
                    f"one of {', '.join(KIND_NAMES[role])}{did_you_mean(name, KIND_NAMES[role])} "
                    f"(a kind of your own: register it with cem_jax.kinds.register_kind in a "
                    f"module the config's imports names)")
            for flag in flags:
                require(getattr(self, flag) == getattr(ModelConfig, flag), flag,
                        getattr(self, flag), f"left at its default when {field} names the kind")


def load_model_config(path: str | Path | None = None,
                      overrides: Sequence[str] = ()) -> ModelConfig:
    """The `model:` section of a YAML file (see `load_section`)."""
    return load_section(ModelConfig, "model", path, overrides)
