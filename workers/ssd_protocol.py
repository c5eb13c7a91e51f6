"""The SSD protocol: what each draft call of an SSD round carries, and how its answers are read.

One home for the rules the round loop and the drafts must agree on. A round
of SSD (see ``saguaro_ray.engine.strategies.ssd``) sends every draft that is
up a *build* — its share of the speculations for the likely outcomes of the
proposal being verified — and a *lookup* of the real outcomes, which the
target places on the drafts the moment verification ends. With one draft the
lookup also carries each sequence's :class:`NextRound`, made before
verification; :func:`resolve` reads it at the real outcome, with the step and
proposal of the round's build item (the next step, K, fan-outs and the fast
guess), so the draft serves a miss's backup in the
lookup and, with every next proposal known, starts the next round's build
itself. The items of that build are :func:`next_build_item` — the same
function, on the same plan, outcome and proposal, that the round loop calls
for the build call it sends next: the two are equal by construction, and the
call only says so (``ahead``). Plain functions over the worker messages — no
transport, no models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from saguaro_ray.algorithms.ngram import ngram_guess
from saguaro_ray.workers.messages import RECENT_TOKENS, BuildItem, KVDelta, LookupResult, NextRound, Proposal, ProposalSource, SeqStep


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
    shard: int,
    num_shards: int,
    deltas: Sequence[KVDelta | None],
) -> list[BuildItem]:
    """The build one draft (``shard`` of ``num_shards``) runs while the target
    verifies ``proposals``: per sequence its step, the proposal's tokens (a
    build needs no q rows), the fan-out F_0..F_K over its outcomes, the next
    round's K (``ks``, the proposal's own length before any clipping) and the
    KV delta of the hit that made the proposal when another draft owns it
    (``deltas``: None where this draft holds it already)."""
    return [
        BuildItem(st, Proposal(p.tokens, None, p.source), list(f), k, shard, num_shards, d)
        for st, p, f, k, d in zip(steps, proposals, fanouts, ks, deltas)
    ]


def step_after(step: SeqStep, tokens: Sequence[int], k: int, t: int) -> SeqStep:
    """Where a sequence stands once outcome (k, t) of verifying ``tokens``
    after ``step`` is emitted: its first k tokens accepted, t pending — the
    step the round loop sends next (``RoundLoop.step``)."""
    held = list(step.new_tokens) + list(tokens[:k])
    recent = (list(step.recent) + held)[-RECENT_TOKENS:]
    return SeqStep(step.seq_id, step.start + len(held), [t], step.params, step.seed, step.output_pos + k + 1, recent, step.prompt_len)


@dataclass
class Resolved:
    """A :class:`NextRound` read at the real outcome: the next round's step and
    K, the next build's fan-outs, and the fast guess (None unless the plan's
    backup is ``fast``)."""

    step: SeqStep
    k: int
    backup: str
    after_hit: list[int]
    after_backup: list[int]
    guess: list[int] | None


def resolve(plan: NextRound, step: SeqStep, tokens: Sequence[int], k: int, t: int) -> Resolved | None:
    """``plan`` at outcome (k accepted, then t) of verifying ``tokens`` after
    ``step`` (this round's); None if the plan does not cover it."""
    if not 0 <= k <= len(tokens) or (len(plan.ks) > 1 and k >= len(plan.ks)):
        return None
    i = k if len(plan.ks) > 1 else 0
    k_next = plan.ks[i]
    guess = None
    if plan.backup == "fast" and plan.history is not None:
        guess = ngram_guess(list(plan.history) + list(tokens[:k]) + [t], k_next)
    return Resolved(step_after(step, tokens, k, t), k_next, plan.backup, plan.after_hit[i], plan.after_backup[i], guess)


def next_build_item(plan: NextRound, step: SeqStep, tokens: Sequence[int], k: int, t: int, proposal: Proposal) -> BuildItem | None:
    """The only draft's build item for a sequence in the round after ``plan``'s
    lookup, whose outcome was (k, t) and whose next proposal is ``proposal``:
    a hit clipped to the next K with the fan-out after a hit, else the plan's
    backup with the fan-out after it (None: the plan does not cover k, or
    its fan-out is for another length than the proposal's — a hit built
    before the policy changed K is shorter or longer than the plan assumed,
    and a fan-out over outcomes it does not have builds nothing a lookup
    can hit)."""
    r = resolve(plan, step, tokens, k, t)
    if r is None:
        return None
    if proposal.source is ProposalSource.CACHE:
        tokens, fanout = proposal.tokens[: r.k], r.after_hit
    else:
        tokens, fanout = proposal.tokens, r.after_backup
    if len(fanout) != len(tokens) + 1:
        return None
    return BuildItem(r.step, Proposal(tokens, None, proposal.source), list(fanout), r.k)


def miss_backup(r: Resolved) -> Proposal | None:
    """A miss's backup that needs no drafting: nothing at K = 0, the fast
    guess; None: the neural one, drafted from the step."""
    if r.k == 0:
        return Proposal([], None, ProposalSource(r.backup))
    if r.backup == "fast" and r.guess is not None:
        return Proposal(list(r.guess), None, ProposalSource.FAST)
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
    delta: KVDelta | None
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
                hit, owner, delta = r.proposal, d, r.kv_delta
        out.append(Served(hit, owner, delta, rank, backup))
    return out
