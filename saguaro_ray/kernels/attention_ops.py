"""The pieces every attention form is built from: reading keys out of the paged
pool, masked attention (with or without its log-sum-exp), and merging two
partial attentions by log-sum-exp.

They live apart from the forms (:mod:`.paged_attention`,
:mod:`.tree_attention`) because both forms read the pool the same way, and
the tree form's two plans (joint, cascade) share the softmax arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_slots(block_tables: torch.Tensor, lmax: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Flat cache slot of every key position 0..lmax-1 of each sequence: ``[B, lmax]``."""
    lmax = max(lmax, 1)
    blocks = block_tables[:, : -(-lmax // block_size)].to(device)
    slots = blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)
    return slots.view(blocks.shape[0], -1)[:, :lmax]


def contiguous_range(block_tables: torch.Tensor, block_lists: list[list[int]] | None, length: int, block_size: int) -> tuple[int, int] | None:
    """``[start, end)`` when one sequence's first ``length`` keys sit in consecutive
    pool slots (its blocks are consecutive ids — the usual case at batch 1), so
    attention can read a view of the pool instead of gathering."""
    nblk = -(-max(length, 1) // block_size)
    blocks = block_lists[0][:nblk] if block_lists is not None else block_tables[0, :nblk].tolist()
    if len(blocks) < nblk or blocks[-1] - blocks[0] != nblk - 1 or any(b - a != 1 for a, b in zip(blocks, blocks[1:])):
        return None
    return blocks[0] * block_size, blocks[0] * block_size + length


def gather_keys(cache: torch.Tensor, slots: torch.Tensor | None, key_range: tuple[int, int] | None) -> torch.Tensor:
    """Keys (or values) of each sequence/group from the paged pool: ``[B, L, Hkv, D]``
    (a view of the pool when ``key_range`` is set, else a gather of ``slots``)."""
    hkv, d = cache.shape[-2:]
    flat = cache.view(-1, hkv, d)
    if key_range is not None:
        return flat[key_range[0] : key_range[1]].unsqueeze(0)
    return flat[slots]


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Combine two partial softmax-attention results over disjoint key sets.

    ``out_*``: [..., H, D]; ``lse_*``: [..., H] (natural log of the softmax
    denominators). A part with no keys has lse = -inf and contributes nothing.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(lse_a - m)
    wb = torch.exp(lse_b - m)
    denom = (wa + wb).clamp_min(torch.finfo(wa.dtype).tiny)
    out = (out_a.float() * wa.unsqueeze(-1) + out_b.float() * wb.unsqueeze(-1)) / denom.unsqueeze(-1)
    return out.to(out_a.dtype)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns the log-sum-exp.

    q: [G, Hq, R, D]; k, v: [G, Hkv, L, D]; allowed: [G, 1 or Hq, R, L] bool.
    Grouped-query heads are handled by folding the query heads of a KV head
    into the row dimension, so K and V are never repeated. Returns
    out [G, Hq, R, D] and lse [G, Hq, R] (lse = -inf for a row with no key).
    """
    g, hq, r, d = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    qf = q.float().reshape(g, hkv, rep * r, d)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [G, Hkv, rep*R, L]
    scores = scores.view(g, hkv, rep, r, -1)
    mask = allowed.view(g, -1, 1, r, allowed.shape[-1]) if allowed.shape[1] == 1 else allowed.view(g, hkv, rep, r, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [G, Hkv, rep, R]
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.matmul(probs.view(g, hkv, rep * r, -1), v.float()).view(g, hq, r, d)
    return out.to(q.dtype), lse.reshape(g, hq, r)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``scaled_dot_product_attention`` for grouped-query heads: q [B, Hq, Q, D],
    k/v [B, Hkv, L, D]; K and V are repeated only where torch lacks ``enable_gqa``.

    On CUDA without cuDNN's attention: it builds an execution plan for every
    new shape, and a decode step's key length is new every step — measured on
    an H200 (torch 2.11, bf16, batch 4): 42.0 ms a step with it, 2.0 ms
    without (fp32, which cuDNN's kernel does not serve: 1.9 ms)."""
    if q.is_cuda and _NO_CUDNN is not None:
        with sdpa_kernel(_NO_CUDNN):
            return _sdpa(q, k, v, mask, scale)
    return _sdpa(q, k, v, mask, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _sdpa_supports_gqa() -> bool:
    try:
        q = torch.zeros(1, 2, 1, 4)
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


_SDPA_GQA = _sdpa_supports_gqa()
try:  # every backend torch has but cuDNN's (see sdpa)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _NO_CUDNN: list[SDPBackend] | None = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:
    _NO_CUDNN = None
