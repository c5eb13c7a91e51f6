"""A plain-torch Llama decoder used only to *train* the zoo models.

Parameter names match Hugging Face's ``LlamaForCausalLM`` exactly
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
..., ``lm_head.weight``), so a trained ``state_dict`` is saved as an ordinary
checkpoint that ``transformers`` (and our own model runner) loads unchanged.
The math is HF Llama's: RMSNorm computed in float32, rotate-half RoPE, SwiGLU
MLP, grouped-query attention, no biases.

It exists because a lean module trains faster on a couple of CPU cores than
``transformers``' generic implementation (fewer small operators per step);
``build.py`` checks after training that HF's implementation reproduces its
logits from the saved checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from saguaro_ray.workers.decoder import RMSNorm  # one RMSNorm for training and inference
from saguaro_ray.workers.rope import inverse_frequencies


@dataclass(frozen=True)
class ModelShape:
    """The architecture of one zoo model (everything ``LlamaConfig`` needs)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim], HF's (non-interleaved) layout."""
    inv_freq = inverse_frequencies(head_dim, theta, None)
    pos = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, s: ModelShape, vocab_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class TrainLlama(nn.Module):
    """Llama causal LM with HF parameter names; forward returns logits [B, T, V]."""

    def __init__(self, shape: ModelShape, vocab_size: int, max_len: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.shape = shape
        self.vocab_size = vocab_size
        self.model = Backbone(shape, vocab_size)
        self.lm_head = nn.Linear(shape.hidden_size, vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(max_len, shape.head_dim, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(init_std)

    def _init_weights(self, std: float) -> None:
        # GPT-2 style: normal(0, std), residual output projections scaled down
        # by sqrt(2 * layers) so deeper stacks start near the identity.
        resid_std = std / (2 * self.shape.num_layers) ** 0.5
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, resid_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(ids))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
