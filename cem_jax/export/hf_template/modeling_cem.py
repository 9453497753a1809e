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
says (transformers' "linear" and "llama3" types, `frequencies`). Parameter names and layouts are
those of the cem_jax safetensors export (query [D,H,K], key [D,G,K], out [H,K,D], gate/up
[D,F], ...).
There is no key/value cache: generation recomputes the sequence at every step.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_cem import CEMConfig

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


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


def _param(*shape, std=None, value=0.0):
    data = torch.randn(*shape) * std if std is not None else torch.full(shape, float(value))
    return nn.Parameter(data)


class Norm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scale = _param(config.d_model, value=1.0)


class Precond(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kind = config.preconditioner
        one = math.log(math.e - 1.0)
        if self.kind == "scalar":
            self.rho = nn.Parameter(torch.tensor(one))
        elif self.kind in ("diag", "dplr"):
            self.rho = _param(config.d_model, value=one)
        if self.kind == "dplr":
            self.U = _param(config.d_model, config.preconditioner_rank, std=0.02)

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
        self.query = _param(D, H, K, std=0.02)
        self.key = _param(D, G, K, std=0.02)
        if not self.tied:
            self.value = _param(D, G, K, std=0.02)
            self.out = _param(H, K, D, std=0.02)
        elif config.interaction == "dplr":
            self.diag = _param(*((H, D) if config.diagonal == "per_head" else (D,)))

    def _rot(self, x, positions, inverse=False):
        if not self.rope:
            return x
        return rotate(x, positions, frequencies(self.config, x.device), inverse)

    def prepare(self, c, positions):
        k = self._rot(torch.einsum("btd,dgk->bgtk", c, self.key), positions)
        v = None if self.tied else torch.einsum("btd,dgk->bgtk", c, self.value)
        return c, k, v

    def direction(self, y, context, positions, mask):
        c, k, v = context
        R = self.H // self.G
        q = self._rot(torch.einsum("btd,dhk->bhtk", y, self.query), positions)
        k = k.repeat_interleave(R, dim=1)  # head h reads key head h // R
        scores = torch.einsum("bhtk,bhsk->bhts", q.float(), k.float()) / math.sqrt(self.K)
        diag = getattr(self, "diag", None)
        if diag is not None:
            d = diag if diag.dim() == 2 else diag.expand(self.H, -1)
            yd = y[:, None] * d[None, :, None, :]  # [B,H,T,D]
            scores = scores + torch.einsum("bhtd,bsd->bhts", yd.float(), c.float()) \
                / math.sqrt(self.K)
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(y.dtype)
        if not self.tied:
            o = p @ v.repeat_interleave(R, dim=1)
            return torch.einsum("bhtk,hkd->btd", o, self.out)
        o = self._rot(p @ k, positions, inverse=True)
        u = torch.einsum("bhtk,dhk->btd", o, self.query)
        if diag is not None:
            u = u + torch.einsum("bhts,bsd,hd->btd", p, c, d)
        return u


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, Fw = config.d_model, config.mlp_dim
        self.act = ACTIVATIONS[config.activation]
        self.gate = _param(D, Fw, std=0.02)
        self.up = _param(D, Fw, std=0.02)
        if not config.tie_mlp:
            self.down = _param(Fw, D, std=0.02)

    def prepare(self, c, positions):
        return c @ self.up

    def direction(self, y, up, positions, mask):
        h = self.act(y @ self.gate) * up
        return h @ self.down if hasattr(self, "down") else h @ self.gate.T


class SubLayer(nn.Module):
    def __init__(self, config, mixer):
        super().__init__()
        self.norm = Norm(config)
        self.mixer = mixer
        self.precond = Precond(config)
        self.steps, self.eps = config.steps, config.norm_eps
        self.recompute_context = config.recompute_context
        self.residual = config.gradient_wrt == "residual"

    def forward(self, x, positions, mask):
        def norm(x_):
            return rms_norm(x_, self.norm.scale, self.eps)

        c = norm(x)
        context = self.mixer.prepare(c, positions)
        for k in range(self.steps):
            y = c if k == 0 else norm(x)
            if self.recompute_context and k > 0:
                context = self.mixer.prepare(y, positions)
            u = self.mixer.direction(y, context, positions, mask)
            if self.residual:
                u = torch.func.vjp(norm, x)[1](u)[0]
            x = x + self.precond(u)
        return x


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = SubLayer(config, Attention(config))
        self.mlp = SubLayer(config, MLP(config))

    def forward(self, x, positions, mask):
        return self.mlp(self.attention(x, positions, mask), positions, mask)


class CEMForCausalLM(PreTrainedModel, GenerationMixin):
    """CEM Transformer LM: embedding, L blocks, final RMSNorm, logits (fp32)."""

    config_class = CEMConfig
    base_model_prefix = "cem"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.embed = _param(config.vocab_size, config.d_model, std=0.02)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.final_norm = Norm(config)
        if not config.tie_embeddings:
            self.lm_head = _param(config.d_model, config.vocab_size, std=0.02)
        self.post_init()

    def _init_weights(self, module):
        """Parameters are created initialised; loading overwrites them all."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None,
                **kwargs):
        """input_ids [B,T]; attention_mask [B,T] (1 = token, 0 = padding; left padding for
        batched generation); position_ids [B,T] (default: counted over the real tokens)."""
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        mask = causal[None] & attention_mask.bool()[:, None, :]
        mask = (mask | torch.eye(T, dtype=torch.bool, device=device))[:, None]  # [B,1,T,S]
        x = self.embed[input_ids]
        for block in self.layers:
            x = block(x, position_ids, mask)
        h = rms_norm(x, self.final_norm.scale, self.config.norm_eps)
        head = self.embed.T if self.config.tie_embeddings else self.lm_head
        logits = (h @ head).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No cache: every generation step sees the whole sequence."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
