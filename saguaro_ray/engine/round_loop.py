"""The round loop: how a batch of sequences advances, whatever their strategies.

A round verifies one proposal per running sequence and emits k+1 tokens for
each (k accepted draft tokens plus the recovery/bonus token t*). The loop
owns the authoritative token history of every sequence
(:class:`SequenceState`), admits new sequences (prefill), retires finished
ones and releases them on every worker.

Every sequence carries its own strategy (DESIGN §5): before each round the
loop fixes the mode and K each one runs this round — its request's fixed
strategy, or what ``auto``'s policy picks — and the round's proposals are
made per mode (:mod:`saguaro_ray.engine.strategies`: AR proposes nothing, SD
drafts K tokens, PyramidSD qualifies them, SSD serves its cache), then ONE
verification checks the whole batch, each item under its own rule. Any K
and any proposal law is exact, so a sequence's output does not depend on
what its neighbours run.

The loop only talks to workers through :class:`WorkerHandle` futures, so the
in-process engine and the Ray runtime run this same code.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from typing import Any, Sequence

import torch

from saguaro_ray.algorithms.ngram import ngram_guess
from saguaro_ray.config import SpeculationConfig, Strategy
from saguaro_ray.engine.calls import ArgsFn, BroadcastFn, ForwardFn, RetryingCall, caught_up, discarded, released, submit_each
from saguaro_ray.engine.drafts import DraftPool
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.strategies import Proposer, make_strategies
from saguaro_ray.engine.strategies.assign import Assigner, Policy
from saguaro_ray.engine.strategy_menu import StrategyMenu
from saguaro_ray.engine.timeline import TIMELINE_BYTES, RoundRecord, Timeline
from saguaro_ray.engine.transport import WorkerHandle, WorkerLost
from saguaro_ray.workers.messages import RECENT_TOKENS, Outcome, Proposal, ProposalSource, SeqStep, VerifyItem


def on_plane(x: Any) -> bool:
    """Is ``x`` (q rows, a KV delta) a data-plane reference rather than tensors here?"""
    return x is not None and not isinstance(x, (torch.Tensor, list, tuple))


def local(p: Proposal) -> Proposal:
    """``p`` without q rows that live on the data plane (see :class:`RetryingCall`)."""
    return p if p.q is None or isinstance(p.q, torch.Tensor) else Proposal(p.tokens, None, p.source)


CATCH_UP_TOKENS = 8  # drafts this many tokens behind an auto sequence catch up before it speculates again


class RoundLoop:
    def __init__(
        self,
        spec: SpeculationConfig,
        target: WorkerHandle,
        eos_ids: tuple[int, ...],
        max_context: int,
        draft: WorkerHandle | Sequence[WorkerHandle] | None = None,
        qualifier: WorkerHandle | None = None,
        broadcast: BroadcastFn = submit_each,
        forward: ForwardFn | None = None,
        policy: Policy | None = None,
        timeline_bytes: int | None = None,
    ) -> None:
        """``broadcast``: how one call reaches several drafts at once (SSD's lookups);
        ``forward``: where the transport allows, how the target places the SSD
        lookups on the drafts itself when verification ends; ``policy``: what
        picks ``auto`` sequences' strategies (default: the fitted cost model,
        :class:`~saguaro_ray.algorithms.strategy_model.AutoPolicy`);
        ``timeline_bytes``: the round history's bound (:class:`Timeline`; None: ``TIMELINE_BYTES``)."""
        self.spec = spec
        self.target = target
        drafts = [] if draft is None else [draft] if not isinstance(draft, (list, tuple)) else list(draft)
        self.drafts = DraftPool(drafts)
        self.broadcast = broadcast
        self.forward = forward
        self.qualifier = qualifier
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.timeline = Timeline(TIMELINE_BYTES if timeline_bytes is None else timeline_bytes)
        self._round_ids = itertools.count()  # round ids keep increasing when the timeline is full
        self.menu = StrategyMenu.of(spec, bool(drafts), qualifier is not None)
        self.default_strategy = self.menu.filled(Strategy(spec.mode))  # the engine's checked when it was configured
        self.strategies = make_strategies(self)
        self.assigner = Assigner(self, policy)
        self._catching_up: dict[int, list[Future[Any]]] = {}  # per sequence: its drafts' catch-up in flight
        self.catch_ups = 0  # catch-ups sent, one per sequence (engine metrics)

    # -------------------------------------------------------- draft health
    @property
    def draft_up(self) -> bool:
        """Is at least one draft usable now?"""
        return bool(self.drafts.up())

    @property
    def draft_failures(self) -> int:
        return self.drafts.failures

    def draft_call(self, method: str, args_fn: ArgsFn, draft: WorkerHandle | None = None) -> RetryingCall | None:
        """Submit to ``draft`` (default: the primary) unless none is up; ``None`` means: do without."""
        draft = draft or self.drafts.primary
        if draft is None:
            return None
        return RetryingCall(draft, method, args_fn, degradable=True)

    def draft_value(self, call: RetryingCall | None) -> tuple[Any, tuple[float, float]] | None:
        """A draft call's answer and span; None when there was no call or its draft was lost."""
        if call is None:
            return None
        try:
            return call.value()
        except WorkerLost:
            self.drafts.lost(call.worker)
            return None

    @staticmethod
    def fast(seqs: Sequence[SequenceState], ks: Sequence[int], blocks: Sequence[list[int]] | None = None) -> list[Proposal]:
        """Point-mass guesses from each sequence's history (the fast backup, and
        what any mode proposes while no draft is up)."""
        blocks = blocks or [[] for _ in seqs]
        return [Proposal(ngram_guess(s.all_ids + b, k), None, ProposalSource.FAST) for s, k, b in zip(seqs, ks, blocks)]

    # ------------------------------------------------------------ helpers
    @staticmethod
    def step(s: SequenceState, full: bool = False, kind: str = "target") -> SeqStep:
        """Where ``s`` stands: workers hold all but the last emitted token
        (before the first round: nothing — the whole prompt is new).
        ``full`` re-sends the whole history (a worker that lost its state).
        ``kind``: the workers the step goes to — a draft or qualifier that sat
        out rounds (the sequence ran AR, say) gets every token since the last
        step it was sent, so it catches up without a re-prefill. A sequence
        that has not run a round yet is new to every worker, even with output
        (a resumed one, :mod:`saguaro_ray.engine.resume`): all of it is sent."""
        committed = len(s.all_ids) - 1 if s.output_ids and not full and s.rounds else 0
        ids = s.all_ids
        since = committed if kind == "target" else min(committed, s.fed.get(kind, committed))
        s.fed[kind] = len(ids)  # once it has run the step, a worker holds at least every token up to here
        recent = ids[max(0, min(committed - RECENT_TOKENS, since)) : committed]
        return SeqStep(s.seq_id, committed, ids[committed:], s.params, s.seed, len(s.output_ids), recent, len(s.prompt_ids))

    def strategy_of(self, s: SequenceState) -> Strategy:
        """``s``'s strategy (its request's, or the engine's default)."""
        return s.strategy or self.default_strategy

    @property
    def speculation_margin(self) -> int:
        """KV tokens a round may hold beyond the emitted ones (proposal + pending token)."""
        return max(self.spec.k_max, self.spec.lq + self.spec.ld) + 1

    def spec_len(self, s: SequenceState, k: int, ahead: int = 0) -> int:
        """Draft tokens worth proposing: never past max_tokens or the context
        (``ahead``: once ``s`` has emitted that many more tokens)."""
        remaining = s.params.max_tokens - len(s.output_ids) - ahead - 1
        room = self.max_context - len(s.all_ids) - ahead
        return max(0, min(k, remaining, room))

    def emit(self, running: list[SequenceState], proposals: Sequence[Proposal], outcomes: Sequence[Outcome], rec: RoundRecord) -> None:
        """Append each outcome's tokens to its sequence's history (the one place the history grows)."""
        for s, prop, out in zip(running, proposals, outcomes):
            kept = s.emit(out.emitted(prop), self.eos_ids, out.logprobs)
            s.served = str(prop.source)
            s.unseen_by_drafts = s.unseen_by_drafts + len(kept) if s.mode == "ar" else 0
            s.rounds += 1
            s.accepted_total += out.accepted
            s.spec_rounds += int(out.proposed > 0)
            rec.accepted.append(out.accepted)
            rec.proposed.append(out.proposed)

    def discard(self, receivers: Sequence[WorkerHandle], refs: list[Any]) -> None:
        """Have ``receivers`` take the data-plane transfers behind ``refs``
        that nobody will resolve: until its receiver takes it, a transfer
        holds its tensor and a thread on the sender. Without waiting: each
        receiver takes them before anything asked of it later."""
        refs = [r for r in refs if on_plane(r)]
        if not refs:
            return
        for w in receivers:
            w.submit("discard", refs).add_done_callback(lambda f, name=w.name: discarded(name, f))

    def verify(
        self,
        running: list[SequenceState],
        proposals: list[Proposal],
        rec: RoundRecord,
        rules: Sequence[tuple[str, float]] | None = None,
        forward: dict[str, Any] | None = None,
    ) -> RetryingCall:
        """Send the verification of ``proposals`` (``rules[i]``: sequence i's
        rule and threshold — PyramidSD's stage 2; default exact); ``forward``
        (first attempt only) is the call the target places on the drafts when
        it is done (SSD's lookups, for the first ``forward["items"]`` outcomes)."""
        div = self.spec.div
        rules = rules or [("exact", 0.0)] * len(running)

        def args(full: bool) -> tuple:
            items = [VerifyItem(self.step(s, full), local(p) if full else p, r, tau, div) for s, p, (r, tau) in zip(running, proposals, rules)]
            return (items,) if forward is None or full else (items, forward)

        call = RetryingCall(self.target, "verify", args)
        rec.sent = time.perf_counter()
        return call

    @staticmethod
    def verified(call: RetryingCall, rec: RoundRecord) -> list[Outcome]:
        """Wait for a verification; records its span and when its result arrived."""
        outcomes, rec.verify = call.value()
        rec.back = time.perf_counter()
        return outcomes

    # -------------------------------------------------------------- run
    def admit(self, new: list[SequenceState]) -> list[SequenceState]:
        """Prefill new sequences on every worker concurrently (the target samples
        their first token) — they join the running batch at a round boundary.
        Returns those still running; finished ones are released and finalised."""
        if not new:
            return []
        rec = RoundRecord(index=next(self._round_ids), batch=len(new), start=time.perf_counter(), prefill=True)
        prefill_d = lambda full: ([self.step(s, full, "draft") for s in new],)  # noqa: E731
        prefill_q = lambda full: ([self.step(s, full, "qualifier") for s in new],)  # noqa: E731
        call_t = RetryingCall(self.target, "verify", lambda full: ([VerifyItem(self.step(s, full), Proposal([])) for s in new],))
        calls_d = [self.draft_call("prefill", prefill_d, d) for d in self.drafts.up()]
        call_q = None if self.qualifier is None else RetryingCall(self.qualifier, "prefill", prefill_q)
        try:
            outcomes, rec.verify = call_t.value()
        finally:
            for call_d in calls_d:
                self.draft_value(call_d)
            if call_q is not None:
                call_q.result()
        self.emit(new, [Proposal([])] * len(new), outcomes, rec)
        rec.end = time.perf_counter()
        self.timeline.append(rec)
        return self._retire(new)

    def advance(self, running: list[SequenceState]) -> list[SequenceState]:
        """One round for every running sequence, each with the strategy it
        runs this round; returns those still running (finished ones are
        released and finalised)."""
        rec = RoundRecord(index=next(self._round_ids), batch=len(running), start=time.perf_counter())
        self.assigner.assign(running, rec)
        ssd = [s for s in running if s.mode == "ssd"]
        others = [s for s in running if s.mode != "ssd"]
        proposals, rules = self._propose(others, rec)
        batch_order = [*ssd, *others]  # the order the verification (and rec.accepted) has them in
        if ssd:  # SSD sends the one verification itself: its builds and lookups ride along it
            self.strategies["ssd"].run(ssd, rec, others, proposals, rules)
        else:
            outcomes = self.verified(self.verify(others, proposals, rec, rules), rec)
            self.emit(others, proposals, outcomes, rec)
        rec.end = time.perf_counter()
        if ssd:
            self.strategies["ssd"].ended(rec)
        self.assigner.observe(batch_order, rec)
        self.timeline.append(rec)
        return self._retire(running)

    @staticmethod
    def catch_up_size(s: SequenceState) -> int:
        """The tokens a draft step for ``s`` would carry now (:meth:`step`, ``kind="draft"``):
        a catch-up's work (``s.unseen_by_drafts`` counts only its AR rounds' tokens, the
        catch-up threshold's measure)."""
        return len(s.all_ids) - s.fed.get("draft", len(s.all_ids) - 1)

    def lagging(self, s: SequenceState) -> bool:
        """Would ``s``, picked to speculate now, run AR while its drafts catch up
        (:meth:`drafts_ready`)? What ``auto`` charges a switch out of AR."""
        return s.unseen_by_drafts >= CATCH_UP_TOKENS or self._catch_up_pending(s.seq_id)

    def _catch_up_pending(self, seq_id: int) -> bool:
        """Is a catch-up sent to ``seq_id``'s drafts still running?"""
        pending = self._catching_up.get(seq_id)
        return pending is not None and not all(f.done() for f in pending)

    def drafts_ready(self, seqs: Sequence[SequenceState], rec: RoundRecord) -> set[int]:
        """The ids among ``seqs`` (``auto`` sequences picked to speculate this
        round) whose drafts can draft for them now without a catch-up on the
        critical path.

        A sequence that ran AR has drafts that missed its tokens; sent with
        its next proposal they all land on the critical path at once (the real
        model's int4 self-draft on CPU: ~1 s for eight sequences after ~40 AR
        rounds, a 0.33x cell). So the drafts of a sequence that emitted
        :data:`CATCH_UP_TOKENS` or more tokens in AR rounds since they last
        took part are sent what they missed (a propose of K = 0, not waited
        for) and the sequence runs AR until they have taken it. Kept near every
        few tokens instead (the earlier design), the drafts worked beside every
        AR round of batches that never speculate: on a shared CPU those rounds'
        verification measured up to 1.3x slower. (The tokens of a round that
        drafted are no lag: the drafts hold what they drafted.) ``rec`` gets the
        tokens sent."""
        ready: set[int] = set()
        lagging: list[SequenceState] = []
        for s in seqs:
            if self._catch_up_pending(s.seq_id):
                continue
            self._catching_up.pop(s.seq_id, None)
            if s.unseen_by_drafts < CATCH_UP_TOKENS:
                ready.add(s.seq_id)
            else:
                lagging.append(s)
        ups = self.drafts.up()
        if lagging and ups:
            for s in lagging:
                s.unseen_by_drafts = 0  # the catch-up's step carries every token up to the last
            self.catch_ups += len(lagging)
            rec.catch_up_sent = sum(self.catch_up_size(s) for s in lagging)
            steps = [self.step(s, kind="draft") for s in lagging]
            futures = [d.submit("propose", steps, [0] * len(steps)) for d in ups]
            for d, f in zip(ups, futures):
                f.add_done_callback(lambda f, name=d.name: caught_up(name, f))
            self._catching_up.update((s.seq_id, futures) for s in lagging)
        return ready

    def catching_up(self) -> int:
        """Sequences whose drafts' catch-up is still running."""
        return sum(1 for i in self._catching_up if self._catch_up_pending(i))

    def _propose(self, seqs: list[SequenceState], rec: RoundRecord) -> tuple[list[Proposal], list[tuple[str, float]]]:
        """The proposals of the sequences that draft before verification (AR,
        SD, PyramidSD), in ``seqs``' order, and the rule each is verified with;
        ``rec.draft`` spans all their drafting."""
        proposals: list[Proposal | None] = [None] * len(seqs)
        rules: list[tuple[str, float]] = [("exact", 0.0)] * len(seqs)
        spans = []
        for mode in ("ar", "sd", "pyramid"):
            idx = [i for i, s in enumerate(seqs) if s.mode == mode]
            if not idx:
                continue
            strategy: Proposer = self.strategies[mode]
            got, span = strategy.propose([seqs[i] for i in idx])
            if span is not None:
                spans.append(span)
            for i, p in zip(idx, got):
                proposals[i], rules[i] = p, strategy.rule
        if spans:
            rec.draft = (min(a for a, _ in spans), max(b for _, b in spans))
        return proposals, rules  # type: ignore[return-value]

    def release(self, seqs: list[SequenceState]) -> None:
        """Free unfinished sequences everywhere (cancellation or failure); the
        strategies first let go of what they hold for them."""
        self.strategies["ssd"].dropped(seqs, finished=False)
        self._release(seqs)
        for s in seqs:
            self._finish_stats(s)

    def _retire(self, running: list[SequenceState]) -> list[SequenceState]:
        done = [s for s in running if s.finished]
        self.strategies["ssd"].dropped(done, finished=True)
        self._release(done)
        for s in done:
            self._finish_stats(s)
        return [s for s in running if not s.finished]

    def _release(self, seqs: Sequence[SequenceState]) -> None:
        """Free ``seqs`` on every worker, without waiting: each worker runs the
        release before anything asked of it later (the prefill that reuses the
        room included) — the round loop has nothing to wait for."""
        ids = [s.seq_id for s in seqs]
        if not ids:
            return
        for i in ids:
            self._catching_up.pop(i, None)
        workers = [self.target, *self.drafts.up()] + ([self.qualifier] if self.qualifier is not None else [])
        for w in workers:
            w.submit("release", ids).add_done_callback(lambda f, name=w.name: released(name, f))

    def _finish_stats(self, s: SequenceState) -> None:
        s.proposal = None
        drafted_rounds = sum(n for m, n in s.chosen.items() if m != "ar")  # K counted in k_total
        s.stats.update(
            rounds=s.rounds,
            mean_accepted=s.accepted_total / s.spec_rounds if s.spec_rounds else None,
            cache_hit_rate=s.hits / s.lookups if s.lookups else None,
            lossy=self.spec.lossy and self.strategy_of(s).mode == "pyramid",
            strategy=dict(s.chosen),
            mean_k=s.k_total / drafted_rounds if drafted_rounds else None,
        )
