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

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from saguaro_ray.algorithms.backup import BackupPolicy, BackupStats
from saguaro_ray.algorithms.fanout import FanoutEstimator
from saguaro_ray.algorithms.ngram import ngram_guess
from saguaro_ray.config import SpeculationConfig
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.transport import WorkerHandle
from saguaro_ray.workers.messages import BuildItem, Outcome, Proposal, QualifyItem, SeqStep, VerifyItem

log = logging.getLogger(__name__)

RECENT_TOKENS = 4  # committed tokens each step repeats so a worker one token behind can catch up


@dataclass
class RoundRecord:
    """One round of the timeline (perf_counter seconds; None when not run)."""

    index: int
    batch: int
    verify: tuple[float, float] | None = None
    draft: tuple[float, float] | None = None  # SD drafting, pyramid drafting+qualifying, SSD backups
    build: tuple[float, float] | None = None  # SSD cache construction
    lookup: tuple[float, float] | None = None
    hits: int = 0
    misses: int = 0
    backup: str | None = None
    accepted: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    @property
    def hidden(self) -> bool | None:
        """SSD: was the cache build finished by the time verification ended?"""
        if self.build is None or self.verify is None:
            return None
        return self.build[1] <= self.verify[1]


def _timed(fut: Any) -> tuple[Any, tuple[float, float]]:
    timed = fut.result()
    return timed.value, (timed.start, timed.end)


def _regime(p: Proposal) -> bool | str:
    """The acceptance regime of a proposal for the fan-out estimator."""
    return p.source if p.source in ("neural", "fast") else False


def _clip(p: Proposal, n: int) -> Proposal:
    if len(p.tokens) <= n:
        return p
    return Proposal(p.tokens[:n], None if p.q is None else p.q[:n], p.source)


class RoundLoop:
    def __init__(
        self,
        spec: SpeculationConfig,
        target: WorkerHandle,
        eos_ids: tuple[int, ...],
        max_context: int,
        draft: WorkerHandle | None = None,
        qualifier: WorkerHandle | None = None,
    ) -> None:
        self.spec = spec
        self.target = target
        self.draft = draft
        self.qualifier = qualifier
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.fanout = FanoutEstimator()
        self.backup_policy = BackupPolicy(spec.backup)
        self.backup_stats = BackupStats()
        self.timeline: list[RoundRecord] = []
        self._verify_seconds = 1.0  # latest verification time, the unit of relative latencies

    # ------------------------------------------------------------ helpers
    @staticmethod
    def step(s: SequenceState) -> SeqStep:
        """Where ``s`` stands: workers hold all but the last emitted token
        (before the first round: nothing — the whole prompt is new)."""
        committed = len(s.all_ids) - 1 if s.output_ids else 0
        ids = s.all_ids
        recent = ids[max(0, committed - RECENT_TOKENS) : committed]
        return SeqStep(s.seq_id, committed, ids[committed:], s.params, s.seed, len(s.output_ids), recent)

    def spec_len(self, s: SequenceState, k: int) -> int:
        """Draft tokens worth proposing: never past max_tokens or the context."""
        remaining = s.params.max_tokens - len(s.output_ids) - 1
        room = self.max_context - len(s.all_ids)
        return max(0, min(k, remaining, room))

    def _fanout_for(self, proposal: Proposal) -> list[int]:
        """F_k for the outcomes of verifying ``proposal`` (its source sets the
        acceptance regime: a backup speculation is accepted differently)."""
        k = len(proposal.tokens)
        if self.spec.fanout == "auto":
            return self.fanout.allocation(self.spec.budget, k, after_backup=_regime(proposal))
        return list(self.spec.fanout[: k + 1])

    def _emit(self, running: list[SequenceState], proposals: Sequence[Proposal], outcomes: Sequence[Outcome], rec: RoundRecord) -> None:
        for s, prop, out in zip(running, proposals, outcomes):
            s.emit(out.emitted(prop), self.eos_ids)
            s.rounds += 1
            s.accepted_total += out.accepted
            s.spec_rounds += int(out.proposed > 0)
            rec.accepted.append(out.accepted)

    def _release(self, seqs: Sequence[SequenceState]) -> None:
        ids = [s.seq_id for s in seqs]
        if not ids:
            return
        futs = [w.submit("release", ids) for w in (self.target, self.draft, self.qualifier) if w is not None]
        for f in futs:
            f.result()

    # -------------------------------------------------------------- run
    def run(self, seqs: list[SequenceState]) -> None:
        """Generate until every sequence in ``seqs`` has finished (static batch)."""
        running: list[SequenceState] = []
        try:
            running = self.admit([s for s in seqs if not s.finished])
            while running:
                running = self.advance(running)
        finally:
            self.release(running)

    def admit(self, new: list[SequenceState]) -> list[SequenceState]:
        """Prefill new sequences on every worker concurrently (the target samples
        their first token) — they join the running batch at a round boundary.
        Returns those still running; finished ones are released and finalised."""
        if not new:
            return []
        steps = [self.step(s) for s in new]
        rec = RoundRecord(index=len(self.timeline), batch=len(new))
        fut_t = self.target.submit("verify", [VerifyItem(st, Proposal([])) for st in steps])
        others = [w.submit("prefill", steps) for w in (self.draft, self.qualifier) if w is not None]
        try:
            outcomes, rec.verify = _timed(fut_t)
        finally:
            for f in others:
                f.result()
        self._emit(new, [Proposal([])] * len(new), outcomes, rec)
        self.timeline.append(rec)
        return self._retire(new)

    def advance(self, running: list[SequenceState]) -> list[SequenceState]:
        """One round of the configured mode for every running sequence; returns
        those still running (finished ones are released and finalised)."""
        rec = RoundRecord(index=len(self.timeline), batch=len(running))
        mode = self.spec.mode
        if mode == "ar":
            self._round_ar(running, rec)
        elif mode == "sd":
            self._round_sd(running, rec)
        elif mode == "ssd":
            self._round_ssd(running, rec)
        else:
            self._round_pyramid(running, rec)
        self.timeline.append(rec)
        return self._retire(running)

    def release(self, seqs: list[SequenceState]) -> None:
        """Free unfinished sequences everywhere (cancellation or failure)."""
        self._release(seqs)
        for s in seqs:
            self._finish_stats(s)

    def _retire(self, running: list[SequenceState]) -> list[SequenceState]:
        done = [s for s in running if s.finished]
        self._release(done)
        for s in done:
            self._finish_stats(s)
        return [s for s in running if not s.finished]

    def _round_ar(self, running: list[SequenceState], rec: RoundRecord) -> None:
        items = [VerifyItem(self.step(s), Proposal([])) for s in running]
        outcomes, rec.verify = _timed(self.target.submit("verify", items))
        self._emit(running, [i.proposal for i in items], outcomes, rec)

    def _round_sd(self, running: list[SequenceState], rec: RoundRecord) -> None:
        steps = [self.step(s) for s in running]
        ks = [self.spec_len(s, self.spec.k) for s in running]
        proposals, rec.draft = _timed(self.draft.submit("propose", steps, ks))
        outcomes, rec.verify = _timed(self.target.submit("verify", [VerifyItem(st, p) for st, p in zip(steps, proposals)]))
        self._emit(running, proposals, outcomes, rec)

    # ---------------------------------------------------------------- SSD
    def _round_ssd(self, running: list[SequenceState], rec: RoundRecord) -> None:
        steps = [self.step(s) for s in running]
        need = [i for i, s in enumerate(running) if s.proposal is None]
        if need:  # the first round, or misses: the backup speculator serves them
            self._backup([running[i] for i in need], [steps[i] for i in need], rec)
        # a cached speculation may be longer than what is still worth verifying
        proposals = [_clip(s.proposal, self.spec_len(s, self.spec.k)) for s in running]
        builds = [
            BuildItem(st, p, self._fanout_for(p), self.spec_len(s, self.spec.k), self.spec.saguaro_c)
            for s, st, p in zip(running, steps, proposals)
        ]
        fut_v = self.target.submit("verify", [VerifyItem(st, p) for st, p in zip(steps, proposals)])
        fut_b = self.draft.submit("build", builds)
        outcomes, rec.verify = _timed(fut_v)
        _, rec.build = _timed(fut_b)
        self._verify_seconds = max(rec.verify[1] - rec.verify[0], 1e-9)
        self.backup_stats.observe_latency(t_primary=(rec.build[1] - rec.build[0]) / self._verify_seconds)
        self._emit(running, proposals, outcomes, rec)
        for p, out in zip(proposals, outcomes):
            from_cache = p.source == "cache"
            self.backup_stats.observe_sequence(from_cache, out.accepted + 1, None if from_cache else p.source)
        live = [(s, p, out) for s, p, out in zip(running, proposals, outcomes) if not s.finished]
        if not live:
            return
        keys = [(s.seq_id, o.accepted, o.next_token) for s, _, o in live]
        results, rec.lookup = _timed(self.draft.submit("lookup", keys))
        for (s, p, out), (cached, rank) in zip(live, results):
            hit = cached is not None
            self.fanout.observe(out.accepted, out.proposed, rank, after_backup=_regime(p), hit=hit)
            s.lookups += 1
            s.hits += int(hit)
            rec.hits += int(hit)
            rec.misses += int(not hit)
            s.proposal = cached

    def _backup(self, seqs: list[SequenceState], steps: list[SeqStep], rec: RoundRecord) -> None:
        kind = self.backup_policy.choose(len(seqs), self.backup_stats)
        rec.backup = kind
        ks = [self.spec_len(s, self.spec.k) for s in seqs]
        if kind == "neural":
            proposals, span = _timed(self.draft.submit("propose", steps, ks, self.spec.saguaro_c))
            rec.draft = span
            self.backup_stats.observe_latency(t_neural=(span[1] - span[0]) / self._verify_seconds)
        else:
            t0 = time.perf_counter()
            proposals = [Proposal(ngram_guess(s.all_ids, kk), None, "fast") for s, kk in zip(seqs, ks)]
            rec.draft = (t0, time.perf_counter())
        for s, p in zip(seqs, proposals):
            p.source = kind
            s.proposal = p

    # ------------------------------------------------------------ pyramid
    def _round_pyramid(self, running: list[SequenceState], rec: RoundRecord) -> None:
        spec = self.spec
        steps = [self.step(s) for s in running]
        limits = [self.spec_len(s, spec.lq) for s in running]
        blocks: list[list[int]] = [[] for _ in running]
        block_q: list[list[Any]] = [[] for _ in running]
        t0 = time.perf_counter()
        while True:
            todo = [i for i, lim in enumerate(limits) if len(blocks[i]) < lim]
            if not todo:
                break
            sub = [
                replace(steps[i], new_tokens=steps[i].new_tokens + blocks[i], output_pos=steps[i].output_pos + len(blocks[i]))
                for i in todo
            ]
            ks = [min(spec.ld, limits[i] - len(blocks[i])) for i in todo]
            drafts = self.draft.submit("propose", sub, ks).result().value
            quals = self.qualifier.submit(
                "qualify", [QualifyItem(st, d, spec.stage1, spec.tau_q, spec.div) for st, d in zip(sub, drafts)]
            ).result().value
            for i, qp in zip(todo, quals):
                room = limits[i] - len(blocks[i])
                blocks[i].extend(qp.tokens[:room])
                if qp.q is not None:
                    block_q[i].append(qp.q[:room])
        rec.draft = (t0, time.perf_counter())
        proposals = [Proposal(b, torch.cat(q) if q else None, "qualified") for b, q in zip(blocks, block_q)]
        items = [VerifyItem(st, p, spec.stage2, spec.tau_t, spec.div) for st, p in zip(steps, proposals)]
        outcomes, rec.verify = _timed(self.target.submit("verify", items))
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
