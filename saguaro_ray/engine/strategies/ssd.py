"""SSD (Saguaro): while the target verifies round T, the drafts build round
T+1's speculations for its likely outcomes; after verification a cache hit
supplies the next proposal at once, and a miss is served by the backup
(``neural``: K draft steps from the real outcome; ``fast``: a point-mass
guess from the history).

A round, top to bottom (:meth:`SSDStrategy.run`, for the batch's SSD
sequences; the round's other sequences ride in the same verification with
the proposals their strategies made): fix the budget; give new
sequences a first proposal; make each sequence's :class:`NextRound` (with one
draft) and register the lookups the target will place; send the
verification and every draft's build (the longer of the two first); emit the
outcomes — meanwhile the target has sent the drafts the lookups, and the only
draft serves a miss's backup in it and starts the next round's build itself;
read the answers into each sequence's next proposal; serve what is left with
the round loop's own backup. What the calls carry is
:mod:`saguaro_ray.workers.ssd_protocol`'s.

The budget is fixed one round ahead: a round's plans carry the next round's
fan-outs, and its build uses them.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from saguaro_ray.algorithms.backup import BackupKind, BackupPolicy, BackupStats
from saguaro_ray.algorithms.fanout import BudgetController, FanoutEstimator
from saguaro_ray.workers import ssd_protocol
from saguaro_ray.engine.calls import Forwarded, RetryingCall
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import RoundRecord, Span, round_components
from saguaro_ray.engine.transport import WorkerHandle
from saguaro_ray.workers.messages import BuildItem, KVDelta, LookupResult, NextRound, Outcome, Proposal, ProposalSource, SeqStep, Timed

if TYPE_CHECKING:
    from saguaro_ray.engine.round_loop import RoundLoop


def _regime(p: Proposal) -> BackupKind | None:
    """The acceptance regime a proposal is verified under, for the fan-out
    estimator and the backup statistics: the backup kind that made it, or
    None for the primary draft (a cache hit, a first proposal)."""
    if p.source is ProposalSource.NEURAL:
        return "neural"
    if p.source is ProposalSource.FAST:
        return "fast"
    return None


def _span(spans: Sequence[Span]) -> Span:
    """The time several workers' concurrent calls cover together."""
    return min(a for a, _ in spans), max(b for _, b in spans)


@dataclass
class _Lookups:
    """A round's lookup calls in flight: ``at[j]`` is where the j-th live
    sequence's answer sits in each reply; ``kind`` the backup a miss's
    answer carries when the lookup asked for one."""

    calls: list[tuple[WorkerHandle, RetryingCall]]
    at: list[int]
    kind: BackupKind
    plans: list[NextRound] | None  # the plan of the j-th live sequence (the only draft)
    steps: list[SeqStep]  # ... the round's step it is read with


@dataclass
class _PlacedLookups:
    """The lookups the target places when verification ends: ``forward`` rides the
    verification call, ``calls`` are the calls registered at the drafts."""

    forward: dict[str, object]
    calls: list[Forwarded]


class SSDStrategy:
    def __init__(self, loop: "RoundLoop") -> None:
        spec = loop.spec
        self.loop = loop
        self.fanout = FanoutEstimator()
        # auto fan-outs spend as much of the budget as stays hidden behind verification
        self.budget = BudgetController(spec.budget)
        self._spend = spec.budget  # the budget per sequence of this round's builds
        self._next_spend: int | None = None  # ... and of the next round's, fixed one round ahead
        # per sequence: the plan its latest lookup carried, the round's step and proposal it is
        # read with, and the outcome, while its proposal is the one that lookup served (the next
        # build's items are made from them, on the draft's side too)
        self._planned: dict[int, tuple[NextRound, SeqStep, list[int], int, int]] = {}
        self.backup_policy = BackupPolicy(spec.backup)
        self.backup_stats = BackupStats()
        self._verify_seconds = 1.0  # latest verification time, the unit of relative latencies
        # the KV delta of each sequence's latest hit, and the draft that served it
        self._deltas: dict[int, tuple[WorkerHandle, KVDelta]] = {}

    # -------------------------------------------------------------- round
    def run(
        self,
        running: list[SequenceState],
        rec: RoundRecord,
        others: Sequence[SequenceState] = (),
        other_proposals: Sequence[Proposal] = (),
        other_rules: Sequence[tuple[str, float]] = (),
    ) -> None:
        """One round for the SSD sequences ``running``; ``others`` (with the
        proposals their strategies made and the rules they are verified
        with) share its one verification, placed after the SSD items: only
        the first ``len(running)`` outcomes are looked up."""
        loop, spec = self.loop, self.loop.spec
        self._spend, self._next_spend = self._next_spend or self.budget.budget, self.budget.budget
        rec.budget = self._spend if spec.fanout == "auto" else None
        need = [s for s in running if s.proposal is None]
        if need:  # newly admitted sequences (a miss is served at its own round's lookup)
            rec.backup, rec.draft = self._backup(need, len(running))
        # every draft that is up builds its share of the outcomes (one budget each)
        builders = loop.drafts.up()
        shards = max(1, len(builders))
        planned, self._planned = self._planned, {}
        if shards > 1:  # several drafts build their shares afresh: nothing was built ahead
            planned = {}
        built_ahead = [self._made_ahead(planned.get(s.seq_id), s.proposal) for s in running]
        # a sequence verifies what its build made ahead assumed (the K of the round before: the K
        # chosen now goes into this round's plan); the others the K chosen — and a cached
        # speculation may be longer than what is still worth verifying
        ks = [loop.spec_len(s, s.k if it is None else len(it.proposal.tokens)) for s, it in zip(running, built_ahead)]
        proposals = [ssd_protocol.clip(s.proposal, k) for s, k in zip(running, ks)]  # type: ignore[arg-type]
        # a speculation clipped to nothing is never verified: its q rows are never fetched
        loop.discard([loop.target], [s.proposal.q for s, p in zip(running, proposals) if s.proposal.tokens and not p.tokens])  # type: ignore[union-attr]
        ahead_items = [it if it is not None and it.proposal.tokens == p.tokens else None for it, p in zip(built_ahead, proposals)]
        for s, it in zip(running, ahead_items):
            s.rebuilt = s.seq_id in planned and it is None
        share = shards > 1  # peers take the owner's KV delta instead of recomputing
        kind = self._backup_kind(len(running))  # one backup decision per round, for this round's misses
        # everything a lookup needs but the outcomes is known now: with one draft, each
        # sequence's plan; where the transport allows, the target places the lookups itself
        # what this round's build items say, made once: a step marks its tokens as sent to the drafts,
        # so a second one would carry only the last RECENT_TOKENS of what a draft has not seen
        steps = [loop.step(s, kind="draft") for s in running]
        # the next round's hits are as long as this round's build makes its speculations
        hit_ks = [k if it is None else it.k_next for k, it in zip(ks, ahead_items)]
        for s, k in zip(running, hit_ks):
            s.built = k
        plans = self._plans(running, proposals, hit_ks, kind) if len(builders) == 1 else None
        placed = self._place_lookups(builders, share, rec.index, plans, len(running))
        forward = None if placed is None else placed.forward
        batch, batch_proposals = [*running, *others], [*proposals, *other_proposals]
        rules = [("exact", 0.0)] * len(running) + list(other_rules)
        # whichever of the two has been taking longer is sent first
        if self.backup_stats.t_primary > 1.0:  # the build's moving average, in verification times
            calls_b = self._send_builds(running, steps, proposals, ks, builders, ahead_items, rec)
            call_v = loop.verify(batch, batch_proposals, rec, rules, forward=forward)
        else:
            call_v = loop.verify(batch, batch_proposals, rec, rules, forward=forward)
            calls_b = self._send_builds(running, steps, proposals, ks, builders, ahead_items, rec)
        every = loop.verified(call_v, rec)
        self._verify_seconds = max(rec.verify[1] - rec.verify[0], 1e-9)  # type: ignore[index]
        loop.emit(batch, batch_proposals, every, rec)
        outcomes = every[: len(running)]
        live = [i for i, s in enumerate(running) if not s.finished]
        if placed is not None and not call_v.resent:
            rec.lookup_sent, rec.forwarded = rec.verify[1], True  # type: ignore[index]
            args = ([o.key for o in outcomes], share, rec.index, plans)
            calls = [(f.worker, RetryingCall(f.worker, "lookup", lambda full: args, degradable=True, fut=f.future)) for f in placed.calls]
            lookups = _Lookups(calls, live, kind, None if plans is None else [plans[i] for i in live], [steps[i] for i in live])
        else:
            for f in placed.calls if placed is not None else []:  # verification was re-sent: its lookups were never placed
                f.forget()
            lookups = self._send_lookups(outcomes, live, [d for d, _ in calls_b], kind, share, plans, steps, rec)
        built = [got for got in (loop.draft_value(c) for _, c in calls_b) if got is not None]
        if built:
            rec.build = _span([span for _, span in built])  # a build started ahead: the span it really ran
            rec.ahead = any(isinstance(value, dict) and value.get("ahead") for value, _ in built)
            # when the build ended, from the verification's start, in verification times: the
            # round waits for a build that ends after verification, however early it began
            t_primary = (rec.build[1] - rec.verify[0]) / self._verify_seconds  # type: ignore[index]
            self.backup_stats.observe_latency(t_primary=t_primary)
            self.budget.observe(t_primary)
        for p, out in zip(proposals, outcomes):
            from_cache = p.source is ProposalSource.CACHE
            self.backup_stats.observe_sequence(from_cache, out.accepted + 1, None if from_cache else _regime(p))
        if not live:  # every sequence finished: nothing to wait for (the target placed lookups anyway) ...
            for f in placed.calls if placed is not None and rec.forwarded else []:
                # ... but their answers' transfers must be taken, whenever they come
                f.future.add_done_callback(lambda fut, d=f.worker: self._drop_answer(d, fut))
            return
        self._take_lookups(running, proposals, outcomes, lookups, rec)
        missed = [running[i] for i in live if running[i].proposal is None]
        if missed:  # the fast backup, or the neural one from the primary when several drafts looked up
            rec.backup, rec.miss_backup = self._backup(missed, len(running), kind)

    def ended(self, rec: RoundRecord) -> None:
        # what the round cost beyond its workers' time, for the backup policy's model
        self.backup_stats.observe_latency(t_round=round_components(rec)["control"] / self._verify_seconds)

    def left(self, seqs: Sequence[SequenceState]) -> None:
        """``seqs`` go on with another strategy: their cached speculation
        will not be verified — let go of it as for a cancelled sequence."""
        self.dropped(seqs, finished=False)
        for s in seqs:
            s.proposal = None

    def dropped(self, seqs: Sequence[SequenceState], finished: bool) -> None:
        """An SSD sequence ended at a round boundary (cancelled, failed) still
        holds the speculation its last lookup served for a round that will not
        run: the target takes its q rows (and the other drafts its KV delta)
        so the draft lets them go."""
        loop = self.loop
        for s in seqs:
            self._planned.pop(s.seq_id, None)
        if not finished:
            loop.discard([loop.target], [s.proposal.q for s in seqs if s.proposal is not None])
        for s in seqs:
            owned = self._deltas.pop(s.seq_id, None)
            if owned is not None and not finished:
                owner, delta = owned
                loop.discard([d for d in loop.drafts.up() if d is not owner], [delta.kv])

    # -------------------------------------------------------------- calls
    def _send_builds(
        self,
        running: list[SequenceState],
        steps: list[SeqStep],
        proposals: list[Proposal],
        ks: list[int],
        builders: list[WorkerHandle],
        ahead_items: list[BuildItem | None],
        rec: RoundRecord,
    ) -> list[tuple[WorkerHandle, RetryingCall]]:
        """Each draft's share of the build for this round's proposals, from the
        round's ``steps`` (every draft gets the same: each carries the tokens a
        draft has not seen yet). A sequence with a build made ahead
        (``ahead_items``, what the only draft started in the lookup) gets that
        item; when every one did, the call says so (``ahead``). A
        self-contained re-send is always built afresh."""
        loop, shards = self.loop, max(1, len(builders))
        fanouts = [self._fanout_for(p, shards) for p in proposals]
        owned = [self._deltas.pop(s.seq_id, None) for s in running]
        ahead = bool(running) and all(it is not None for it in ahead_items)

        def args(full: bool, shard: int, draft: WorkerHandle) -> tuple:
            deltas = [None if full or o is None or o[0] is draft else o[1] for o in owned]
            sent = [loop.step(s, True, "draft") for s in running] if full else steps
            items = ssd_protocol.build_items(sent, proposals, fanouts, ks, shard, shards, deltas)
            if not full:
                items = [planned_item or it for planned_item, it in zip(ahead_items, items)]
            return (items, rec.index, ahead and not full)

        calls = ((d, loop.draft_call("build", lambda full, i=i, d=d: args(full, i, d), d)) for i, d in enumerate(builders))
        return [(d, call) for d, call in calls if call is not None]

    @staticmethod
    def _made_ahead(planned: tuple[NextRound, SeqStep, list[int], int, int] | None, proposal: Proposal | None) -> BuildItem | None:
        """The build item the only draft made ahead, in the lookup that served
        ``proposal``, from the plan that lookup carried (None: not planned, or
        the plan does not cover the outcome or the proposal's length). The plan
        fixed the K it was built for, the one chosen the round before; a K chosen
        since takes effect in the next plan. Verifying fewer tokens would leave
        out the likeliest outcome — all of them accepted, then the speculation's
        own next token — and build the tree afresh on the round's critical path
        (the coder pair: its build ended at 1.9 verifications where one made
        ahead ends at 0.95; docs/auto.md, session 31)."""
        if planned is None or proposal is None:
            return None
        return ssd_protocol.next_build_item(*planned, proposal)

    def _place_lookups(
        self, lookers: list[WorkerHandle], share: bool, round_id: int, plans: list[NextRound] | None, items: int
    ) -> _PlacedLookups | None:
        """The lookups the target places itself when verification ends, for
        the first ``items`` outcomes (the SSD sequences'): the ``forward`` of
        the verification call and the calls registered at each draft (None:
        the transport cannot, or no draft is building)."""
        if self.loop.forward is None or not lookers:
            return None
        calls = self.loop.forward(lookers, "lookup")
        forward = {"method": "lookup", "args": [share, round_id, plans], "to": [f.address for f in calls], "items": items}
        return _PlacedLookups(forward, calls)

    def _send_lookups(
        self,
        outcomes: list[Outcome],
        live: list[int],
        lookers: list[WorkerHandle],
        kind: BackupKind,
        share: bool,
        plans: list[NextRound] | None,
        steps: list[SeqStep],
        rec: RoundRecord,
    ) -> _Lookups:
        """The coordinator sends the live sequences' outcomes to every draft that
        is building, as one broadcast, without waiting for the builds: each
        draft runs the lookup after its build (a lookup that arrives first
        waits for it). The round id makes a lookup that overtook a re-sent
        build answer misses."""
        loop = self.loop
        live_plans = None if plans is None else [plans[i] for i in live]
        args = ([outcomes[i].key for i in live], share, rec.index, live_plans)
        futs = loop.broadcast(lookers, "lookup", args) if live and lookers else []
        rec.lookup_sent = time.perf_counter() if futs else None
        calls = [(d, RetryingCall(d, "lookup", lambda full: args, degradable=True, fut=f)) for d, f in zip(lookers, futs)]
        return _Lookups(calls, list(range(len(live))), kind, live_plans, [steps[i] for i in live])

    def _plans(self, running: list[SequenceState], proposals: list[Proposal], hit_ks: list[int], kind: BackupKind) -> list[NextRound]:
        """Each sequence's :class:`NextRound` before verification (the only
        draft's lookup): the next K — one for every outcome, or one per
        outcome (1 .. len(proposal) + 1 tokens emitted) near a length limit —
        and the next build's fan-outs at the budget fixed for it after a hit
        (a speculation this round's build makes, ``hit_ks[i]`` long, clipped to that K) and
        after the backup of ``kind``; for the fast backup, the history the
        guess is made from. A single draft knows a miss is a miss,
        so it makes the backup in the lookup and can start the next build
        itself; with several, a miss at one may be another's hit and each
        build needs the hit's KV delta: no plans."""
        loop, spec = self.loop, self.loop.spec
        # fan-outs depend on the next K and the hit's length only: one pair per (K, hit length), shared
        made: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

        def fanouts(k: int, k_hit: int) -> tuple[list[int], list[int]]:
            if (k, k_hit) not in made:
                made[k, k_hit] = (self._fanout(min(k_hit, k), None, spend=self._next_spend), self._fanout(k, kind, spend=self._next_spend))
            return made[k, k_hit]

        plans = []
        for s, p, k_hit in zip(running, proposals, hit_ks):
            next_ks = [loop.spec_len(s, s.k, ahead=n) for n in range(1, len(p.tokens) + 2)]
            if all(k == next_ks[0] for k in next_ks):
                next_ks = next_ks[:1]
            pairs = [fanouts(k, k_hit) for k in next_ks]
            history = s.all_ids if kind == "fast" else None
            plans.append(NextRound(next_ks, kind, [h for h, _ in pairs], [b for _, b in pairs], history))
        return plans

    def _take_lookups(self, running: list[SequenceState], proposals: list[Proposal], outcomes: list[Outcome], lookups: _Lookups, rec: RoundRecord) -> None:
        """Collect the drafts' answers: each live sequence's next proposal is a hit,
        else the backup its lookup made (the only draft's); observe hits and ranks."""
        answers: list[tuple[WorkerHandle, list[LookupResult]]] = []
        spans = []
        for d, call in lookups.calls:
            got = self.loop.draft_value(call)
            if got is not None:
                answers.append((d, got[0]))
                spans.append(got[1])
        if spans:
            rec.lookup = _span(spans)
            rec.lookup_back = time.perf_counter()
        served_backup = False
        kept: set[int] = set()  # the proposals and KV deltas this round uses (by id)
        live = [i for i, s in enumerate(running) if not s.finished]
        for j, (i, got) in enumerate(zip(live, ssd_protocol.read_answers([res for _, res in answers], lookups.at))):
            s, p, out = running[i], proposals[i], outcomes[i]
            hit = got.hit is not None
            if hit and got.delta is not None:
                self._deltas[s.seq_id] = (answers[got.owner][0], got.delta)  # type: ignore[index]
                kept.add(id(got.delta))
            self.fanout.observe(out.accepted, out.proposed, got.rank, after_backup=_regime(p) or False, hit=hit)
            self.backup_stats.observe_lookup(_regime(p) or "cache", hit)
            s.lookups += 1
            s.hits += int(hit)
            rec.hits += int(hit)
            rec.misses += int(not hit)
            rec.looked_up.append([out.accepted, out.proposed, int(hit)])
            s.proposal = got.hit or got.backup  # neither: the round loop's backup serves it
            if s.proposal is not None and lookups.plans is not None:
                self._planned[s.seq_id] = (lookups.plans[j], lookups.steps[j], p.tokens, out.accepted, out.next_token)
            kept.add(id(s.proposal))
            served_backup = served_backup or (not hit and got.backup is not None)
        self._drop_lookups(answers, kept)
        if served_backup and rec.lookup is not None:  # this lookup made backups for its misses
            rec.backup = lookups.kind
            self.backup_policy.served(lookups.kind)
            if lookups.kind == "neural":  # drafting them is part of the lookup's time
                self.backup_stats.observe_latency(t_neural=(rec.lookup[1] - rec.lookup[0]) / self._verify_seconds)

    def _drop_answer(self, draft: WorkerHandle, fut: "Future[Timed]") -> None:
        """Discard all of a lookup's answer, once it comes (a failed lookup sent nothing that stays)."""
        if not fut.cancelled() and fut.exception() is None:
            self._drop_lookups([(draft, fut.result().value)], set())

    def _drop_lookups(self, answers: Sequence[tuple[WorkerHandle, Sequence[LookupResult]]], kept: set[int]) -> None:
        """Discard what lookups answered but the round does not use (``kept``:
        the ids of what it does): speculations for sequences that finished, a
        backup next to a hit, the KV deltas of unused hits."""
        loop = self.loop
        qs = [p.q for _, res in answers for r in res for p in (r.proposal, r.backup) if p is not None and id(p) not in kept]
        loop.discard([loop.target], qs)
        for d, res in answers:
            kvs = [r.kv_delta.kv for r in res if r.kv_delta is not None and id(r.kv_delta) not in kept]
            loop.discard([x for x in loop.drafts.up() if x is not d], kvs)

    # ------------------------------------------------------------ fan-out
    def _fanout_for(self, proposal: Proposal, shards: int = 1) -> list[int]:
        """F_k for the outcomes of verifying ``proposal`` (its source sets the
        acceptance regime: a backup speculation is accepted differently),
        over ``shards`` drafts that each build a budget's worth."""
        return self._fanout(len(proposal.tokens), _regime(proposal), shards)

    def _fanout(self, k: int, regime: BackupKind | None, shards: int = 1, spend: int | None = None) -> list[int]:
        """F_0..F_k at ``spend`` per draft (default: this round's budget)."""
        spec = self.loop.spec
        if spec.fanout == "auto":
            return self.fanout.allocation((spend or self._spend) * shards, k, after_backup=regime or False)
        return [f * shards for f in spec.fanout[: k + 1]]

    # ------------------------------------------------------------- backup
    def _backup_kind(self, batch_size: int) -> BackupKind:
        """``auto`` weighs the backups at the live batch size (a batch of b
        hits fully only with probability p_hit^b); without a draft: fast."""
        return self.backup_policy.choose(batch_size, self.backup_stats) if self.loop.drafts.primary is not None else "fast"

    def _backup(self, seqs: list[SequenceState], batch_size: int, kind: BackupKind | None = None) -> tuple[BackupKind, Span]:
        """Give ``seqs`` (no speculation yet, or a miss) a backup speculation
        of ``kind`` (default: the policy's choice now); returns the kind
        served and the drafting span."""
        loop = self.loop
        kind = kind or self._backup_kind(batch_size)
        ks = [loop.spec_len(s, s.k) for s in seqs]
        t0 = time.perf_counter()
        got = None
        if kind == "neural":
            got = loop.draft_value(loop.draft_call("propose", lambda full: ([loop.step(s, full, "draft") for s in seqs], ks)))
        if got is None:
            kind = "fast"
            proposals, span = loop.fast(seqs, ks), (t0, time.perf_counter())
        else:
            proposals, span = got
            self.backup_stats.observe_latency(t_neural=(span[1] - span[0]) / self._verify_seconds)
        for s, p in zip(seqs, proposals):
            p.source = ProposalSource(kind)
            s.proposal = p
        self.backup_policy.served(kind)
        return kind, span
