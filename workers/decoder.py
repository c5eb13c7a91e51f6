"""Our Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3).

A plain ``torch.nn.Module`` that works on *flat* token batches: the caller
passes token ids, their explicit positions, and an :class:`AttentionStep`
that says where each token's key/value goes (a paged-cache slot, or a tree
branch's scratch row) and which plan the attention backend uses. q/k/v and
gate/up projections are fused into one matrix each at load time, which
halves the number of kernel launches per layer — on CPU, per-operator
overhead dominates for small models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from saguaro_ray.kernels.attention import AttentionBackend
from saguaro_ray.workers.model_config import DecoderConfig
from saguaro_ray.workers.rope import Rotary, apply_rotary


@dataclass
class AttentionStep:
    """Everything a layer needs to store K/V and attend, shared by all layers.

    ``kind == "paged"``: new K/V go to ``slot_mapping`` in the paged cache.
    ``kind == "tree"``: new K/V go to scratch rows ``[branch, suffix_len + j]``.
    """

    kind: str
    backend: AttentionBackend
    plan: object
    slot_mapping: torch.Tensor | None = None
    scratch_slots: torch.Tensor | None = None  # a static tree step: each row's flat scratch slot (data, not Python ints)
    num_branches: int = 0
    suffix_len: int = 0
    n_new: int = 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.d**-0.5
        self.window = cfg.sliding_window

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        scratch: tuple[torch.Tensor, torch.Tensor] | None,
        step: AttentionStep,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.view(t, self.h, self.d)
        k = k.view(t, self.hkv, self.d)
        v = v.view(t, self.hkv, self.d)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k_cache, v_cache = kv
        if step.kind == "paged":
            k_cache.view(-1, self.hkv, self.d).index_copy_(0, step.slot_mapping, k)
            v_cache.view(-1, self.hkv, self.d).index_copy_(0, step.slot_mapping, v)
            out = step.backend.paged(step.plan, q, k_cache, v_cache, self.scale)
        else:
            assert scratch is not None
            ks, vs = scratch
            if step.scratch_slots is not None:
                ks.view(-1, self.hkv, self.d).index_copy_(0, step.scratch_slots, k)
                vs.view(-1, self.hkv, self.d).index_copy_(0, step.scratch_slots, v)
            else:
                nb, lo, hi = step.num_branches, step.suffix_len, step.suffix_len + step.n_new
                ks[:nb, lo:hi] = k.view(nb, step.n_new, self.hkv, self.d)
                vs[:nb, lo:hi] = v.view(nb, step.n_new, self.hkv, self.d)
            out = step.backend.tree(step.plan, q, k_cache, v_cache, ks, vs, self.scale)
        return self.o(out.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Decoder(nn.Module):
    """Embedding → N × (attention, MLP) with pre-norm residuals → norm → LM head."""

    def __init__(self, cfg: DecoderConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_head()
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)

    def tie_head(self) -> None:
        """With tied embeddings the LM head's weight *is* the embedding's parameter.

        The head is an ordinary linear module either way, so the kernels that
        replace linears (packed, quantised) replace it too and a tied head
        keeps reading the embedding's rows. Call again after anything that
        gives parameters new storage one by one (``to_empty``) or replaces
        the embedding (tensor parallelism's vocabulary shard).
        """
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        step: AttentionStep,
        scratch: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = x + layer.attn(layer.input_norm(x), cos, sin, kv_caches[i], scratch[i] if scratch else None, step)
            x = x + layer.mlp(layer.post_norm(x))
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
