"""Attention backends over a paged KV cache.

Two kinds of attention calls exist in the engine:

* **paged** — a ragged batch of sequences, each bringing ``n_b >= 1`` new
  query tokens, attending causally to its own KV (prompt, earlier tokens and
  the new tokens, already written to the cache). Used by prefill, AR decode
  and (K+1)-token verification.
* **tree** — ``N`` branch rows that share one sequence's prefix KV (each up to
  its own key-length limit) and own a short per-branch suffix in a scratch
  buffer. Attention over the shared prefix and over the suffix is computed
  separately and merged by log-sum-exp ("cascade" attention), so the prefix is
  never copied per branch.

A backend turns the batch description into a *plan* once per forward (masks,
gather indices) and every layer reuses it. ``TorchBackend`` runs anywhere
(CPU and CUDA, via ``scaled_dot_product_attention``); ``FlashAttnBackend`` is
chosen automatically on CUDA when ``flash_attn`` imports.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from saguaro_ray.errors import ConfigError

log = logging.getLogger(__name__)


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


@dataclass
class TreeBatch:
    """A shared-prefix tree decode step.

    Branch r continues sequence ``branch_seq[r]`` (an index into
    ``block_tables``) after its first ``prefix_lens[r]`` cached tokens, then
    its own suffix: ``suffix_len`` tokens already in the scratch buffer plus
    ``n_new`` new ones (the same for every branch in a step).
    """

    block_tables: torch.Tensor  # [S, max_blocks] for the distinct prefix sequences
    branch_seq: list[int]  # [N] index into block_tables
    prefix_lens: list[int]  # [N]
    suffix_len: int
    n_new: int
    block_size: int


class AttentionBackend(Protocol):
    name: str

    def plan_paged(self, batch: PagedBatch, window: int | None, device: torch.device) -> object: ...

    def paged(self, plan: object, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor: ...

    def plan_tree(self, batch: TreeBatch, window: int | None, device: torch.device) -> object: ...

    def tree(
        self,
        plan: object,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scratch: torch.Tensor,
        v_scratch: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


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


@dataclass
class _TorchPagedPlan:
    q_index: torch.Tensor  # [B, Qmax] flat token index (padding -> 0)
    q_valid: torch.Tensor  # [B, Qmax] bool
    kv_slots: torch.Tensor  # [B, Lmax] flat cache slot (padding -> 0)
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, None when nothing is masked
    single: bool  # one sequence, no padding: skip the gather/scatter of queries


@dataclass
class _TorchTreePlan:
    # prefix part, grouped by distinct prefix sequence
    row_group: torch.Tensor  # [N] group of each branch
    row_slot: torch.Tensor  # [N] position of the branch inside its group
    rows_max: int  # max branches in a group
    kv_slots: torch.Tensor  # [S, Lmax]
    prefix_allowed: torch.Tensor  # [S, 1, rows_max * n_new, Lmax]
    # suffix part
    suffix_allowed: torch.Tensor  # [1, 1, n_new, suffix_len + n_new]
    n_new: int
    suffix_total: int


def _kv_slots(block_tables: torch.Tensor, lengths: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    """Flat cache slot of every key position 0..max(lengths)-1 of each sequence."""
    lmax = max(max(lengths), 1)
    pos = torch.arange(lmax, device=device)
    blocks = block_tables[:, : (lmax + block_size - 1) // block_size].to(device)
    slots = blocks.repeat_interleave(block_size, dim=1)[:, :lmax] * block_size + (pos % block_size)
    return slots


class TorchBackend:
    """Portable backend: gathers keys through the block table, masks, and runs
    ``scaled_dot_product_attention`` (paged) or an explicit softmax with
    log-sum-exp (tree). Works on CPU and CUDA."""

    name = "torch"

    def plan_paged(self, batch: PagedBatch, window: int | None, device: torch.device) -> _TorchPagedPlan:
        qlens, clens = batch.query_lens, batch.context_lens
        b = len(qlens)
        qmax, lmax = max(qlens), max(clens)
        starts = [0]
        for n in qlens[:-1]:
            starts.append(starts[-1] + n)
        ar_q = torch.arange(qmax)
        q_valid = ar_q.unsqueeze(0) < torch.tensor(qlens).unsqueeze(1)
        q_index = (torch.tensor(starts).unsqueeze(1) + ar_q.unsqueeze(0)).masked_fill(~q_valid, 0)
        kv_slots = _kv_slots(batch.block_tables, clens, batch.block_size, device)
        # key j is visible to query i of sequence b when j <= its own cache index
        q_cache_idx = torch.tensor([c - n for c, n in zip(clens, qlens)]).unsqueeze(1) + ar_q.unsqueeze(0)
        key = torch.arange(lmax)
        allowed = key.view(1, 1, -1) <= q_cache_idx.unsqueeze(-1)
        allowed &= key.view(1, 1, -1) < torch.tensor(clens).view(b, 1, 1)
        if window is not None:
            allowed &= (q_cache_idx.unsqueeze(-1) - key.view(1, 1, -1)) < window
        allowed[:, :, 0] |= ~q_valid  # padded query rows see key 0 so softmax stays finite
        single = b == 1
        need_mask = not bool(allowed.all())
        return _TorchPagedPlan(
            q_index=q_index.to(device),
            q_valid=q_valid.to(device),
            kv_slots=kv_slots,
            mask=allowed.unsqueeze(1).to(device) if need_mask else None,
            single=single,
        )

    def paged(self, plan: _TorchPagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]
        hkv, d = k_cache.shape[-2:]
        kf = k_cache.view(-1, hkv, d)
        vf = v_cache.view(-1, hkv, d)
        k = kf[plan.kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
        v = vf[plan.kv_slots].transpose(1, 2)
        qp = q.unsqueeze(0) if plan.single else q[plan.q_index]  # [B, Q, Hq, D]
        qp = qp.transpose(1, 2)
        out = _sdpa(qp, k, v, plan.mask, scale)  # [B, Hq, Q, D]
        out = out.transpose(1, 2)
        return out[0] if plan.single else out[plan.q_valid]

    def plan_tree(self, batch: TreeBatch, window: int | None, device: torch.device) -> _TorchTreePlan:
        n_new, sfx = batch.n_new, batch.suffix_len
        groups = len(batch.block_tables)
        counts = [0] * groups
        row_slot = []
        for s in batch.branch_seq:
            row_slot.append(counts[s])
            counts[s] += 1
        rows_max = max(counts)
        # prefix length limit of every (group, row) — padded rows see nothing
        limits = torch.zeros(groups, rows_max, dtype=torch.long)
        for r, (s, slot) in enumerate(zip(batch.branch_seq, row_slot)):
            limits[s, slot] = batch.prefix_lens[r]
        group_lens = limits.max(dim=1).values.tolist()
        kv_slots = _kv_slots(batch.block_tables, group_lens, batch.block_size, device)
        lmax = kv_slots.shape[1]
        key = torch.arange(lmax)
        allowed = key.view(1, 1, 1, -1) < limits.view(groups, rows_max, 1, 1)  # [S, rows, 1, L]
        allowed = allowed.expand(groups, rows_max, n_new, lmax)
        if window is not None:
            q_abs = limits.view(groups, rows_max, 1) + sfx + torch.arange(n_new).view(1, 1, -1)
            allowed = allowed & ((q_abs.unsqueeze(-1) - key.view(1, 1, 1, -1)) < window)
        prefix_allowed = allowed.reshape(groups, 1, rows_max * n_new, lmax)
        total = sfx + n_new
        qi = sfx + torch.arange(n_new).view(-1, 1)
        kj = torch.arange(total).view(1, -1)
        suffix_allowed = kj <= qi
        if window is not None:
            suffix_allowed &= (qi - kj) < window
        return _TorchTreePlan(
            row_group=torch.tensor(batch.branch_seq, device=device),
            row_slot=torch.tensor(row_slot, device=device),
            rows_max=rows_max,
            kv_slots=kv_slots,
            prefix_allowed=prefix_allowed.to(device),
            suffix_allowed=suffix_allowed.view(1, 1, n_new, total).to(device),
            n_new=n_new,
            suffix_total=total,
        )

    def tree(
        self,
        plan: _TorchTreePlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scratch: torch.Tensor,
        v_scratch: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        # q: [N * n_new, Hq, D] (branch-major); scratch: [N_cap, S_cap, Hkv, D]
        n_new = plan.n_new
        hq, d = q.shape[-2:]
        hkv = k_cache.shape[-2]
        nb = q.shape[0] // n_new
        qb = q.view(nb, n_new, hq, d)
        # -- shared prefix: one gather per distinct sequence, all its branches' rows at once
        groups = plan.kv_slots.shape[0]
        qg = q.new_zeros(groups, plan.rows_max, n_new, hq, d)
        qg[plan.row_group, plan.row_slot] = qb
        qg = qg.view(groups, plan.rows_max * n_new, hq, d).transpose(1, 2)
        kf = k_cache.view(-1, hkv, d)
        vf = v_cache.view(-1, hkv, d)
        kp = kf[plan.kv_slots].transpose(1, 2)
        vp = vf[plan.kv_slots].transpose(1, 2)
        out_p, lse_p = attention_with_lse(qg, kp, vp, plan.prefix_allowed, scale)
        out_p = out_p.transpose(1, 2).reshape(groups, plan.rows_max, n_new, hq, d)[plan.row_group, plan.row_slot]
        lse_p = lse_p.transpose(1, 2).reshape(groups, plan.rows_max, n_new, hq)[plan.row_group, plan.row_slot]
        # -- per-branch suffix (causal inside the branch)
        ks = k_scratch[:nb, : plan.suffix_total].transpose(1, 2)
        vs = v_scratch[:nb, : plan.suffix_total].transpose(1, 2)
        out_s, lse_s = attention_with_lse(qb.transpose(1, 2), ks, vs, plan.suffix_allowed.expand(nb, 1, -1, -1), scale)
        out = merge_by_lse(out_p, lse_p, out_s.transpose(1, 2), lse_s.transpose(1, 2))
        return out.reshape(nb * n_new, hq, d)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class FlashAttnBackend(TorchBackend):
    """flash-attn on CUDA for the paged path (block tables passed straight to
    the kernel, causal mask aligned bottom-right as verification needs). The
    tree path is inherited from ``TorchBackend`` (gather + explicit softmax
    with log-sum-exp), which runs unchanged on CUDA.

    flash-attn's paged kernels need a block size that is a multiple of 256;
    ``ModelRunner`` picks that block size when this backend is selected.
    """

    name = "flash_attn"
    required_block_size = 256

    def __init__(self) -> None:
        import flash_attn  # noqa: F401  (raises ImportError when absent)
        from flash_attn import flash_attn_with_kvcache

        self._with_kvcache = flash_attn_with_kvcache

    def plan_paged(self, batch: PagedBatch, window: int | None, device: torch.device) -> dict:
        return {
            "block_tables": batch.block_tables.to(device=device, dtype=torch.int32),
            "context_lens": torch.tensor(batch.context_lens, dtype=torch.int32, device=device),
            "query_lens": batch.query_lens,
            "window": (-1, -1) if window is None else (window - 1, 0),
        }

    def paged(self, plan: dict, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # Sequences with different query lengths are run per distinct length so
        # the kernel's bottom-right causal alignment stays per sequence.
        qlens = plan["query_lens"]
        out = torch.empty_like(q)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        for n in sorted(set(qlens)):
            idx = [b for b, m in enumerate(qlens) if m == n]
            rows = torch.cat([torch.arange(starts[b], starts[b] + n) for b in idx]).to(q.device)
            qb = q[rows].view(len(idx), n, *q.shape[1:])
            sel = torch.tensor(idx, device=q.device)
            o = self._with_kvcache(
                qb,
                k_cache,
                v_cache,
                cache_seqlens=plan["context_lens"][sel],
                block_table=plan["block_tables"][sel],
                softmax_scale=scale,
                causal=True,
                window_size=plan["window"],
            )
            out[rows] = o.reshape(-1, *q.shape[1:])
        return out


def select_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """Pick an attention backend: ``None``/``"auto"`` → flash-attn on CUDA when
    importable, else torch; ``"torch"``/``"sdpa"`` or ``"flash_attn"`` force one."""
    if name in (None, "auto"):
        if device.type == "cuda":
            try:
                return FlashAttnBackend()
            except ImportError:
                log.info("flash-attn not importable; using torch SDPA attention")
        return TorchBackend()
    if name in ("torch", "sdpa"):
        return TorchBackend()
    if name in ("flash_attn", "flash-attn"):
        if device.type != "cuda":
            raise ConfigError("attention backend 'flash_attn' needs a CUDA device; use 'torch' on CPU")
        return FlashAttnBackend()
    raise ConfigError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'flash_attn'")


__all__ = [
    "AttentionBackend",
    "FlashAttnBackend",
    "PagedBatch",
    "TorchBackend",
    "TreeBatch",
    "attention_with_lse",
    "merge_by_lse",
    "select_backend",
]
