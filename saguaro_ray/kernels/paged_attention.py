"""Paged attention in portable torch: a ragged batch of sequences, each bringing
``n_b >= 1`` new query tokens, attends causally to its own KV (prompt, earlier
tokens and the new tokens, already written to the cache). Used by prefill, AR
decode and (K+1)-token verification.

The plan is made once per forward and reused by every layer: where each
sequence's keys are in the pool (a view when its blocks are consecutive, else
gather indices), the causal/window mask (none when nothing is masked), and
how ragged query rows are padded into a ``[B, Qmax]`` grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro_ray.algorithms.tensors import host_to
from saguaro_ray.kernels.attention_ops import contiguous_range, gather_keys, kv_slots, sdpa


@dataclass
class PagedBatch:
    """Where a ragged batch's new tokens live in the paged cache.

    ``block_tables[b]`` lists sequence b's blocks (padded with 0);
    ``context_lens[b]`` is its KV length *after* the new tokens are written;
    ``query_lens[b]`` its number of new tokens; ``slot_mapping[i]`` is the
    flat cache slot of new token i (tokens ordered sequence by sequence).
    """

    block_tables: torch.Tensor  # [B, max_blocks] int64
    context_lens: list[int]
    query_lens: list[int]
    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    block_lists: list[list[int]] | None = None  # the same tables as lists, when the caller has them


@dataclass
class PagedPlan:
    kv_slots: torch.Tensor | None  # [B, Lmax] flat cache slot (padding -> 0); None when kv_range is set
    kv_range: tuple[int, int] | None  # one sequence whose keys are contiguous in the pool: [start, end)
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, None when nothing is masked
    q_index: torch.Tensor | None  # [B, Qmax] flat token index (padding -> 0); None when every query length is equal
    q_valid: torch.Tensor | None  # [B, Qmax] bool; None when every query length is equal
    qmax: int


def plan_paged(batch: PagedBatch, window: int | None, device: torch.device) -> PagedPlan:
    """The keys, mask and query layout of ``batch`` (``window``: sliding-window length)."""
    qlens, clens = batch.query_lens, batch.context_lens
    b = len(qlens)
    qmax, lmax = max(qlens), max(clens)
    bs = batch.block_size
    kv_range = contiguous_range(batch.block_tables, batch.block_lists, lmax, bs) if b == 1 else None
    slots = None if kv_range is not None else kv_slots(batch.block_tables, lmax, bs, device)
    uniform = min(qlens) == qmax
    ar_q = torch.arange(qmax, device=device)
    q_valid = None if uniform else ar_q.unsqueeze(0) < host_to(device, qlens).unsqueeze(1)  # [B, Qmax]
    # key j is visible to query i of sequence b when j <= its own cache index
    # (and within the window); queries beyond a sequence's length are padding
    need_mask = qmax > 1 or min(clens) != lmax or (window is not None and lmax > window)
    mask = None
    if need_mask:
        key = torch.arange(lmax, device=device)
        if b == 1:
            q_cache_idx = (ar_q + (clens[0] - qlens[0])).view(1, -1, 1)
        else:
            q_cache_idx = (host_to(device, [c - n for c, n in zip(clens, qlens)]).unsqueeze(1) + ar_q).unsqueeze(-1)
        allowed = key <= q_cache_idx  # [B, Q, L]; also < clens[b] since q_cache_idx < clens[b]
        if window is not None:
            allowed &= (q_cache_idx - key) < window
        if q_valid is not None:
            allowed[:, :, 0] |= ~q_valid  # padded query rows see key 0 so softmax stays finite
        mask = allowed.unsqueeze(1)
    q_index = q_valid_t = None
    if q_valid is not None:
        starts = [0]
        for n in qlens[:-1]:
            starts.append(starts[-1] + n)
        q_index = (host_to(device, starts).unsqueeze(1) + ar_q).masked_fill(~q_valid, 0)
        q_valid_t = q_valid
    return PagedPlan(kv_slots=slots, kv_range=kv_range, mask=mask, q_index=q_index, q_valid=q_valid_t, qmax=qmax)


def attend_paged(plan: PagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] (tokens sequence by sequence); caches: [num_blocks, block_size, Hkv, D]."""
    k = gather_keys(k_cache, plan.kv_slots, plan.kv_range).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_keys(v_cache, plan.kv_slots, plan.kv_range).transpose(1, 2)
    hq, d = q.shape[-2:]
    qp = q.view(-1, plan.qmax, hq, d) if plan.q_index is None else q[plan.q_index]  # [B, Q, Hq, D]
    out = sdpa(qp.transpose(1, 2), k, v, plan.mask, scale).transpose(1, 2)  # [B, Q, Hq, D]
    return out.reshape(-1, hq, d) if plan.q_valid is None else out[plan.q_valid]
