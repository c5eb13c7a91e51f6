"""The SSD protocol: what each draft call of an SSD round carries, and how its answers are read.

One home for the rules the round loop and the drafts must agree on. A round
of SSD (see ``saguaro_ray.engine.strategies.ssd``) sends every draft that
is up a *build* — its share of the speculations for the likely outcomes of
the proposal being verified — and, once the outcomes are known, a *lookup*
with them. With one draft the lookup also carries each sequence's
:class:`NextRound`, made from the round loop's state once the outcome is
emitted: the draft serves a miss's backup from it (:func:`miss_backup`, or a
neural draft from its step) and, with every next proposal known, starts the
next round's build itself; the items of that build are
:func:`next_build_item` of the plan and the proposal the lookup served — the
same function the round loop calls for the build call it sends next, so the
two are equal by construction and the call only says so (``ahead``). The
drafts keep no copy of the coordinator's state and derive nothing. Plain
functions over the worker messages — no transport, no models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from saguaro_ray.workers.messages import BuildItem, Extension, LookupResult, NextRound, Proposal, ProposalSource, SeqStep


def clip(p: Proposal, n: int) -> Proposal:
    """``p`` cut to the ``n`` tokens still worth verifying (a cached
    speculation may be longer than what is left before a length limit)."""
    if len(p.tokens) <= n:
        return p
    return Proposal(p.tokens[:n], None if p.q is None else p.q[:n], p.source)


def build_items(
    steps: Sequence[SeqStep],
    proposals: Sequence[Proposal],
    fanouts: Sequence[list[int]],
    ks: Sequence[int],
    saguaro_c: float,
    shard: int,
    num_shards: int,
    deltas: Sequence[Extension | None],
) -> list[BuildItem]:
    """The build one draft (``shard`` of ``num_shards``) runs while the target
    verifies ``proposals``: per sequence its step, the proposal's tokens (a
    build needs no q rows), the fan-out F_0..F_K over its outcomes, the next
    round's K (``ks``, the proposal's own length before any clipping) and the
    KV delta of the hit that made the proposal when another draft owns it
    (``deltas``: None where this draft holds it already)."""
    return [
        BuildItem(st, Proposal(p.tokens, None, p.source), list(f), k, saguaro_c, shard, num_shards, d)
        for st, p, f, k, d in zip(steps, proposals, fanouts, ks, deltas)
    ]


def next_build_item(plan: NextRound, proposal: Proposal) -> BuildItem:
    """The only draft's build item for a sequence in the round after ``plan``'s
    lookup, whose next proposal is ``proposal``: a hit clipped to the plan's
    K with the fan-out after a hit, else the plan's backup with the fan-out
    after it."""
    if proposal.source is ProposalSource.CACHE:
        tokens, fanout = proposal.tokens[: plan.k], plan.after_hit
    else:
        tokens, fanout = proposal.tokens, plan.after_backup
    return BuildItem(plan.step, Proposal(tokens, None, proposal.source), list(fanout), plan.k, plan.saguaro_c)


def miss_backup(plan: NextRound) -> Proposal | None:
    """A miss's backup that needs no drafting: nothing at K = 0, the plan's
    guess for the fast backup; None: the neural one, drafted from the step."""
    if plan.k == 0:
        return Proposal([], None, ProposalSource(plan.backup))
    if plan.backup == "fast" and plan.guess is not None:
        return Proposal(list(plan.guess), None, ProposalSource.FAST)
    return None


@dataclass
class Served:
    """What the drafts' lookup answers give one sequence: the cached
    speculation (``None``: a miss everywhere) and which answer it came from
    (``owner``, an index into the answers) with its KV delta, the rank of t*
    in the draft's ranking (the first answer that knows it), and a backup a
    draft drafted for a miss."""

    hit: Proposal | None
    owner: int | None
    delta: Extension | None
    rank: int | None
    backup: Proposal | None


def read_answers(answers: Sequence[Sequence[LookupResult]], at: Sequence[int]) -> list[Served]:
    """Merge the drafts' answers: the j-th sequence's result sits at
    ``at[j]`` in each; the first draft that hit serves it (several drafts
    build disjoint shares, so at most one hits on the same outcome)."""
    out = []
    for idx in at:
        hit = delta = rank = backup = owner = None
        for d, res in enumerate(answers):
            r = res[idx]
            rank = r.rank if rank is None else rank
            backup = backup or r.backup
            if hit is None and r.proposal is not None:
                hit, owner, delta = r.proposal, d, r.extension
        out.append(Served(hit, owner, delta, rank, backup))
    return out
