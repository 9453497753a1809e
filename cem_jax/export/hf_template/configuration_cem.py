"""Configuration of a CEM Transformer exported by cem_jax (`cem-export --format hf`).

The fields are those of `cem_jax.config.ModelConfig` (see its docstring and DESIGN.md §1 of
cem_jax): D = d_model, H = num_heads, G = num_kv_heads, K = head_dim, F = mlp_dim, L = num_layers.
"""

from transformers import PretrainedConfig


class CEMConfig(PretrainedConfig):
    """A CEM (Causal Energy Minimization) Transformer language model."""

    model_type = "cem"

    def __init__(self, vocab_size=2048, d_model=128, num_layers=4, num_heads=2,
                 num_kv_heads=None, head_dim=None, mlp_dim=352, activation="silu",
                 tie_attention=True, tie_mlp=True, interaction="lowrank", diagonal="per_head",
                 preconditioner="scalar", preconditioner_rank=4, steps=1,
                 recompute_context=False, gradient_wrt="normalized", position="rope",
                 rope_theta=10000.0, rope_type="default", rope_factor=1.0,
                 rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_position=8192, norm_eps=1e-5, tie_embeddings=True,
                 init_std=0.02, use_cache=True, **kwargs):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = d_model // num_heads if head_dim is None else head_dim
        self.mlp_dim = mlp_dim
        self.activation = activation
        self.tie_attention = tie_attention
        self.tie_mlp = tie_mlp
        self.interaction = interaction
        self.diagonal = diagonal
        self.preconditioner = preconditioner
        self.preconditioner_rank = preconditioner_rank
        self.steps = steps
        self.recompute_context = recompute_context
        self.gradient_wrt = gradient_wrt
        self.position = position
        self.rope_theta = rope_theta
        self.rope_type = rope_type  # "default", "linear" or "llama3" (modeling_cem.frequencies)
        self.rope_factor = rope_factor
        self.rope_low_freq_factor = rope_low_freq_factor
        self.rope_high_freq_factor = rope_high_freq_factor
        self.rope_original_max_position = rope_original_max_position
        self.norm_eps = norm_eps
        self.tie_embeddings = tie_embeddings
        self.init_std = init_std  # a fresh model's (or a resized embedding's) matrices
        self.use_cache = use_cache
        # Names the rest of transformers looks for. The head is the embedding by transformers'
        # weight tying (`CEMForCausalLM._tied_weights_keys`) where tie_word_embeddings says so:
        # by default where the run tied them.
        self.hidden_size = d_model
        self.num_hidden_layers = num_layers
        self.num_attention_heads = num_heads
        kwargs.setdefault("tie_word_embeddings", tie_embeddings)
        super().__init__(**kwargs)
