"""The round loop: one file for how every mode advances a batch of sequences.

A round verifies one proposal per running sequence and emits k+1 tokens for
each (k accepted draft tokens plus the recovery/bonus token t*):

* ``ar``      — the proposal is empty; verification samples one token.
* ``sd``      — the draft proposes K tokens, then the target verifies.
* ``ssd``     — while the target verifies round T, the draft builds round
  T+1's speculations for the likely outcomes (Saguaro); after verification a
  cache hit supplies the next proposal at once, a miss is served by the
  backup (``neural``: K draft steps from the real outcome; ``fast``: a
  point-mass guess from the history).
* ``pyramid`` — the draft proposes ``ld`` tokens at a time, the qualifier
  turns them into qualified tokens until ``lq`` are ready, and the target
  verifies that block with the qualifier's law as q.

The loop only talks to workers through :class:`WorkerHandle` futures, so the
in-process engine and the Ray runtime run this same code. It owns the
authoritative token history of every sequence (:class:`SequenceState`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from saguaro_ray.algorithms.backup import BackupPolicy, BackupStats
from saguaro_ray.algorithms.fanout import BudgetController, BudgetSearch, FanoutEstimator
from saguaro_ray.algorithms.ngram import ngram_guess
from saguaro_ray.config import SpeculationConfig
from saguaro_ray.engine.drafts import DraftPool
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.transport import TransferLost, WorkerGone, WorkerHandle, WorkerLost
from saguaro_ray.workers.messages import (
    RECENT_TOKENS,
    BuildItem,
    Extension,
    LookupResult,
    NeedsPrefillError,
    NextRound,
    Outcome,
    Plan,
    Proposal,
    QualifyItem,
    SeqStep,
    Timed,
    VerifyItem,
    plan_for,
)

log = logging.getLogger(__name__)

TIMELINE_ROUNDS = 100_000  # rounds of history kept for benchmarks and debugging


@dataclass
class RoundRecord:
    """One round of the timeline (perf_counter seconds; None when not run)."""

    index: int
    batch: int
    start: float = 0.0  # the round as the coordinator saw it (perf_counter)
    end: float = 0.0
    verify: tuple[float, float] | None = None
    draft: tuple[float, float] | None = None  # SD drafting, pyramid drafting+qualifying, SSD backups
    build: tuple[float, float] | None = None  # SSD cache construction
    lookup: tuple[float, float] | None = None
    miss_backup: tuple[float, float] | None = None  # SSD: backups drafted for this round's misses after the lookup
    hits: int = 0
    misses: int = 0
    backup: str | None = None
    accepted: list[int] = field(default_factory=list)
    prefill: bool = False  # an admission round (prompts prefilled, first tokens sampled)
    # the coordinator's side of the control plane (perf_counter): verification
    # sent / its result in the round loop's hands; the same for the SSD lookup
    sent: float | None = None
    back: float | None = None
    lookup_sent: float | None = None
    lookup_back: float | None = None
    forwarded: bool = False  # SSD: the target placed this round's lookups itself (lookup_sent = verification's end)
    budget: int | None = None  # SSD with an auto fan-out: speculations built per sequence (per draft)
    ahead: bool = False  # SSD: the draft started this round's build itself, after the previous lookup

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    @property
    def hidden(self) -> bool | None:
        """SSD: was the cache build finished by the time verification ended?"""
        if self.build is None or self.verify is None:
            return None
        return self.build[1] <= self.verify[1]


def _as_span(x: Any) -> tuple[float, float] | None:
    return None if x is None else (float(x[0]), float(x[1]))


def round_components(r: dict[str, Any]) -> dict[str, float]:
    """One decode round (a :class:`RoundRecord`'s JSON) split into verify,
    drafting (busy and exposed on the critical path), cache lookup, and
    control plane (the rest of the round) — for the benchmarks, and for the
    backup policy's per-round cost (:meth:`RoundLoop.advance`)."""
    wall = r["end"] - r["start"]
    verify = _as_span(r.get("verify"))
    build = _as_span(r.get("build"))
    draft = _as_span(r.get("draft"))
    after = _as_span(r.get("miss_backup"))
    lookup = _as_span(r.get("lookup"))
    v = verify[1] - verify[0] if verify else 0.0
    drafted = (draft[1] - draft[0] if draft else 0.0) + (after[1] - after[0] if after else 0.0)
    busy = (build[1] - build[0] if build else 0.0) + drafted
    exposed = drafted  # sequential drafting before verification, or for misses after the lookup
    if build and verify:
        exposed += max(0.0, build[1] - verify[1])  # a cache build that outlived verification
    lk = lookup[1] - lookup[0] if lookup else 0.0
    return {"wall": wall, "verify": v, "draft_busy": busy, "draft_exposed": exposed, "lookup": lk, "control": max(0.0, wall - v - exposed - lk)}


ArgsFn = Callable[[bool], tuple]
# one call to many workers at once: (workers, method, args) -> one future per worker
BroadcastFn = Callable[[Sequence[WorkerHandle], str, tuple], "list[Future[Timed]]"]


@dataclass
class Forwarded:
    """A call another worker places on ``worker`` for this coordinator:
    ``address`` is what that worker needs to send it (endpoint, server id,
    reply routing id, call id), ``future`` its answer, ``forget()`` withdraws it."""

    worker: WorkerHandle
    address: list[Any]
    future: "Future[Timed]"
    forget: Callable[[], None]


# register one forwarded call per worker: (workers, method) -> Forwarded per worker
ForwardFn = Callable[[Sequence[WorkerHandle], str], list[Forwarded]]


@dataclass
class _Lookups:
    """An SSD round's lookup calls in flight, and how to read their answers:
    ``at[j]`` is where the j-th live sequence's answer sits in each reply;
    ``kind`` is the backup a miss's answer carries (see ``RoundLoop._plans``)."""

    calls: list[tuple[WorkerHandle, "_Call"]]
    at: list[int]
    kind: str


@dataclass
class _Ahead:
    """The lookups the target places when verification ends (``RoundLoop._ahead``):
    ``then`` rides the verification call, ``forwarded`` are the calls registered
    at the drafts, ``plans`` what they carry per sequence of the round."""

    then: dict[str, Any]
    forwarded: list[Forwarded]
    plans: list[Plan] | None


def submit_each(workers: Sequence[WorkerHandle], method: str, args: tuple) -> "list[Future[Timed]]":
    """The plain broadcast: one call per worker (in process, or without a broadcast socket)."""
    return [w.submit(method, *args) for w in workers]


class _Call:
    """A worker call that survives the worker losing its state.

    ``args_fn(full)`` builds the call's arguments; ``full=True`` makes them
    self-contained: every sequence's whole history from position 0, and
    nothing that refers to another worker's data-plane transfers (a proposal's
    q rows become a point mass on its tokens — still exact, as the tokens do
    not depend on the verifier's randomness; a peer's KV delta is dropped). A
    worker that answers :class:`NeedsPrefillError` (it was restarted, or never
    saw a sequence) or :class:`TransferLost` gets the self-contained call; a
    worker that was lost mid-call is recovered first (blocking) — unless
    ``degradable``, in which case :class:`WorkerLost` reaches the caller,
    which carries on without it.
    """

    def __init__(self, worker: WorkerHandle, method: str, args_fn: ArgsFn, degradable: bool = False, fut: "Future[Timed] | None" = None) -> None:
        self.worker, self.method, self.args_fn, self.degradable = worker, method, args_fn, degradable
        self.fut = worker.submit(method, *args_fn(False)) if fut is None else fut  # ``fut``: already sent (a broadcast)
        self.resent = False  # the answer came from a self-contained re-send, not the first call

    def result(self, attempts: int = 3) -> Timed:
        for _ in range(attempts):
            try:
                return self.fut.result()
            except (NeedsPrefillError, TransferLost):
                pass
            except WorkerLost:
                if self.degradable:
                    raise
                log.warning("%s lost; recovering and re-prefilling", self.worker.name)
                self.worker.recover()
            self.resent = True
            self.fut = self.worker.submit(self.method, *self.args_fn(True))
        return self.fut.result()

    def value(self) -> tuple[Any, tuple[float, float]]:
        timed = self.result()
        return timed.value, (timed.start, timed.end)


def _released(worker: str, fut: "Future[Timed]") -> None:
    """Report how a release ended (see ``RoundLoop._release``)."""
    try:
        fut.result()
    except (WorkerLost, WorkerGone, NeedsPrefillError):
        log.info("release on %s skipped: its state is already gone", worker)
    except Exception as e:  # the sequences are finished either way; their room is lost until a restart
        log.warning("release on %s failed: %s", worker, e)


def _discarded(worker: str, fut: "Future[Timed]") -> None:
    """Report a discard that failed (see ``RoundLoop._discard``): its sender keeps the transfer until the data plane is rebuilt."""
    if fut.exception() is not None:
        log.info("discard on %s failed: %s", worker, fut.exception())


def _on_plane(x: Any) -> bool:
    """Is ``x`` (q rows, a KV delta) a data-plane reference rather than tensors here?"""
    return x is not None and not isinstance(x, (torch.Tensor, list, tuple))


def _regime(p: Proposal) -> bool | str:
    """The acceptance regime of a proposal for the fan-out estimator."""
    return p.source if p.source in ("neural", "fast") else False


def _clip(p: Proposal, n: int) -> Proposal:
    if len(p.tokens) <= n:
        return p
    return Proposal(p.tokens[:n], None if p.q is None else p.q[:n], p.source)


def _local(p: Proposal) -> Proposal:
    """``p`` without q rows that live on the data plane (see :class:`_Call`)."""
    return p if p.q is None or isinstance(p.q, torch.Tensor) else Proposal(p.tokens, None, p.source)


def _span(spans: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The time several workers' concurrent calls cover together."""
    return min(a for a, _ in spans), max(b for _, b in spans)


def _cat_rows(parts: list[Any]) -> Any:
    """Concatenate q blocks: tensors in process, data-plane references between actors."""
    if all(isinstance(x, torch.Tensor) for x in parts):
        return torch.cat(parts)
    return type(parts[0]).cat(parts)


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
    ) -> None:
        """``forward``: the transport can have the target place the SSD lookups
        on the drafts itself when verification ends (see :meth:`_round_ssd`)."""
        self.spec = spec
        self.target = target
        drafts = [] if draft is None else [draft] if not isinstance(draft, (list, tuple)) else list(draft)
        self.drafts = DraftPool(drafts)
        self.broadcast = broadcast
        self.forward = forward
        self.qualifier = qualifier
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.fanout = FanoutEstimator()
        # auto fan-outs spend the budget that delivers the most tokens/s at the batch
        # size (measured), never more than stays hidden behind verification
        self.budget = BudgetController(spec.budget)
        self.budget_search = BudgetSearch(spec.budget)
        self._spend = spec.budget  # the budget per sequence of this round's builds
        self._next_spend: int | None = None  # ... and of the next round's, fixed one round ahead
        # per sequence: the fan-outs promised to the only draft for this round's build
        # (NextRound; one per outcome until the outcome is known, see _plans)
        self._promised: dict[int, Plan] = {}
        self.backup_policy = BackupPolicy(spec.backup)
        self.backup_stats = BackupStats()
        self.timeline: deque[RoundRecord] = deque(maxlen=TIMELINE_ROUNDS)
        self._round_ids = itertools.count()  # round ids keep increasing when the timeline is full
        self._verify_seconds = 1.0  # latest verification time, the unit of relative latencies
        # the KV delta of each sequence's latest hit, and the draft that served it
        self._extensions: dict[int, tuple[WorkerHandle, Extension]] = {}

    # -------------------------------------------------------- draft health
    @property
    def draft_up(self) -> bool:
        """Is at least one draft usable now?"""
        return bool(self.drafts.up())

    @property
    def draft_failures(self) -> int:
        return self.drafts.failures

    def _draft_call(self, method: str, args_fn: ArgsFn, draft: WorkerHandle | None = None) -> _Call | None:
        """Submit to ``draft`` (default: the primary) unless none is up; ``None`` means: do without."""
        draft = draft or self.drafts.primary
        if draft is None:
            return None
        return _Call(draft, method, args_fn, degradable=True)

    def _draft_value(self, call: _Call | None) -> tuple[Any, tuple[float, float]] | None:
        if call is None:
            return None
        try:
            return call.value()
        except WorkerLost:
            self.drafts.lost(call.worker)
            return None

    def _fast(self, seqs: Sequence[SequenceState], ks: Sequence[int], blocks: Sequence[list[int]] | None = None) -> list[Proposal]:
        """Point-mass guesses from each sequence's history (the fast backup)."""
        blocks = blocks or [[] for _ in seqs]
        return [Proposal(ngram_guess(s.all_ids + b, k), None, "fast") for s, k, b in zip(seqs, ks, blocks)]

    # ------------------------------------------------------------ helpers
    @staticmethod
    def step(s: SequenceState, full: bool = False) -> SeqStep:
        """Where ``s`` stands: workers hold all but the last emitted token
        (before the first round: nothing — the whole prompt is new).
        ``full`` re-sends the whole history (a worker that lost its state)."""
        committed = len(s.all_ids) - 1 if s.output_ids and not full else 0
        ids = s.all_ids
        recent = ids[max(0, committed - RECENT_TOKENS) : committed]
        return SeqStep(s.seq_id, committed, ids[committed:], s.params, s.seed, len(s.output_ids), recent)

    @property
    def speculation_margin(self) -> int:
        """KV tokens a round may hold beyond the emitted ones (proposal + pending token)."""
        return max(self.spec.k, self.spec.lq + self.spec.ld) + 1

    def spec_len(self, s: SequenceState, k: int, ahead: int = 0) -> int:
        """Draft tokens worth proposing: never past max_tokens or the context
        (``ahead``: once ``s`` has emitted that many more tokens)."""
        remaining = s.params.max_tokens - len(s.output_ids) - ahead - 1
        room = self.max_context - len(s.all_ids) - ahead
        return max(0, min(k, remaining, room))

    def _fanout_for(self, proposal: Proposal, shards: int = 1) -> list[int]:
        """F_k for the outcomes of verifying ``proposal`` (its source sets the
        acceptance regime: a backup speculation is accepted differently),
        over ``shards`` drafts that each build a budget's worth."""
        return self._fanout(len(proposal.tokens), _regime(proposal), shards)

    def _fanout(self, k: int, regime: bool | str, shards: int = 1, spend: int | None = None) -> list[int]:
        """F_0..F_k at ``spend`` per draft (default: this round's budget)."""
        if self.spec.fanout == "auto":
            return self.fanout.allocation((spend or self._spend) * shards, k, after_backup=regime)
        return [f * shards for f in self.spec.fanout[: k + 1]]

    def _build_fanout(self, proposal: Proposal, promised: Plan, shards: int) -> list[int]:
        """The fan-out of a build over ``proposal``: the one promised to the
        only draft with the previous lookup when it is for this proposal (the
        draft may have built it already), else :meth:`_fanout_for` now."""
        if isinstance(promised, NextRound) and shards == 1:
            f = promised.after_hit if proposal.source == "cache" else promised.after_backup if proposal.source == promised.backup else None
            if f is not None and len(f) == len(proposal.tokens) + 1:
                return f
        return self._fanout_for(proposal, shards)

    def _emit(self, running: list[SequenceState], proposals: Sequence[Proposal], outcomes: Sequence[Outcome], rec: RoundRecord) -> None:
        for s, prop, out in zip(running, proposals, outcomes):
            s.emit(out.emitted(prop), self.eos_ids)
            s.rounds += 1
            s.accepted_total += out.accepted
            s.spec_rounds += int(out.proposed > 0)
            rec.accepted.append(out.accepted)

    def _release(self, seqs: Sequence[SequenceState]) -> None:
        """Free ``seqs`` on every worker, without waiting: each worker runs the
        release before anything asked of it later (the prefill that reuses the
        room included), and a draft may still be busy with the next build it
        started ahead — the round loop has nothing to wait for."""
        ids = [s.seq_id for s in seqs]
        if not ids:
            return
        for i in ids:
            self._extensions.pop(i, None)
        workers = [self.target, *self.drafts.up()] + ([self.qualifier] if self.qualifier is not None else [])
        for w in workers:
            w.submit("release", ids).add_done_callback(lambda f, name=w.name: _released(name, f))

    # -------------------------------------------------------------- run
    def admit(self, new: list[SequenceState]) -> list[SequenceState]:
        """Prefill new sequences on every worker concurrently (the target samples
        their first token) — they join the running batch at a round boundary.
        Returns those still running; finished ones are released and finalised."""
        if not new:
            return []
        rec = RoundRecord(index=next(self._round_ids), batch=len(new), start=time.perf_counter(), prefill=True)
        prefill = lambda full: ([self.step(s, full) for s in new],)  # noqa: E731
        call_t = _Call(self.target, "verify", lambda full: ([VerifyItem(self.step(s, full), Proposal([])) for s in new],))
        calls_d = [self._draft_call("prefill", prefill, d) for d in self.drafts.up()]
        call_q = None if self.qualifier is None else _Call(self.qualifier, "prefill", prefill)
        try:
            outcomes, rec.verify = call_t.value()
        finally:
            for call_d in calls_d:
                self._draft_value(call_d)
            if call_q is not None:
                call_q.result()
        self._emit(new, [Proposal([])] * len(new), outcomes, rec)
        rec.end = time.perf_counter()
        self.timeline.append(rec)
        return self._retire(new)

    def advance(self, running: list[SequenceState]) -> list[SequenceState]:
        """One round of the configured mode for every running sequence; returns
        those still running (finished ones are released and finalised)."""
        rec = RoundRecord(index=next(self._round_ids), batch=len(running), start=time.perf_counter())
        mode = self.spec.mode
        if mode == "ar":
            self._round_ar(running, rec)
        elif mode == "sd":
            self._round_sd(running, rec)
        elif mode == "ssd":
            self._round_ssd(running, rec)
        else:
            self._round_pyramid(running, rec)
        rec.end = time.perf_counter()
        if mode == "ssd":
            # what the round cost beyond its workers' time, for the backup policy's model
            self.backup_stats.observe_latency(t_round=round_components(rec.to_json())["control"] / self._verify_seconds)
        if mode == "ssd" and self.spec.fanout == "auto":
            self.budget_search.observe(rec.batch, sum(a + 1 for a in rec.accepted), rec.end - rec.start)
        self.timeline.append(rec)
        return self._retire(running)

    def release(self, seqs: list[SequenceState]) -> None:
        """Free unfinished sequences everywhere (cancellation or failure). An
        SSD sequence ended at a round boundary still holds the speculation its
        last lookup served for a round that will not run: the target takes
        its q rows (and the other drafts its KV delta) so the draft lets them go."""
        self._discard([self.target], [s.proposal.q for s in seqs if s.proposal is not None])
        for s in seqs:
            if s.seq_id in self._extensions:
                owner, ext = self._extensions[s.seq_id]
                self._discard([d for d in self.drafts.up() if d is not owner], [ext.kv])
        self._release(seqs)
        for s in seqs:
            self._finish_stats(s)

    def _retire(self, running: list[SequenceState]) -> list[SequenceState]:
        done = [s for s in running if s.finished]
        self._release(done)
        for s in done:
            self._finish_stats(s)
        return [s for s in running if not s.finished]

    def _verify(
        self,
        running: list[SequenceState],
        proposals: list[Proposal],
        rec: RoundRecord,
        rule: str = "exact",
        tau: float = 0.0,
        then: dict[str, Any] | None = None,
    ) -> _Call:
        """Send the verification; ``then`` (first attempt only) is the call the
        target places on the drafts when it is done (see :meth:`_round_ssd`)."""
        div = self.spec.div

        def args(full: bool) -> tuple:
            items = [VerifyItem(self.step(s, full), _local(p) if full else p, rule, tau, div) for s, p in zip(running, proposals)]
            return (items,) if then is None or full else (items, then)

        call = _Call(self.target, "verify", args)
        rec.sent = time.perf_counter()
        return call

    @staticmethod
    def _verified(call: _Call, rec: RoundRecord) -> list[Outcome]:
        """Wait for a verification; records its span and when its result arrived."""
        outcomes, rec.verify = call.value()
        rec.back = time.perf_counter()
        return outcomes

    def _round_ar(self, running: list[SequenceState], rec: RoundRecord) -> None:
        proposals = [Proposal([]) for _ in running]
        outcomes = self._verified(self._verify(running, proposals, rec), rec)
        self._emit(running, proposals, outcomes, rec)

    def _round_sd(self, running: list[SequenceState], rec: RoundRecord) -> None:
        ks = [self.spec_len(s, self.spec.k) for s in running]
        t0 = time.perf_counter()
        got = self._draft_value(self._draft_call("propose", lambda full: ([self.step(s, full) for s in running], ks)))
        if got is None:
            proposals, rec.draft = self._fast(running, ks), (t0, time.perf_counter())
        else:
            proposals, rec.draft = got
        outcomes = self._verified(self._verify(running, proposals, rec), rec)
        self._emit(running, proposals, outcomes, rec)

    # ---------------------------------------------------------------- SSD
    def _round_ssd(self, running: list[SequenceState], rec: RoundRecord) -> None:
        # The budget is fixed one round ahead: the next round's fan-outs go out with
        # this round's lookup, so that the only draft can start that build itself.
        decided = min(self.budget.budget, self.budget_search.budget(len(running)))
        self._spend, self._next_spend = self._next_spend or decided, decided
        promised, self._promised = self._promised, {}
        rec.budget = self._spend if self.spec.fanout == "auto" else None
        need = [s for s in running if s.proposal is None]
        if need:  # newly admitted sequences (a miss is served at its own round's lookup)
            rec.backup, rec.draft = self._backup(need, len(running))
        # a cached speculation may be longer than what is still worth verifying
        ks = [self.spec_len(s, self.spec.k) for s in running]
        proposals = [_clip(s.proposal, k) for s, k in zip(running, ks)]
        # a speculation clipped to nothing is never verified: its q rows are never fetched
        self._discard([self.target], [s.proposal.q for s, p in zip(running, proposals) if s.proposal.tokens and not p.tokens])
        # every draft that is up builds its share of the outcomes (one budget each)
        builders = self.drafts.up()
        shards = max(1, len(builders))
        share = shards > 1  # peers take the owner's KV delta instead of recomputing
        # one backup decision per round, for this round's misses
        kind = self._backup_kind(len(running))
        # Where the transport allows, the target itself places the lookups on the
        # drafts, with the real outcomes, the moment verification ends: the
        # drafts answer here, and this loop's own bookkeeping overlaps them.
        # Everything a lookup needs but the outcomes is known now.
        ahead = self._ahead(running, proposals, ks, builders, kind, share, rec.index)

        def send_builds() -> list[tuple[WorkerHandle, _Call]]:
            fanouts = [self._build_fanout(p, promised.get(s.seq_id), shards) for s, p in zip(running, proposals)]
            exts = [self._extensions.pop(s.seq_id, None) for s in running]

            def build_items(full: bool, shard: int, draft: WorkerHandle) -> tuple:
                return (
                    [
                        BuildItem(
                            self.step(s, full),
                            Proposal(p.tokens, None, p.source),  # the build needs the tokens only
                            f,
                            k,
                            self.spec.saguaro_c,
                            shard,
                            shards,
                            None if full or e is None or e[0] is draft else e[1],
                        )
                        for s, p, f, k, e in zip(running, proposals, fanouts, ks, exts)
                    ],
                    rec.index,
                )

            calls = ((d, self._draft_call("build", lambda full, i=i, d=d: build_items(full, i, d), d)) for i, d in enumerate(builders))
            return [(d, c) for d, c in calls if c is not None]

        # whichever of the two has been taking longer is sent first
        then = ahead.then if ahead else None
        if self.backup_stats.t_primary > 1.0:  # the build's moving average, in verification times
            calls_b = send_builds()
            call_v = self._verify(running, proposals, rec, then=then)
        else:
            call_v = self._verify(running, proposals, rec, then=then)
            calls_b = send_builds()
        outcomes = self._verified(call_v, rec)
        self._verify_seconds = max(rec.verify[1] - rec.verify[0], 1e-9)
        self._emit(running, proposals, outcomes, rec)
        self._narrow_promised(running, outcomes)
        live = [i for i, s in enumerate(running) if not s.finished]
        if ahead is not None and not call_v.resent:
            lookups = self._placed_lookups(ahead, outcomes, live, kind, share, rec)
        else:
            if ahead is not None:  # verification was re-sent: its lookups were never placed
                for f in ahead.forwarded:
                    f.forget()
            lookups = self._send_lookups(running, outcomes, live, ks, [d for d, _ in calls_b], kind, share, rec)
        built = [got for got in (self._draft_value(c) for _, c in calls_b) if got is not None]
        if built:
            rec.build = _span([span for _, span in built])  # a build started ahead: the span it really ran
            rec.ahead = any(isinstance(value, dict) and value.get("ahead") for value, _ in built)
            # when the build ended, from the verification's start, in verification times: the
            # round waits for a build that ends after verification, however early it began
            t_primary = (rec.build[1] - rec.verify[0]) / self._verify_seconds
            self.backup_stats.observe_latency(t_primary=t_primary)
            self.budget.observe(t_primary)
        for p, out in zip(proposals, outcomes):
            from_cache = p.source == "cache"
            self.backup_stats.observe_sequence(from_cache, out.accepted + 1, None if from_cache else p.source)
        if not live:  # every sequence finished: nothing to wait for (the target placed lookups anyway) ...
            for f in ahead.forwarded if ahead is not None and rec.forwarded else []:
                # ... but their answers' transfers must be taken, whenever they come
                f.future.add_done_callback(lambda fut, d=f.worker: self._drop_answer(d, fut))
            return
        self._take_lookups(running, proposals, outcomes, live, lookups, rec)
        missed = [running[i] for i in live if running[i].proposal is None]
        if missed:  # the fast backup, or the neural one from the primary when several drafts looked up
            rec.backup, rec.miss_backup = self._backup(missed, len(running), kind)

    def _placed_lookups(self, ahead: _Ahead, outcomes: list[Outcome], live: list[int], kind: str, share: bool, rec: RoundRecord) -> _Lookups:
        """The lookups the target placed when verification ended (one key per sequence of the round)."""
        rec.lookup_sent, rec.forwarded = rec.verify[1], True
        args = ([o.key for o in outcomes], share, rec.index, ahead.plans)
        calls = [(f.worker, _Call(f.worker, "lookup", lambda full: args, degradable=True, fut=f.future)) for f in ahead.forwarded]
        return _Lookups(calls, live, kind)

    def _send_lookups(
        self,
        running: list[SequenceState],
        outcomes: list[Outcome],
        live: list[int],
        ks: list[int],
        lookers: list[WorkerHandle],
        kind: str,
        share: bool,
        rec: RoundRecord,
    ) -> _Lookups:
        """The coordinator sends the live sequences' outcomes to every draft that
        is building, as one broadcast, without waiting for the builds: each draft
        runs the lookup after its build (a lookup that arrives first waits for it),
        so a build that outlives verification costs no extra round trip. The round
        id makes a lookup that overtook a re-sent build answer misses."""
        plans = self._plans([running[i] for i in live], [range(1)] * len(live), [ks[i] for i in live], lookers, kind)
        args = ([outcomes[i].key for i in live], share, rec.index, plans)
        futs = self.broadcast(lookers, "lookup", args) if live and lookers else []
        rec.lookup_sent = time.perf_counter() if futs else None
        calls = [(d, _Call(d, "lookup", lambda full: args, degradable=True, fut=f)) for d, f in zip(lookers, futs)]
        return _Lookups(calls, list(range(len(live))), kind)

    def _take_lookups(
        self, running: list[SequenceState], proposals: list[Proposal], outcomes: list[Outcome], live: list[int], lookups: _Lookups, rec: RoundRecord
    ) -> None:
        """Collect the drafts' answers: each live sequence's next proposal is a hit,
        else the backup its lookup made (the only draft's); observe hits and ranks."""
        answers: list[tuple[WorkerHandle, list[LookupResult]]] = []
        spans = []
        for d, c in lookups.calls:
            got = self._draft_value(c)
            if got is not None:
                answers.append((d, got[0]))
                spans.append(got[1])
        if spans:
            rec.lookup = _span(spans)
            rec.lookup_back = time.perf_counter()
        served = False
        kept: set[int] = set()  # the proposals and KV deltas this round uses (by id)
        for i, idx in zip(live, lookups.at):
            s, p, out = running[i], proposals[i], outcomes[i]
            cached, rank, backup = None, None, None
            for d, res in answers:
                r = res[idx]
                rank = r.rank if rank is None else rank
                backup = backup or r.backup
                if cached is None and r.proposal is not None:
                    cached = r.proposal
                    if r.extension is not None:
                        self._extensions[s.seq_id] = (d, r.extension)
                        kept.add(id(r.extension))
            hit = cached is not None
            self.fanout.observe(out.accepted, out.proposed, rank, after_backup=_regime(p), hit=hit)
            self.backup_stats.observe_lookup(_regime(p) or "cache", hit)
            s.lookups += 1
            s.hits += int(hit)
            rec.hits += int(hit)
            rec.misses += int(not hit)
            s.proposal = cached or backup  # neither: the round loop's backup serves it
            kept.add(id(s.proposal))
            served = served or (not hit and backup is not None)
        self._drop_lookups(answers, kept)
        if served and rec.lookup is not None:  # this lookup made backups for its misses
            rec.backup = lookups.kind
            self.backup_policy.served(lookups.kind)  # type: ignore[arg-type]
            if lookups.kind == "neural":  # drafting them is part of the lookup's time
                self.backup_stats.observe_latency(t_neural=(rec.lookup[1] - rec.lookup[0]) / self._verify_seconds)

    def _drop_lookups(self, answers: Sequence[tuple[WorkerHandle, Sequence[LookupResult]]], kept: set[int]) -> None:
        """Discard what lookups answered but the round does not use (``kept``:
        the ids of what it does): speculations for sequences that finished, a
        backup next to a hit, the KV deltas of unused hits."""
        qs = [p.q for _, res in answers for r in res for p in (r.proposal, r.backup) if p is not None and id(p) not in kept]
        self._discard([self.target], qs)
        for d, res in answers:
            kvs = [r.extension.kv for r in res if r.extension is not None and id(r.extension) not in kept]
            self._discard([x for x in self.drafts.up() if x is not d], kvs)

    def _drop_answer(self, draft: WorkerHandle, fut: "Future[Timed]") -> None:
        """Discard all of a lookup's answer, once it comes (a failed lookup sent nothing that stays)."""
        if not fut.cancelled() and fut.exception() is None:
            self._drop_lookups([(draft, fut.result().value)], set())

    def _discard(self, receivers: Sequence[WorkerHandle], refs: list[Any]) -> None:
        """Have ``receivers`` take the data-plane transfers behind ``refs``
        that nobody will resolve: until its receiver takes it, a transfer
        holds its tensor and a thread on the sender. Without waiting: each
        receiver takes them before anything asked of it later."""
        refs = [r for r in refs if _on_plane(r)]
        if not refs:
            return
        for w in receivers:
            w.submit("discard", refs).add_done_callback(lambda f, name=w.name: _discarded(name, f))

    def _ahead(
        self,
        running: list[SequenceState],
        proposals: list[Proposal],
        ks: list[int],
        lookers: list[WorkerHandle],
        kind: str,
        share: bool,
        round_id: int,
    ) -> _Ahead | None:
        """The lookups the target places itself when verification ends: the
        ``then`` of the verification call, the calls registered at each draft,
        and the plans they carry (:meth:`_plans`; the outcome will emit
        1 .. len(proposal) + 1 tokens)."""
        if self.forward is None or not lookers:
            return None
        plans = self._plans(running, [range(1, len(p.tokens) + 2) for p in proposals], ks, lookers, kind)
        forwarded = self.forward(lookers, "lookup")
        then = {"method": "lookup", "args": [share, round_id, plans], "to": [f.address for f in forwarded]}
        return _Ahead(then, forwarded, plans)

    def _backup_kind(self, batch_size: int) -> str:
        """``auto`` weighs the backups at the live batch size (a batch of b
        hits fully only with probability p_hit^b); without a draft: fast."""
        return self.backup_policy.choose(batch_size, self.backup_stats) if self.drafts.primary is not None else "fast"

    def _plans(
        self, seqs: list[SequenceState], emitted: list[range], ks: list[int], lookers: list[WorkerHandle], kind: str
    ) -> list[Plan] | None:
        """What a lookup by the only draft carries per sequence besides the
        outcome, once the sequence has emitted any of ``emitted[i]`` more
        tokens: the next round's :class:`NextRound` — its K, the backup of
        ``kind`` that serves a miss, and the fan-outs of its build (at the
        budget fixed for it) after a hit (this round's speculation, ``ks[i]``
        long, clipped to K) and after that backup. A single draft knows a miss
        is a miss, so it makes the backup in the same call and can start the
        next build itself; with several, a miss at one may be another's hit
        and each build needs the hit's KV delta: no plans (None). Near a
        length limit the next K depends on how many tokens the outcome emits:
        then the plan is one NextRound per outcome (``emitted[i]`` starts at
        1; see :func:`plan_for`). The plans are remembered as promised — the
        next round's build uses their fan-outs — and one per outcome is
        narrowed to the real outcome's when it is known (:meth:`_narrow_promised`)."""
        if len(lookers) != 1:
            return None
        # a NextRound depends on the next K and this round's only: one per pair, shared by
        # every sequence and outcome that has it (the fan-outs cost ~4 µs each to allocate)
        made: dict[tuple[int, int], NextRound] = {}

        def next_round(k: int, k_now: int) -> NextRound:
            if (k, k_now) not in made:
                after_hit = self._fanout(min(k_now, k), False, spend=self._next_spend)
                made[k, k_now] = NextRound(k, after_hit, kind, self._fanout(k, kind, spend=self._next_spend))
            return made[k, k_now]

        plans: list[Plan] = []
        for s, ns, k_now in zip(seqs, emitted, ks):
            table = [next_round(self.spec_len(s, self.spec.k, ahead=n), k_now) for n in ns]
            plans.append(table[0] if all(t is table[0] for t in table) else table)
        self._promised = {s.seq_id: p for s, p in zip(seqs, plans)}
        return plans

    def _narrow_promised(self, running: list[SequenceState], outcomes: list[Outcome]) -> None:
        """Each promised plan, now that the outcome it depended on is known."""
        for s, out in zip(running, outcomes):
            plan = self._promised.get(s.seq_id)
            if isinstance(plan, list):
                self._promised[s.seq_id] = plan_for(plan, out.accepted)

    def _backup(self, seqs: list[SequenceState], batch_size: int, kind: str | None = None) -> tuple[str, tuple[float, float]]:
        """Give ``seqs`` (no speculation yet, or a miss) a backup speculation
        of ``kind`` (default: the policy's choice now); returns the kind
        served and the drafting span."""
        kind = kind or self._backup_kind(batch_size)
        ks = [self.spec_len(s, self.spec.k) for s in seqs]
        t0 = time.perf_counter()
        got = None
        if kind == "neural":
            # Saguaro sampling applies to backup drafts too: F_j of the round that will verify them
            fanouts = [self._fanout(k, "neural") for k in ks]
            got = self._draft_value(
                self._draft_call("propose", lambda full: ([self.step(s, full) for s in seqs], ks, self.spec.saguaro_c, fanouts))
            )
        if got is None:
            kind = "fast"
            proposals, span = self._fast(seqs, ks), (t0, time.perf_counter())
        else:
            proposals, span = got
            self.backup_stats.observe_latency(t_neural=(span[1] - span[0]) / self._verify_seconds)
        for s, p in zip(seqs, proposals):
            p.source = kind
            s.proposal = p
        self.backup_policy.served(kind)  # type: ignore[arg-type]
        return kind, span

    # ------------------------------------------------------------ pyramid
    def _round_pyramid(self, running: list[SequenceState], rec: RoundRecord) -> None:
        spec = self.spec
        limits = [self.spec_len(s, spec.lq) for s in running]
        blocks: list[list[int]] = [[] for _ in running]
        block_q: list[list[Any]] = [[] for _ in running]
        t0 = time.perf_counter()
        while True:
            todo = [i for i, lim in enumerate(limits) if len(blocks[i]) < lim]
            if not todo:
                break
            seqs = [running[i] for i in todo]

            def sub(full: bool, todo: list[int] = todo) -> list[SeqStep]:
                out = []
                for i in todo:
                    st = self.step(running[i], full)
                    out.append(replace(st, new_tokens=st.new_tokens + blocks[i], output_pos=st.output_pos + len(blocks[i])))
                return out

            ks = [min(spec.ld, limits[i] - len(blocks[i])) for i in todo]
            got = self._draft_value(self._draft_call("propose", lambda full: (sub(full), ks)))
            drafts = self._fast(seqs, ks, [blocks[i] for i in todo]) if got is None else got[0]
            quals = _Call(
                self.qualifier,
                "qualify",
                lambda full: (
                    [QualifyItem(st, _local(d) if full else d, spec.stage1, spec.tau_q, spec.div) for st, d in zip(sub(full), drafts)],
                ),
            ).value()[0]
            for i, qp in zip(todo, quals):
                room = limits[i] - len(blocks[i])
                blocks[i].extend(qp.tokens[:room])
                if qp.q is not None:
                    block_q[i].append(qp.q[:room])
        rec.draft = (t0, time.perf_counter())
        proposals = [Proposal(b, _cat_rows(q) if q else None, "qualified") for b, q in zip(blocks, block_q)]
        outcomes = self._verified(self._verify(running, proposals, rec, spec.stage2, spec.tau_t), rec)
        self._emit(running, proposals, outcomes, rec)

    # -------------------------------------------------------------- stats
    def _finish_stats(self, s: SequenceState) -> None:
        s.proposal = None
        s.stats.update(
            rounds=s.rounds,
            mean_accepted=s.accepted_total / s.spec_rounds if s.spec_rounds else None,
            cache_hit_rate=(s.hits / s.lookups if s.lookups else None) if self.spec.mode == "ssd" else None,
            lossy=self.spec.lossy,
        )
