"""A CEM Transformer in PyTorch: the second, independent implementation of cem_jax's DESIGN.md §1,
shipped with an exported model (`cem-export --format hf`) and loaded by
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.

Each sub-layer with input x⁰ [B,T,D] fixes the context c = RMSNorm(x⁰) and takes `steps` steps
xᵏ⁺¹ = xᵏ + P·u(yᵏ | c), yᵏ = RMSNorm(xᵏ) (c = yᵏ at every step with recompute_context), with u
the negative energy gradient in closed form, written here with full [T,S] score matrices:

  tied attention  u_t = Σ_h Wq_h R_tᵀ Σ_s p_ts R_s Wk_g c_s  (+ d_h ⊙ Σ_s p_ts c_s with DPLR),
                  p_t = softmax_s(β[(R_t Wq_h y_t)ᵀ(R_s Wk_g c_s) + y_tᵀ diag(d_h) c_s]), β = K^-½
  tied MLP        u = Wgᵀ(σ(Wg y) ⊙ Wu c)
  baseline        Llama attention (free Wv, Wo) and SwiGLU (free down projection)

P = I, softplus(ρ)·I, diag(softplus(ρ)) or diag(softplus(ρ)) + U Uᵀ. With gradient_wrt =
"residual" u is pulled back through RMSNorm (its vector-Jacobian product, by torch.func.vjp).
RoPE is the half-split (rotate_half) convention, its frequencies scaled as config.rope_type
says (transformers' "linear" and "llama3" types, `frequencies`).

Fine-tuning. The embedding is an `nn.Embedding` and the head an `nn.Linear` (the same matrix when
the run ties them: `_tied_weights_keys`), so `resize_token_embeddings`, `inputs_embeds` and
gradient checkpointing (`supports_gradient_checkpointing`, per `Block`) work as for any
transformers model. A projection used once is an `nn.Linear` (weight [out, in]: key [G·K, D],
up [F, D], and the baseline's query, value, gate, out [D, H·K], down [D, F]), which LoRA
targets by module name (peft's `target_modules`). A tied matrix (Wq of tied attention
[H·K, D], Wg of the tied MLP [F, D]) is used twice, as itself and transposed, so it is a `Tied`
module, which LoRA targets through peft's `target_parameters` ("query.weight",
"gate.weight"): one adapter on it changes both of its uses, as training the tied model does.

Cache. `generate` passes a transformers `DynamicCache`; each block's attention keeps in its layer
what later tokens read of earlier ones (the JAX decode cache's kinds, cem_jax.kvcache): keys
[B,C,G,S,K] rotated at their positions, and in the value slot the values [B,C,G,S,K] of the
baseline, the contexts c [B,C,S,D] of DPLR attention, or nothing of tied attention ([B,C,S,0]:
its values are its keys). C = steps with recompute_context (one context per step), else 1. The
MLP is token-wise and keeps nothing.

Parameter names: those of the cem_jax safetensors export, each projection a module with a
`.weight` [out, in] (`embed.weight` [V,D], `layers.{i}.attention.mixer.query.weight` [H·K, D],
...). An export written before the projections were modules (`embed`, `...mixer.query`
[D,H,K], ...) loads through `from_cem_layout` (`CEMForCausalLM.from_pretrained`).
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import DynamicCache, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_cem import CEMConfig

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
WEIGHTS = "model.safetensors"


def rms_norm(x, scale, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale.float()).to(x.dtype)


def frequencies(config, device=None):
    """RoPE's angular frequency of each feature pair, fp32 [K/2]: θ^(-2i/K), then scaled:
    "linear" divides all by rope_factor; "llama3" (Llama 3.1) divides those whose wavelength
    λ = 2π/ω exceeds N / rope_low_freq_factor (N = rope_original_max_position), keeps those
    below N / rope_high_freq_factor, and blends in between with weight
    s = (N/λ - low) / (high - low) on the unscaled frequency."""
    half = config.head_dim // 2
    omega = config.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    if config.rope_type == "default":
        return omega
    scaled = omega / config.rope_factor
    if config.rope_type == "linear":
        return scaled
    if config.rope_type != "llama3":
        raise ValueError(f"unknown rope_type {config.rope_type!r}")
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    n = config.rope_original_max_position
    wavelength = 2 * math.pi / omega
    s = ((n / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - s) * scaled + s * omega


def rotate(x, positions, omega, inverse=False):
    """RoPE of heads-major x [B,N,T,K] at positions [B,T] with frequencies omega [K/2] (R_t,
    or R_tᵀ when inverse)."""
    half = x.shape[-1] // 2
    angles = positions.float()[:, None, :, None] * omega
    cos, sin = torch.cos(angles), torch.sin(angles)
    if inverse:
        sin = -sin
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def from_cem_layout(tensors, config):
    """The tensors of an export written before the projections were modules (the names and
    layouts of the cem_jax safetensors export: embed [V,D], lm_head [D,V], query [D,H,K], key
    and value [D,G,K], gate and up [D,F], out [H,K,D], down [F,D]) → this model's state dict:
    `embed.weight` [V,D] and each projection's `.weight` [out, in]; the rest as it is."""
    D = config.d_model
    out = {}
    for name, w in tensors.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed":
            out["embed.weight"] = w
        elif leaf in ("lm_head", "query", "key", "value", "gate", "up"):  # [D,...] → [out, D]
            out[f"{name}.weight"] = w.reshape(D, -1).T.contiguous()
        elif leaf in ("out", "down"):  # [...,D] → [D, in]
            out[f"{name}.weight"] = w.reshape(-1, D).T.contiguous()
        else:
            out[name] = w
    return out


def cem_layout_tensors(directory):
    """The tensors of `directory`/model.safetensors when they are in the cem_jax layout (an
    export written before the projections were modules: `embed`, `...mixer.query` [D,H,K],
    ...), else None (a hub name, another layout)."""
    if directory is None or not (Path(directory) / WEIGHTS).is_file():
        return None
    with safe_open(Path(directory) / WEIGHTS, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()} if "embed" in f.keys() else None


class Tied(nn.Module):
    """A matrix W [O,I] used twice: `forward(x)` = x Wᵀ ([...,I] → [...,O], as nn.Linear) and
    `forward(x, transpose=True)` = x W ([...,O] → [...,I]). Both uses are calls of this module,
    so peft's `target_parameters` LoRA (which adapts `weight` while the module runs) changes
    both."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x, transpose=False):
        return x @ self.weight if transpose else F.linear(x, self.weight)


class Norm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(config.d_model))


class Precond(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kind = config.preconditioner
        if self.kind == "scalar":
            self.rho = nn.Parameter(torch.empty(()))
        elif self.kind in ("diag", "dplr"):
            self.rho = nn.Parameter(torch.empty(config.d_model))
        if self.kind == "dplr":
            self.U = nn.Parameter(torch.empty(config.d_model, config.preconditioner_rank))

    def forward(self, u):
        if self.kind == "none":
            return u
        out = F.softplus(self.rho.float()).to(u.dtype) * u
        if self.kind == "dplr":
            out = out + (u @ self.U) @ self.U.T
        return out


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, H, G, K = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        self.H, self.G, self.K = H, G, K
        self.tied = config.tie_attention
        self.rope = config.position == "rope"
        self.config = config
        self.query = Tied(D, H * K) if self.tied else nn.Linear(D, H * K, bias=False)
        self.key = nn.Linear(D, G * K, bias=False)
        if not self.tied:
            self.value = nn.Linear(D, G * K, bias=False)
            self.out = nn.Linear(H * K, D, bias=False)
        elif config.interaction == "dplr":
            self.diag = nn.Parameter(torch.empty((H, D) if config.diagonal == "per_head" else D))

    def _rot(self, x, positions, inverse=False):
        if not self.rope:
            return x
        return rotate(x, positions, frequencies(self.config, x.device), inverse)

    def _heads(self, x, n):
        """[B,T,n·K] → heads-major [B,n,T,K]."""
        return x.unflatten(-1, (n, self.K)).transpose(1, 2)

    def prepare(self, c, positions):
        """What tokens with context c [B,T,D] at positions [B,T] give later tokens to read (what
        the cache keeps): (keys [B,G,T,K], rotated at their positions; the values [B,G,T,K]
        untied, c itself tied with DPLR (the diagonal's keys and values), or an empty
        [B,T,0] tied: the values are the keys)."""
        k = self._rot(self._heads(self.key(c), self.G), positions)
        if not self.tied:
            return k, self._heads(self.value(c), self.G)
        return k, c if hasattr(self, "diag") else c[..., :0]

    def direction(self, y, context, positions, mask):
        """u [B,T,D] of tokens y [B,T,D] at positions [B,T] reading `context` (`prepare`'s of
        slots S, earlier tokens' first) where mask [B,1,T,S] allows."""
        k, second = context
        R = self.H // self.G
        q = self._rot(self._heads(self.query(y), self.H), positions)
        k = k.repeat_interleave(R, dim=1)  # head h reads key head h // R
        scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(self.K)
        diag = getattr(self, "diag", None)
        if diag is not None:
            d = diag if diag.dim() == 2 else diag.expand(self.H, -1)
            yd = y[:, None] * d[None, :, None, :]  # [B,H,T,D]
            scores = scores + torch.einsum("bhtd,bsd->bhts", yd.float(), second.float()) \
                / math.sqrt(self.K)
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(y.dtype)
        if not self.tied:
            o = p @ second.repeat_interleave(R, dim=1)
            return self.out(o.transpose(1, 2).flatten(2))
        o = self._rot(p @ k, positions, inverse=True)
        u = self.query(o.transpose(1, 2).flatten(2), transpose=True)
        if diag is not None:
            u = u + torch.einsum("bhts,bsd,hd->btd", p, second, d)
        return u


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, Fw = config.d_model, config.mlp_dim
        self.act = ACTIVATIONS[config.activation]
        self.tied = config.tie_mlp
        self.gate = Tied(D, Fw) if self.tied else nn.Linear(D, Fw, bias=False)
        self.up = nn.Linear(D, Fw, bias=False)
        if not self.tied:
            self.down = nn.Linear(Fw, D, bias=False)

    def prepare(self, c, positions):
        return self.up(c)

    def direction(self, y, up, positions, mask):
        h = self.act(self.gate(y)) * up
        return self.gate(h, transpose=True) if self.tied else self.down(h)


def with_past(cache, index, j, new):
    """Context j of attention sub-layer `index`: the cached one of earlier tokens (if any), then
    the new tokens' (`new`, as `Attention.prepare` gives it), joined on the slot axis."""
    if cache.get_seq_length(index) == 0:
        return new
    layer = cache.layers[index]
    past = (layer.keys[:, j], layer.values[:, j])
    return tuple(torch.cat([old, n], dim=-2) for old, n in zip(past, new, strict=True))


class SubLayer(nn.Module):
    def __init__(self, config, mixer):
        super().__init__()
        self.norm = Norm(config)
        self.mixer = mixer
        self.precond = Precond(config)
        self.steps, self.eps = config.steps, config.norm_eps
        self.recompute_context = config.recompute_context
        self.residual = config.gradient_wrt == "residual"

    def forward(self, x, positions, mask, cache=None, index=0):
        """x [B,T,D] after the steps. An attention sub-layer given a cache reads the contexts
        of earlier tokens from its layer `index` and appends the new tokens' (C of them)."""
        def norm(x_):
            return rms_norm(x_, self.norm.scale, self.eps)

        c = norm(x)
        new = [self.mixer.prepare(c, positions)]  # the new tokens' contexts, one per context
        context = new[0] if cache is None else with_past(cache, index, 0, new[0])
        for k in range(self.steps):
            y = c if k == 0 else norm(x)
            if self.recompute_context and k > 0:
                new.append(self.mixer.prepare(y, positions))
                context = new[k] if cache is None else with_past(cache, index, k, new[k])
            u = self.mixer.direction(y, context, positions, mask)
            if self.residual:
                u = torch.func.vjp(norm, x)[1](u)[0]
            x = x + self.precond(u)
        if cache is not None:
            keys, values = (torch.stack(parts, dim=1) for parts in zip(*new, strict=True))
            cache.update(keys, values, index)
        return x


class Block(GradientCheckpointingLayer):
    def __init__(self, config):
        super().__init__()
        self.attention = SubLayer(config, Attention(config))
        self.mlp = SubLayer(config, MLP(config))

    def forward(self, x, positions, mask, cache=None, index=0):
        """x [B,T,D] → [B,T,D]; `cache` (a keyword: gradient checkpointing drops it) is read and
        written at layer `index` by the attention sub-layer."""
        return self.mlp(self.attention(x, positions, mask, cache, index), positions, mask)


class CEMForCausalLM(PreTrainedModel, GenerationMixin):
    """CEM Transformer LM: embedding, L blocks, final RMSNorm, logits (fp32). See the module's
    docstring for what fine-tuning may target: a LoRA adapter on a tied matrix (query, gate)
    changes both of its uses."""

    config_class = CEMConfig
    base_model_prefix = "cem"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "embed.weight"}  # when config.tie_word_embeddings
    supports_gradient_checkpointing = True

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.final_norm = Norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        """A fresh model's parameters (and the rows resize_token_embeddings adds without
        mean_resizing): matrices N(0, init_std²), norm scales 1, P = I (softplus(ρ) = 1), DPLR
        diagonals 0. (transformers' `initialization` functions leave loaded tensors alone.)"""
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding, Tied)):
            init.normal_(module.weight, std=std)
        elif isinstance(module, Norm):
            init.ones_(module.scale)
        elif isinstance(module, Precond) and module.kind != "none":
            init.constant_(module.rho, math.log(math.e - 1.0))
            if module.kind == "dplr":
                init.normal_(module.U, std=std)
        elif isinstance(module, Attention) and hasattr(module, "diag"):
            init.zeros_(module.diag)

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained, which also reads a local export written before the
        projections were modules (`cem_layout_tensors`), converted by `from_cem_layout`
        (transformers v5 sets tensors by name, never through `_load_from_state_dict`)."""
        tensors = cem_layout_tensors(pretrained_model_name_or_path)
        if tensors is None:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        config = kwargs.pop("config", None) or cls.config_class.from_pretrained(
            pretrained_model_name_or_path)
        model = super().from_pretrained(None, *args, config=config,
                                        state_dict=from_cem_layout(tensors, config), **kwargs)
        model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path)
        return model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, **kwargs):
        """input_ids [B,T] or inputs_embeds [B,T,D]; attention_mask [B,S] over the cached and
        the new tokens, S = cached + T (1 = token, 0 = padding; left padding for batched
        generation); position_ids [B,T] (default: counted over the real tokens); cache: a
        transformers `DynamicCache` of the earlier tokens, extended in place (one is made
        when use_cache, default config.use_cache, and none is given); labels [B,T] (the loss
        predicts labels[:, t+1] at t; -100 is ignored)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        device = x.device
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        slot = torch.arange(past + T, device=device)
        query_slot = slot[past:, None]  # [T,1]: the slots of the new tokens
        mask = (slot <= query_slot)[None] & attention_mask.bool()[:, None, :]
        mask = (mask | (slot == query_slot))[:, None]  # [B,1,T,S]; a padding token reads itself
        for i, block in enumerate(self.layers):
            x = block(x, position_ids, mask, cache=cache, index=i)
        logits = self.lm_head(rms_norm(x, self.final_norm.scale, self.config.norm_eps)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
