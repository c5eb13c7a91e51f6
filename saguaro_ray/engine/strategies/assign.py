"""Which mode and K each running sequence runs this round.

A sequence whose request fixed its strategy runs that (``sd``/``ssd`` with
its K, ``ar``, ``pyramid``); an ``auto`` sequence runs what the engine's
:class:`Policy` picks for it, knowing the fixed ones it shares the round
with (every sequence shares the round's time). After the round the policy
is told what the round cost, per sequence and per part, so it keeps fitting
its cost model on this deployment. A sequence that leaves SSD lets go of its
cached speculation; any mode and K is exact, so a pick changes speed only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from saguaro_ray.algorithms.strategy_model import AutoPolicy
from saguaro_ray.algorithms.strategy_views import Choice, RoundCosts, SeqResult, SeqView
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import RoundRecord, round_components

if TYPE_CHECKING:
    from saguaro_ray.engine.round_loop import RoundLoop


class Policy(Protocol):
    def choose(self, auto: Sequence[SeqView], fixed: Sequence[tuple[SeqView, Choice]] = ()) -> list[Choice]:
        """One choice per ``auto`` sequence, knowing the ``fixed`` ones beside them."""

    def observe(self, costs: RoundCosts) -> None:
        """What a finished round cost."""


class Assigner:
    def __init__(self, loop: "RoundLoop", policy: Policy | None = None) -> None:
        self.loop = loop
        menu = loop.menu
        if policy is None and "auto" in menu.allowed:
            policy = AutoPolicy(modes=menu.auto_modes, max_k=menu.max_k)
        self.policy = policy
        self._seen: dict[int, tuple[int, int]] = {}  # per sequence: (hits, lookups) before the round
        self._context: dict[int, int] = {}  # ... and the tokens it held
        self.sequence_rounds: dict[str, int] = {}  # sequence-rounds run per mode, since start (engine metrics)

    def assign(self, running: list[SequenceState], rec: RoundRecord) -> None:
        """Set each sequence's ``mode`` and ``k`` for this round."""
        loop = self.loop
        picks: dict[int, tuple[str, int]] = {}
        auto: list[SequenceState] = []
        for s in running:
            strategy = loop.strategy_of(s)
            if strategy.mode == "auto":
                auto.append(s)
            else:
                picks[s.seq_id] = (strategy.mode, loop.spec.lq if strategy.mode == "pyramid" else strategy.k or 0)
        if auto:
            modes = loop.menu.auto_modes if loop.draft_up else ("ar",)
            views = [
                SeqView(
                    s.seq_id, s.params.temperature, loop.spec_len(s, loop.strategy_of(s).k or 0), modes, s.mode, loop.lagging(s),
                    loop.catch_up_size(s), len(s.all_ids),
                )
                for s in auto
            ]
            fixed = [
                (
                    SeqView(s.seq_id, s.params.temperature, picks[s.seq_id][1], ("ar",), s.mode, context=len(s.all_ids)),
                    Choice(*picks[s.seq_id]),
                )
                for s in running
                if s.seq_id in picks
            ]
            choices = self.policy.choose(views, fixed)  # type: ignore[union-attr]
            ready = loop.drafts_ready([s for s, v, c in zip(auto, views, choices) if c.mode != "ar" and c.mode in v.modes], rec)
            rec.catching_up = loop.catching_up()
            for s, v, c in zip(auto, views, choices):
                mode = c.mode if s.seq_id in ready else "ar"  # ready: a drafting mode the sequence may run, drafts caught up
                picks[s.seq_id] = (mode, 0 if mode == "ar" else max(1, min(c.k, loop.strategy_of(s).k or 1)))
            prediction = getattr(self.policy, "prediction", None)
            if prediction is not None:
                # what auto predicted for its choice and the runner-up; ``not_ready``: sequences it
                # chose to speculate that ran AR while their drafts caught up (its misprediction, too)
                not_ready = sum(1 for s, c in zip(auto, choices) if c.mode != "ar" and picks[s.seq_id][0] == "ar")
                rec.auto = {**prediction, "not_ready": not_ready}
        leaving = [s for s in running if s.mode == "ssd" and picks[s.seq_id][0] != "ssd"]
        if leaving:
            loop.strategies["ssd"].left(leaving)
        for s in running:
            s.mode, s.k = picks[s.seq_id]
            s.chosen[s.mode] = s.chosen.get(s.mode, 0) + 1
            s.k_total += s.k if s.mode != "ar" else 0
            rec.modes[s.mode] = rec.modes.get(s.mode, 0) + 1
            self.sequence_rounds[s.mode] = self.sequence_rounds.get(s.mode, 0) + 1
        self._seen = {s.seq_id: (s.hits, s.lookups) for s in running}
        self._context = {s.seq_id: len(s.all_ids) for s in running}

    def metrics(self) -> dict[str, Any]:
        """What the engine chose so far: sequence-rounds per mode, and the policy's state."""
        snapshot = getattr(self.policy, "snapshot", None)
        return {"sequence_rounds": dict(self.sequence_rounds), "policy": snapshot() if snapshot is not None else None}

    def observe(self, running: list[SequenceState], rec: RoundRecord) -> None:
        """Tell the policy what the round just ended cost (``rec`` is complete)."""
        if self.policy is None or rec.verify is None:
            return
        seqs = []
        for s, proposed, accepted in zip(running, rec.proposed, rec.accepted):
            hits, lookups = self._seen.get(s.seq_id, (s.hits, s.lookups))
            hit = bool(s.hits - hits) if s.mode == "ssd" and s.lookups > lookups else None
            ssd = s.mode == "ssd"
            seqs.append(
                SeqResult(
                    s.seq_id, s.params.temperature, s.mode or "ar", proposed, accepted, hit, s.served if ssd else None, ssd and s.rebuilt,
                    s.built if ssd else 0, self._context.get(s.seq_id, 0),
                )
            )
        parts = round_components(rec)
        if rec.auto is not None:  # beside auto's prediction, what the round then took
            rec.auto["measured"] = {"tokens": sum(rec.accepted) + len(rec.accepted), "seconds": parts["wall"]}
        sequential = [s for s in running if s.mode in ("sd", "pyramid")]
        drafted = rec.draft[1] - rec.draft[0] if rec.draft is not None and sequential else 0.0
        n_ssd = sum(1 for s in running if s.mode == "ssd")
        self.policy.observe(
            RoundCosts(
                batch=len(running),
                verify_tokens=sum(rec.proposed) + len(rec.proposed),
                verify_s=parts["verify"],
                draft_steps=max((s.k for s in sequential), default=0),
                draft_batch=len(sequential),
                draft_s=drafted,
                ssd_batch=n_ssd,
                ssd_exposed_s=self._ssd_exposed(parts, drafted) if n_ssd else 0.0,
                wall_s=parts["wall"],
                seqs=tuple(seqs),
                ssd_build_s=rec.build[1] - rec.verify[0] if rec.build is not None and n_ssd else math.nan,
                catch_up_sent=rec.catch_up_sent,
                catching_up=rec.catching_up,
            )
        )

    @staticmethod
    def _ssd_exposed(parts: dict[str, float], drafted: float) -> float:
        """What SSD drafting added to the round's critical path: the build's
        overrun, backups drafted after the lookup, and the lookup itself — with
        one draft a miss's neural backup (K sequential draft steps) is drafted
        inside the lookup call, and the round waits for its answer. Counted as
        control plane instead, a miss and a longer K looked free to the policy
        (its backup terms fitted to 0 on the zoo and the real model)."""
        return max(0.0, parts["draft_exposed"] - drafted) + parts["lookup"]
