"""Tree attention in portable torch: ``N`` branch rows share one sequence's
prefix KV (each up to its own key-length limit) and own a short per-branch
suffix in a scratch buffer, so a draft can extend many candidate branches in
one forward without copying the prefix per branch.

A step is planned in one of two forms:

* **joint** — one masked attention per distinct prefix sequence ("group"):
  the keys are the group's prefix (read once) followed by the suffix rows of
  all its branches; the mask gives each branch row its own prefix limit and
  its own causal suffix. Cheapest while the branches' suffix keys are few next
  to the prefix.
* **cascade** — the shared prefix and each branch's suffix are attended
  separately and merged by log-sum-exp, so no branch row pays for the other
  branches' suffix keys. Chosen once ``rows * suffix`` outgrows the prefix.

Both forms compute the same attention (``tests/test_fast_paths.py``).

A third, **static** form is what a CUDA graph of a one-token tree step records
(:mod:`saguaro_ray.workers.graphs`): every branch row gathers its own prefix
up to a fixed key bucket and reads its whole scratch row; which keys count is
data (each row's prefix length, the suffix length) turned into the mask on the
device, so nothing of the step's shape changes from step to step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro_ray.algorithms.tensors import host_to
from saguaro_ray.kernels.attention_ops import attention_with_lse, contiguous_range, gather_keys, kv_slots, merge_by_lse, sdpa


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


@dataclass
class JointTreePlan:
    groups: int
    rows: int  # max branches of a group
    identity: bool  # branch r is (group r // rows, slot r % rows): no gathers needed
    member: torch.Tensor | None  # [S, rows] branch of each (group, slot) (padding -> 0)
    row_group: torch.Tensor | None  # [N]
    row_slot: torch.Tensor | None  # [N]
    kv_slots: torch.Tensor | None  # [S, Lmax]; None when kv_range is set
    kv_range: tuple[int, int] | None
    mask: torch.Tensor  # [S, 1, rows * n_new, Lmax + rows * suffix_total]
    n_new: int
    suffix_total: int


@dataclass
class CascadeTreePlan:
    row_group: torch.Tensor  # [N] group of each branch
    row_slot: torch.Tensor  # [N] position of the branch inside its group
    rows_max: int  # max branches in a group
    kv_slots: torch.Tensor  # [S, Lmax]
    prefix_allowed: torch.Tensor  # [S, 1, rows_max * n_new, Lmax]
    suffix_allowed: torch.Tensor  # [1, 1, n_new, suffix_len + n_new]
    n_new: int
    suffix_total: int


@dataclass
class StaticTreePlan:
    """One new token per branch row, every shape fixed: row r attends to its
    prefix keys ``kv_slots[r]`` where ``prefix_ok`` and to its scratch row where
    ``suffix_ok`` (the suffix already there plus the token being written)."""

    kv_slots: torch.Tensor  # [N, L] flat cache slot of each prefix key
    mask: torch.Tensor  # [N, 1, 1, L + S_cap] bool: prefix keys, then the scratch row's
    suffix_cap: int  # S_cap: the scratch depth every row reads


@dataclass
class TreePlan:
    """A tree step's plan: exactly one of the forms is set."""

    joint: JointTreePlan | None = None
    cascade: CascadeTreePlan | None = None
    static: StaticTreePlan | None = None


def plan_tree(batch: TreeBatch, window: int | None, device: torch.device, cascade_factor: float, cascade_slack: int) -> TreePlan:
    """The joint form while ``rows * suffix <= cascade_factor * prefix + cascade_slack``, else the cascade."""
    rows = max(batch.branch_seq.count(s) for s in range(len(batch.block_tables)))
    prefix = max(max(batch.prefix_lens), 1)
    if rows * (batch.suffix_len + batch.n_new) > cascade_factor * prefix + cascade_slack:
        return TreePlan(cascade=_plan_cascade(batch, window, device))
    return TreePlan(joint=_plan_joint(batch, window, device))


def attend_tree(
    plan: TreePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k_scratch: torch.Tensor, v_scratch: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q: [N * n_new, Hq, D] (branch-major); caches: [num_blocks, block_size, Hkv, D];
    scratch: [N_cap, S_cap, Hkv, D] (branch r's suffix in row r)."""
    if plan.cascade is not None:
        return _attend_cascade(plan.cascade, q, (k_cache, v_cache), (k_scratch, v_scratch), scale)
    if plan.static is not None:
        return _attend_static(plan.static, q, (k_cache, v_cache), (k_scratch, v_scratch), scale)
    return _attend_joint(plan.joint, q, (k_cache, v_cache), (k_scratch, v_scratch), scale)


def plan_static_tree(
    table: torch.Tensor, prefix_lens: torch.Tensor, suffix_len: torch.Tensor, block_size: int, suffix_cap: int, window: int | None
) -> StaticTreePlan:
    """The static form from device tensors only: ``table [N, L / block_size]``
    (each row's sequence's blocks), ``prefix_lens [N]``, ``suffix_len [1]``
    (tokens already in every row's scratch; the new token goes at that index)."""
    n, width = table.shape
    dev = table.device
    slots = (table.unsqueeze(-1) * block_size + torch.arange(block_size, device=dev)).view(n, width * block_size)
    key = torch.arange(width * block_size, device=dev)
    prefix_ok = key.unsqueeze(0) < prefix_lens.unsqueeze(1)  # [N, L]
    own = torch.arange(suffix_cap, device=dev)
    suffix_ok = (own <= suffix_len).unsqueeze(0).expand(n, suffix_cap)  # [N, S_cap]
    if window is not None:
        q_abs = (prefix_lens + suffix_len).unsqueeze(1)  # the new token's position
        prefix_ok = prefix_ok & ((q_abs - key.unsqueeze(0)) < window)
        suffix_ok = suffix_ok & ((suffix_len - own) < window).unsqueeze(0)
    mask = torch.cat([prefix_ok, suffix_ok], dim=-1).view(n, 1, 1, -1)
    return StaticTreePlan(kv_slots=slots, mask=mask, suffix_cap=suffix_cap)


def _attend_static(
    plan: StaticTreePlan, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], scratches: tuple[torch.Tensor, torch.Tensor], scale: float
) -> torch.Tensor:
    """q: [N, Hq, D] (one token per row) -> [N, Hq, D]."""
    n = q.shape[0]

    def keys(cache: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        return torch.cat([gather_keys(cache, plan.kv_slots, None), scratch[:n, : plan.suffix_cap]], dim=1).transpose(1, 2)

    k, v = (keys(cache, scratch) for cache, scratch in zip(caches, scratches))
    return sdpa(q.unsqueeze(2), k, v, plan.mask, scale).squeeze(2)


# -- joint form: one masked attention over a group's prefix and all its branches' suffixes
def _plan_joint(batch: TreeBatch, window: int | None, device: torch.device) -> JointTreePlan:
    n_new, sfx = batch.n_new, batch.suffix_len
    total = sfx + n_new
    groups = len(batch.block_tables)
    members: list[list[int]] = [[] for _ in range(groups)]
    for r, s in enumerate(batch.branch_seq):
        members[s].append(r)
    rows = max(len(m) for m in members)
    lmax = max(max(batch.prefix_lens), 1)
    identity = all(len(m) == rows for m in members) and all(
        r == g * rows + i for g, m in enumerate(members) for i, r in enumerate(m)
    )
    limits = host_to(device, [[batch.prefix_lens[r] for r in m] + [0] * (rows - len(m)) for m in members])  # [S, rows]
    kv_range = contiguous_range(batch.block_tables, batch.block_lists, lmax, batch.block_size) if groups == 1 else None
    slots = None if kv_range is not None else kv_slots(batch.block_tables, lmax, batch.block_size, device)
    key = torch.arange(lmax, device=device)
    lim = limits.view(groups, rows, 1, 1)
    prefix = key < lim  # [S, rows, 1, L]
    qj = torch.arange(n_new, device=device).view(1, 1, -1, 1)
    if window is not None:
        prefix = prefix & ((lim + sfx + qj - key) < window)
    prefix = prefix.expand(groups, rows, n_new, lmax)
    # suffix key (slot b, i) is visible to row (slot a, j) iff b == a and i <= sfx + j (within the window)
    ki = torch.arange(total, device=device)
    own = ki <= sfx + qj.view(-1, 1)  # [n_new, total]
    if window is not None:
        own &= (sfx + qj.view(-1, 1) - ki) < window
    suffix = torch.eye(rows, dtype=torch.bool, device=device).view(rows, 1, rows, 1) & own.view(1, n_new, 1, total)
    suffix = suffix.reshape(1, rows, n_new, rows * total).expand(groups, rows, n_new, rows * total)
    mask = torch.cat([prefix, suffix], dim=-1).view(groups, 1, rows * n_new, lmax + rows * total)
    member = row_group = row_slot = None
    if not identity:
        member = host_to(device, [m + [0] * (rows - len(m)) for m in members])
        row_group = host_to(device, batch.branch_seq)
        row_slot = host_to(device, [members[s].index(r) for r, s in enumerate(batch.branch_seq)])
    return JointTreePlan(
        groups=groups, rows=rows, identity=identity, member=member, row_group=row_group, row_slot=row_slot,
        kv_slots=slots, kv_range=kv_range, mask=mask, n_new=n_new, suffix_total=total,
    )


def _attend_joint(
    plan: JointTreePlan, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], scratches: tuple[torch.Tensor, torch.Tensor], scale: float
) -> torch.Tensor:
    n_new, total, g, rows = plan.n_new, plan.suffix_total, plan.groups, plan.rows
    hq, d = q.shape[-2:]
    hkv = caches[0].shape[-2]
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
        return torch.cat([gather_keys(cache, plan.kv_slots, plan.kv_range), own], dim=1).transpose(1, 2)

    k, v = (keys(cache, scratch) for cache, scratch in zip(caches, scratches))
    out = sdpa(qg.transpose(1, 2), k, v, plan.mask, scale).transpose(1, 2)  # [S, rows * n_new, Hq, D]
    if plan.identity:
        return out.reshape(nb * n_new, hq, d)
    return out.reshape(g, rows, n_new, hq, d)[plan.row_group, plan.row_slot].reshape(nb * n_new, hq, d)


# -- cascade form: shared prefix and per-branch suffix attended separately, merged by LSE
def _plan_cascade(batch: TreeBatch, window: int | None, device: torch.device) -> CascadeTreePlan:
    n_new, sfx = batch.n_new, batch.suffix_len
    groups = len(batch.block_tables)
    counts = [0] * groups
    row_slot = []
    for s in batch.branch_seq:
        row_slot.append(counts[s])
        counts[s] += 1
    rows_max = max(counts)
    # prefix length limit of every (group, row) — padded rows see nothing
    limit_rows = [[0] * rows_max for _ in range(groups)]
    for r, (s, slot) in enumerate(zip(batch.branch_seq, row_slot)):
        limit_rows[s][slot] = batch.prefix_lens[r]
    limits = host_to(device, limit_rows)
    lmax = max(max(batch.prefix_lens), 1)
    slots = kv_slots(batch.block_tables, lmax, batch.block_size, device)
    key = torch.arange(lmax, device=device)
    allowed = key.view(1, 1, 1, -1) < limits.view(groups, rows_max, 1, 1)  # [S, rows, 1, L]
    allowed = allowed.expand(groups, rows_max, n_new, lmax)
    if window is not None:
        q_abs = limits.view(groups, rows_max, 1) + sfx + torch.arange(n_new, device=device).view(1, 1, -1)
        allowed = allowed & ((q_abs.unsqueeze(-1) - key.view(1, 1, 1, -1)) < window)
    prefix_allowed = allowed.reshape(groups, 1, rows_max * n_new, lmax)
    total = sfx + n_new
    qi = sfx + torch.arange(n_new, device=device).view(-1, 1)
    kj = torch.arange(total, device=device).view(1, -1)
    suffix_allowed = kj <= qi
    if window is not None:
        suffix_allowed &= (qi - kj) < window
    return CascadeTreePlan(
        row_group=host_to(device, batch.branch_seq), row_slot=host_to(device, row_slot),
        rows_max=rows_max, kv_slots=slots, prefix_allowed=prefix_allowed,
        suffix_allowed=suffix_allowed.view(1, 1, n_new, total), n_new=n_new, suffix_total=total,
    )


def _attend_cascade(
    plan: CascadeTreePlan, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], scratches: tuple[torch.Tensor, torch.Tensor], scale: float
) -> torch.Tensor:
    n_new = plan.n_new
    hq, d = q.shape[-2:]
    nb = q.shape[0] // n_new
    qb = q.view(nb, n_new, hq, d)
    # -- shared prefix: one gather per distinct sequence, all its branches' rows at once
    groups = plan.kv_slots.shape[0]
    qg = q.new_zeros(groups, plan.rows_max, n_new, hq, d)
    qg[plan.row_group, plan.row_slot] = qb
    qg = qg.view(groups, plan.rows_max * n_new, hq, d).transpose(1, 2)
    kp, vp = (gather_keys(cache, plan.kv_slots, None).transpose(1, 2) for cache in caches)
    out_p, lse_p = attention_with_lse(qg, kp, vp, plan.prefix_allowed, scale)
    out_p = out_p.transpose(1, 2).reshape(groups, plan.rows_max, n_new, hq, d)[plan.row_group, plan.row_slot]
    lse_p = lse_p.transpose(1, 2).reshape(groups, plan.rows_max, n_new, hq)[plan.row_group, plan.row_slot]
    # -- per-branch suffix (causal inside the branch)
    ks, vs = (scratch[:nb, : plan.suffix_total].transpose(1, 2) for scratch in scratches)
    out_s, lse_s = attention_with_lse(qb.transpose(1, 2), ks, vs, plan.suffix_allowed.expand(nb, 1, -1, -1), scale)
    out = merge_by_lse(out_p, lse_p, out_s.transpose(1, 2), lse_s.transpose(1, 2))
    return out.reshape(nb * n_new, hq, d)
