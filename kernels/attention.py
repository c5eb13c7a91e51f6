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
    block_lists: list[list[int]] | None = None  # the same tables as lists, when the caller has them


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
    block_lists: list[list[int]] | None = None  # the same tables as lists, when the caller has them


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
    kv_slots: torch.Tensor | None  # [B, Lmax] flat cache slot (padding -> 0); None when kv_range is set
    kv_range: tuple[int, int] | None  # one sequence whose keys are contiguous in the pool: [start, end)
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, None when nothing is masked
    q_index: torch.Tensor | None  # [B, Qmax] flat token index (padding -> 0); None when every query length is equal
    q_valid: torch.Tensor | None  # [B, Qmax] bool; None when every query length is equal
    qmax: int


@dataclass
class _TorchTreePlan:
    """One masked attention per distinct prefix sequence ("group"): the keys are
    the group's prefix (gathered once) followed by the suffix rows of all its
    branches; the mask gives each branch row its own prefix limit and its own
    causal suffix. Used when the branches' suffix keys are few next to the
    prefix; otherwise ``cascade`` holds the plan for prefix/suffix attention
    merged by log-sum-exp."""

    groups: int
    rows: int  # max branches of a group
    identity: bool  # branch r is (group r // rows, slot r % rows): no gathers needed
    member: torch.Tensor | None  # [S, rows] branch of each (group, slot) (padding -> 0)
    row_group: torch.Tensor | None  # [N]
    row_slot: torch.Tensor | None  # [N]
    kv_slots: torch.Tensor | None  # [S, Lmax]; None when kv_range is set
    kv_range: tuple[int, int] | None
    mask: torch.Tensor | None  # [S, 1, rows * n_new, Lmax + rows * suffix_total]
    n_new: int
    suffix_total: int
    cascade: "_CascadeTreePlan | None" = None


@dataclass
class _CascadeTreePlan:
    row_group: torch.Tensor  # [N] group of each branch
    row_slot: torch.Tensor  # [N] position of the branch inside its group
    rows_max: int  # max branches in a group
    kv_slots: torch.Tensor  # [S, Lmax]
    prefix_allowed: torch.Tensor  # [S, 1, rows_max * n_new, Lmax]
    suffix_allowed: torch.Tensor  # [1, 1, n_new, suffix_len + n_new]
    n_new: int
    suffix_total: int


def _kv_slots(block_tables: torch.Tensor, lmax: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Flat cache slot of every key position 0..lmax-1 of each sequence: ``[B, lmax]``."""
    lmax = max(lmax, 1)
    blocks = block_tables[:, : -(-lmax // block_size)].to(device)
    slots = blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)
    return slots.view(blocks.shape[0], -1)[:, :lmax]


def _contiguous_range(block_tables: torch.Tensor, block_lists: list[list[int]] | None, length: int, block_size: int) -> tuple[int, int] | None:
    """``[start, end)`` when one sequence's first ``length`` keys sit in consecutive
    pool slots (its blocks are consecutive ids — the usual case at batch 1), so
    attention can read a view of the pool instead of gathering."""
    nblk = -(-max(length, 1) // block_size)
    blocks = block_lists[0][:nblk] if block_lists is not None else block_tables[0, :nblk].tolist()
    if len(blocks) < nblk or blocks[-1] - blocks[0] != nblk - 1 or any(b - a != 1 for a, b in zip(blocks, blocks[1:])):
        return None
    return blocks[0] * block_size, blocks[0] * block_size + length


def _gather_keys(cache: torch.Tensor, kv_slots: torch.Tensor | None, kv_range: tuple[int, int] | None) -> torch.Tensor:
    """Keys (or values) of each sequence/group from the paged pool: ``[B, L, Hkv, D]``."""
    hkv, d = cache.shape[-2:]
    flat = cache.view(-1, hkv, d)
    if kv_range is not None:
        return flat[kv_range[0] : kv_range[1]].unsqueeze(0)
    return flat[kv_slots]


class TorchBackend:
    """Portable backend: reads keys through the block table (a view when a
    sequence's blocks are consecutive), masks, and runs
    ``scaled_dot_product_attention``. Works on CPU and CUDA."""

    name = "torch"
    # the tree path attends to all of a group's suffix keys at once while
    # rows * suffix_total <= cascade_factor * prefix + cascade_slack, else cascades
    cascade_factor = 2
    cascade_slack = 256

    def plan_paged(self, batch: PagedBatch, window: int | None, device: torch.device) -> _TorchPagedPlan:
        qlens, clens = batch.query_lens, batch.context_lens
        b = len(qlens)
        qmax, lmax = max(qlens), max(clens)
        bs = batch.block_size
        kv_range = _contiguous_range(batch.block_tables, batch.block_lists, lmax, bs) if b == 1 else None
        kv_slots = None if kv_range is not None else _kv_slots(batch.block_tables, lmax, bs, device)
        uniform = min(qlens) == qmax
        # key j is visible to query i of sequence b when j <= its own cache index
        # (and within the window); queries beyond a sequence's length are padding
        need_mask = qmax > 1 or min(clens) != lmax or (window is not None and lmax > window)
        mask = None
        if need_mask:
            ar_q = torch.arange(qmax)
            key = torch.arange(lmax)
            if b == 1:
                q_cache_idx = (ar_q + (clens[0] - qlens[0])).view(1, -1, 1)
            else:
                q_cache_idx = (torch.tensor([c - n for c, n in zip(clens, qlens)]).unsqueeze(1) + ar_q).unsqueeze(-1)
            allowed = key <= q_cache_idx  # [B, Q, L]; also < clens[b] since q_cache_idx < clens[b]
            if window is not None:
                allowed &= (q_cache_idx - key) < window
            if not uniform:
                q_valid = ar_q.unsqueeze(0) < torch.tensor(qlens).unsqueeze(1)
                allowed[:, :, 0] |= ~q_valid  # padded query rows see key 0 so softmax stays finite
            mask = allowed.unsqueeze(1).to(device)
        q_index = q_valid_t = None
        if not uniform:
            ar_q = torch.arange(qmax)
            q_valid = ar_q.unsqueeze(0) < torch.tensor(qlens).unsqueeze(1)
            starts = [0]
            for n in qlens[:-1]:
                starts.append(starts[-1] + n)
            q_index = (torch.tensor(starts).unsqueeze(1) + ar_q).masked_fill(~q_valid, 0).to(device)
            q_valid_t = q_valid.to(device)
        return _TorchPagedPlan(kv_slots=kv_slots, kv_range=kv_range, mask=mask, q_index=q_index, q_valid=q_valid_t, qmax=qmax)

    def paged(self, plan: _TorchPagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]
        k = _gather_keys(k_cache, plan.kv_slots, plan.kv_range).transpose(1, 2)  # [B, Hkv, L, D]
        v = _gather_keys(v_cache, plan.kv_slots, plan.kv_range).transpose(1, 2)
        hq, d = q.shape[-2:]
        qp = q.view(-1, plan.qmax, hq, d) if plan.q_index is None else q[plan.q_index]  # [B, Q, Hq, D]
        out = _sdpa(qp.transpose(1, 2), k, v, plan.mask, scale).transpose(1, 2)  # [B, Q, Hq, D]
        return out.reshape(-1, hq, d) if plan.q_valid is None else out[plan.q_valid]

    def plan_tree(self, batch: TreeBatch, window: int | None, device: torch.device) -> _TorchTreePlan:
        n_new, sfx = batch.n_new, batch.suffix_len
        total = sfx + n_new
        groups = len(batch.block_tables)
        members: list[list[int]] = [[] for _ in range(groups)]
        for r, s in enumerate(batch.branch_seq):
            members[s].append(r)
        rows = max(len(m) for m in members)
        lmax = max(max(batch.prefix_lens), 1)
        if rows * total > self.cascade_factor * lmax + self.cascade_slack:  # suffix keys would dominate: attend per branch
            return _TorchTreePlan(
                groups, rows, False, None, None, None, None, None, None, n_new, total,
                cascade=self._plan_cascade(batch, window, device),
            )
        identity = all(len(m) == rows for m in members) and all(
            r == g * rows + i for g, m in enumerate(members) for i, r in enumerate(m)
        )
        limits = torch.tensor([[batch.prefix_lens[r] for r in m] + [0] * (rows - len(m)) for m in members])  # [S, rows]
        kv_range = _contiguous_range(batch.block_tables, batch.block_lists, lmax, batch.block_size) if groups == 1 else None
        kv_slots = None if kv_range is not None else _kv_slots(batch.block_tables, lmax, batch.block_size, device)
        key = torch.arange(lmax)
        lim = limits.view(groups, rows, 1, 1)
        prefix = key < lim  # [S, rows, 1, L]
        qj = torch.arange(n_new).view(1, 1, -1, 1)
        if window is not None:
            prefix = prefix & ((lim + sfx + qj - key) < window)
        prefix = prefix.expand(groups, rows, n_new, lmax)
        # suffix key (slot b, i) is visible to row (slot a, j) iff b == a and i <= sfx + j (within the window)
        ki = torch.arange(total)
        own = ki <= sfx + qj.view(-1, 1)  # [n_new, total]
        if window is not None:
            own &= (sfx + qj.view(-1, 1) - ki) < window
        suffix = torch.eye(rows, dtype=torch.bool).view(rows, 1, rows, 1) & own.view(1, n_new, 1, total)
        suffix = suffix.reshape(1, rows, n_new, rows * total).expand(groups, rows, n_new, rows * total)
        mask = torch.cat([prefix, suffix], dim=-1).view(groups, 1, rows * n_new, lmax + rows * total)
        member = row_group = row_slot = None
        if not identity:
            member = torch.tensor([m + [0] * (rows - len(m)) for m in members], device=device)
            row_group = torch.tensor(batch.branch_seq, device=device)
            row_slot = torch.tensor([members[s].index(r) for r, s in enumerate(batch.branch_seq)], device=device)
        return _TorchTreePlan(
            groups=groups,
            rows=rows,
            identity=identity,
            member=member,
            row_group=row_group,
            row_slot=row_slot,
            kv_slots=kv_slots,
            kv_range=kv_range,
            mask=mask.to(device),
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
        if plan.cascade is not None:
            return self._tree_cascade(plan.cascade, q, k_cache, v_cache, k_scratch, v_scratch, scale)
        n_new, total, g, rows = plan.n_new, plan.suffix_total, plan.groups, plan.rows
        hq, d = q.shape[-2:]
        hkv = k_cache.shape[-2]
        nb = q.shape[0] // n_new
        if plan.identity:
            qg = q.view(g, rows * n_new, hq, d)
        else:
            qg = q.view(nb, n_new, hq, d)[plan.member].view(g, rows * n_new, hq, d)

        def keys(cache: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
            own = scratch[:nb, :total]
            if not plan.identity:
                own = own[plan.member]
            own = own.reshape(g, rows * total, hkv, d)
            return torch.cat([_gather_keys(cache, plan.kv_slots, plan.kv_range), own], dim=1).transpose(1, 2)

        out = _sdpa(qg.transpose(1, 2), keys(k_cache, k_scratch), keys(v_cache, v_scratch), plan.mask, scale)
        out = out.transpose(1, 2)  # [S, rows * n_new, Hq, D]
        if plan.identity:
            return out.reshape(nb * n_new, hq, d)
        return out.reshape(g, rows, n_new, hq, d)[plan.row_group, plan.row_slot].reshape(nb * n_new, hq, d)

    # -- cascade form: shared prefix and per-branch suffix attended separately, merged by LSE
    def _plan_cascade(self, batch: TreeBatch, window: int | None, device: torch.device) -> _CascadeTreePlan:
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
        lmax = max(max(batch.prefix_lens), 1)
        kv_slots = _kv_slots(batch.block_tables, lmax, batch.block_size, device)
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
        return _CascadeTreePlan(
            row_group=torch.tensor(batch.branch_seq, device=device),
            row_slot=torch.tensor(row_slot, device=device),
            rows_max=rows_max,
            kv_slots=kv_slots,
            prefix_allowed=prefix_allowed.to(device),
            suffix_allowed=suffix_allowed.view(1, 1, n_new, total).to(device),
            n_new=n_new,
            suffix_total=total,
        )

    def _tree_cascade(
        self,
        plan: _CascadeTreePlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scratch: torch.Tensor,
        v_scratch: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
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
