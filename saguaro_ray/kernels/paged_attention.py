"""Paged attention in portable torch: a ragged batch of sequences, each bringing
``n_b >= 1`` new query tokens, attends causally to its own KV (prompt, earlier
tokens and the new tokens, already written to the cache). Used by prefill, AR
decode and (K+1)-token verification.

The plan is made once per forward and reused by every layer: where each
sequence's keys are in the pool (a view when its blocks are consecutive, else
gather indices) and how the queries are cut into attention calls.

**Row invariance.** A query row of a decode or verification step is attended
alone, over exactly the keys it sees (no mask): torch's attention kernels
round a row differently depending on how many rows and which mask come with
it (bf16 by up to 2e-3 per call, fp32 by ~1e-7), and that compounds to logits
that differ by up to 0.25 between AR's one-token step and the same position
inside a (K+1)-token verification, enough to flip a near-tie at T = 0. Cut
this way a position's output is the same whatever the step, the batch or the
strategy around it. Only a sequence bringing more than
:data:`ROW_WISE_MAX_QUERY` tokens (a prefill) is attended in one causal call.
The CUDA graphs' static steps (:mod:`saguaro_ray.workers.graphs`) pass a
batched plan with a mask instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


# a sequence bringing more new tokens than this (a prefill) is attended in one causal call
ROW_WISE_MAX_QUERY = 32


@dataclass(frozen=True)
class Piece:
    """One attention call of a step: query tokens ``[start, start + rows)`` (flat)
    of sequence ``seq`` over its keys ``[key_lo, key_hi)``; ``mask`` [1, 1, rows,
    key_hi - key_lo] for a multi-row piece (causal, window), else ``None``."""

    seq: int
    start: int
    rows: int
    key_lo: int
    key_hi: int
    mask: torch.Tensor | None = None


@dataclass
class PagedPlan:
    kv_slots: torch.Tensor | None  # [B, Lmax] flat cache slot (padding -> 0); None when kv_range is set
    kv_range: tuple[int, int] | None  # one sequence whose keys are contiguous in the pool: [start, end)
    mask: torch.Tensor | None  # batched form: [B, 1, Qmax, Lmax] bool, None when nothing is masked
    q_index: torch.Tensor | None  # batched form: [B, Qmax] flat token index; None when every query length is equal
    q_valid: torch.Tensor | None  # batched form: [B, Qmax] bool; None when every query length is equal
    qmax: int
    pieces: list[Piece] | None = None  # row-invariant form (see the module docstring); None: the batched form


def plan_paged(batch: PagedBatch, window: int | None, device: torch.device) -> PagedPlan:
    """The keys of ``batch`` and its cut into row-invariant attention calls (``window``: sliding-window length)."""
    qlens, clens = batch.query_lens, batch.context_lens
    b = len(qlens)
    lmax = max(clens)
    bs = batch.block_size
    kv_range = contiguous_range(batch.block_tables, batch.block_lists, lmax, bs) if b == 1 else None
    slots = None if kv_range is not None else kv_slots(batch.block_tables, lmax, bs, device)
    pieces: list[Piece] = []
    start = 0
    for seq, (n, ctx) in enumerate(zip(qlens, clens)):
        if n <= ROW_WISE_MAX_QUERY:
            for i in range(n):
                hi = ctx - n + i + 1  # the row's own cache index + 1
                pieces.append(Piece(seq, start + i, 1, 0 if window is None else max(0, hi - window), hi))
        else:
            pieces.append(_prefill_piece(seq, start, n, ctx, window, device))
        start += n
    return PagedPlan(kv_slots=slots, kv_range=kv_range, mask=None, q_index=None, q_valid=None, qmax=max(qlens), pieces=pieces)


def _prefill_piece(seq: int, start: int, n: int, ctx: int, window: int | None, device: torch.device) -> Piece:
    """A long query (a prefill) in one call: causal over its keys, and within the window."""
    lo = 0 if window is None else max(0, ctx - n + 1 - window)
    key = torch.arange(lo, ctx, device=device)
    q_cache_idx = torch.arange(ctx - n, ctx, device=device).unsqueeze(-1)
    allowed = key <= q_cache_idx
    if window is not None:
        allowed &= (q_cache_idx - key) < window
    return Piece(seq, start, n, lo, ctx, allowed.view(1, 1, n, ctx - lo))


def attend_paged(plan: PagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] (tokens sequence by sequence); caches: [num_blocks, block_size, Hkv, D]."""
    k = gather_keys(k_cache, plan.kv_slots, plan.kv_range)  # [B, L, Hkv, D]
    v = gather_keys(v_cache, plan.kv_slots, plan.kv_range)
    hq, d = q.shape[-2:]
    if plan.pieces is not None:
        dtype = q.dtype
        if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            # torch's CPU half-precision attention costs ~0.8 ms a lone row (1.5B
            # shapes, 260 keys) against ~0.1 ms in fp32: rows are attended in fp32
            q, k, v = q.float(), k.float(), v.float()
        outs = []
        for p in plan.pieces:
            qp = q[p.start : p.start + p.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kp = k[p.seq, p.key_lo : p.key_hi].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vp = v[p.seq, p.key_lo : p.key_hi].transpose(0, 1).unsqueeze(0)
            outs.append(sdpa(qp, kp, vp, p.mask, scale)[0].transpose(0, 1))  # [n, Hq, D]
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).to(dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
    qp = q.view(-1, plan.qmax, hq, d) if plan.q_index is None else q[plan.q_index]  # [B, Q, Hq, D]
    out = sdpa(qp.transpose(1, 2), k, v, plan.mask, scale).transpose(1, 2)  # [B, Q, Hq, D]
    return out.reshape(-1, hq, d) if plan.q_valid is None else out[plan.q_valid]
