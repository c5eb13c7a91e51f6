"""``auto``'s exploration: which trial round to run, when, and what trials may cost.

Without trials a K or mode not run lately would be judged forever by stale numbers; with too
many, auto pays for them (``docs/auto.md``, "Exploration"). :class:`Trials` keeps the budget
(``explore`` of the wall time observed, less what trials measured beyond the rate of the choice
they displaced and the catch-ups they sent), the count of rounds that explored, and the
explorations in progress (an SSD entry is held for a few rounds: its first measures no hit rate;
a trial waits while its drafts catch up); :meth:`Trials.try_explore`
picks the most promising neighbouring choice of the search's, priced by the round-time model of
:mod:`~saguaro_ray.algorithms.strategy_search`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable

from saguaro_ray.algorithms.strategy_search import Costs, Group, Load, evaluate, round_of
from saguaro_ray.algorithms.strategy_views import Choice, RoundCosts

log = logging.getLogger(__name__)

EXPLORE_MARGIN = 0.3  # a choice whose drafting cost is uncertain is explored within this share of the best
EVIDENCE_MIN = 3.0  # fewer (decayed) rounds than this behind a cost: its estimate is uncertain
TRIAL_WINDOW = 256  # the exploration budget holds at most explore × this many mean rounds' time
# an exploration into SSD runs past its entry (a forced miss, no hit rate) until about this many
# lookups were seen, at most _ENTRY_EXPLORE_MAX rounds in all
_ENTRY_EXPLORE_LOOKUPS = 8
_ENTRY_EXPLORE_MAX = 6


def neighbours(g: Group) -> list[tuple[str, int]]:
    """The choices a trial may move ``g`` to from its current one: K ± 1, SD ⇄ SSD, AR ⇄ K = 1."""
    mode, k = g.opt
    if mode == "ar":
        return [(m, 1) for m in ("sd", "ssd") if m in g.modes and g.cap >= 1]
    out = [(mode, kk) for kk in (k - 1, k + 1) if 1 <= kk <= g.cap]
    other = "ssd" if mode == "sd" else "sd"
    if other in g.modes:
        out.append((other, k))
    if k == 1:
        out.append(("ar", 0))
    return out


class Trials:
    """The exploration budget and the trials it pays for (module docstring).

    ``share``: the largest share of rounds that may explore, and of wall time
    that trial rounds may cost beyond the choices they displace; ``seed``:
    the tie-break between equally promising trials (the only randomness);
    ``decay``: per round, of the mean round time the budget's cap is counted in."""

    def __init__(self, share: float, seed: int, decay: float) -> None:
        self.share = share
        self._decay = decay
        self._rng = random.Random(seed)
        self.chosen = 0  # rounds chosen (searched or scheduled)
        self.explored = 0  # ... of which explored
        self.budget_s = 0.0  # share × wall time observed, less what trials cost
        self.rate: float | None = None  # the round just chosen is a trial: the rate it is charged against
        self.spent_s = 0.0  # seconds trials measured beyond their reference rates
        self.ref = 0.0  # the rate the exploration in progress displaced
        self.wall_s = 0.0  # wall time observed
        self._wall_mean: float | None = None  # decayed mean round time (the budget's cap)
        self.held: dict[int, tuple[Choice, int]] = {}  # an exploration in progress: per sequence, choice and rounds left

    def charge(self, costs: RoundCosts) -> None:
        """Credit the budget with ``share`` of the round's wall time (capped); a
        trial round is charged what it took beyond the time its tokens would have
        taken at its reference rate."""
        wall = costs.wall_s
        if not (wall >= 0.0 and math.isfinite(wall)):
            self.rate = None
            return
        self.wall_s += wall
        self._wall_mean = wall if self._wall_mean is None else self._decay * self._wall_mean + (1.0 - self._decay) * wall
        cap = self.share * TRIAL_WINDOW * self._wall_mean
        self.budget_s = min(cap, self.budget_s + self.share * wall)
        if self.rate:
            tokens = sum(min(r.accepted, r.proposed) + 1 for r in costs.seqs)
            excess = max(0.0, wall - tokens / self.rate)
            self.budget_s -= excess
            self.spent_s += excess
        self.rate = None

    def age_holds(self, waiting: set[int]) -> None:
        """One round of every exploration in progress has run — but for the sequences in
        ``waiting``, whose round runs AR while their drafts catch up: it measured nothing of
        the trial, which keeps its rounds (aged regardless, a trial held 2 rounds at batch 8
        expired in the catch-up it had sent, which 8 sequences' missed tokens make longer than
        a round: the catch-up's work was for nothing and the choice never measured)."""
        self.held = {s: (c, left - (s not in waiting)) for s, (c, left) in self.held.items() if left > 1 or s in waiting}

    def held_round(self) -> None:
        """The round runs an exploration in progress: counted, and charged against its reference."""
        self.explored += 1
        self.rate = self.ref

    def try_explore(
        self,
        groups: list[Group],
        base: Load,
        costs: Costs,
        best: float,
        optimistic: Callable[[Group], Group],
        evidence: Callable[[str], float],
    ) -> None:
        """Maybe move every group at one choice to a neighbouring choice (all groups at that
        choice move: the cost fits learn from what the whole round does). A neighbour is a
        candidate if it could beat ``best`` valued by ``optimistic`` (acceptance and hit rates
        some standard errors up: if they hold, the choice is kept, so its switch is amortised
        as any), else if what its mode costs beyond verification rests on under
        :data:`EVIDENCE_MIN` recent rounds (``evidence``) and it comes within
        :data:`EXPLORE_MARGIN` of the best after a one-round excursion's full switch cost."""
        if self.budget_s <= 0.0 or self.explored + 1 > self.share * self.chosen:
            return
        opts = [g.opt for g in groups]
        ups: dict[int, Group] = {}
        # (kind, -score, tie-break, from, to): optimistic candidates rank before blind cost
        # checks, whose inflated score is no estimate to compare with theirs
        candidates: list[tuple[int, float, float, tuple[str, int], tuple[str, int]]] = []
        trials: dict[tuple[tuple[str, int], tuple[str, int]], tuple[list[int], list[tuple[str, int]], tuple[float, float]]] = {}
        for opt in dict.fromkeys(opts):
            for alt in neighbours(next(g for g in groups if g.opt == opt)):
                moved = [i for i, g in enumerate(groups) if g.opt == opt and alt in neighbours(g)]
                trial = [alt if i in moved else o for i, o in enumerate(opts)]
                excursions = [(len(groups[i].members), groups[i].excursion(alt)) for i in moved]
                cost = (-sum(n * x[0] for n, x in excursions), sum(n * x[1] for n, x in excursions))
                trials[opt, alt] = (moved, trial, cost)
                for i in moved:
                    if i not in ups:
                        ups[i] = optimistic(groups[i])
                up = [ups[i] if i in moved else g for i, g in enumerate(groups)]
                score = evaluate(up, trial, base, costs)[0]
                if score > best:
                    candidates.append((0, -score, self._rng.random(), opt, alt))
                elif evidence(alt[0]) < EVIDENCE_MIN:
                    score = evaluate(groups, trial, base, costs, cost)[0]
                    if score > (1.0 - EXPLORE_MARGIN) * best:
                        candidates.append((1, -score, self._rng.random(), opt, alt))
        if not candidates:
            return
        _, _, _, opt, alt = min(candidates)
        moved, trial, cost = trials[opt, alt]
        moved_groups = [groups[i] for i in moved]
        # a lagging group's first trial round runs AR while its drafts catch up: the trial is
        # held past it (and past every round the catch-up takes: age_holds)
        wait = int(alt[0] != "ar" and any(g.lagging for g in moved_groups))
        rounds = 1
        if alt[0] == "ssd" and not all(g.in_ssd for g in moved_groups):
            # held past the entry (a forced miss that measures no hit rate) for enough lookups
            lookups = sum(len(g.members) for g in moved_groups)
            rounds = min(_ENTRY_EXPLORE_MAX, 1 + -(-_ENTRY_EXPLORE_LOOKUPS // lookups))
        e, t, _ = round_of(groups, trial, base, costs, cost)
        if rounds * max(0.0, t - e / best) > self.budget_s or self.explored + rounds > self.share * self.chosen:
            return  # the most promising waits until the budget covers all its rounds
        log.debug("auto explores %s instead of %s for %d sequence(s)", alt, opt, sum(len(g.members) for g in moved_groups))
        self.explored += 1
        self.rate = self.ref = best  # held rounds are charged against the same rate
        # the catch-up a lagging group's trial sends slows rounds that are not the trial's: paid now
        catch_up = sum(len(g.members) * g.catch_up_s for g in moved_groups) if alt[0] != "ar" else 0.0
        self.budget_s -= catch_up
        self.spent_s += catch_up
        for g in moved_groups:
            g.opt = alt
            if rounds - 1 + wait > 0:
                self.held.update({s: (Choice(*alt), rounds - 1 + wait) for s in g.seq_ids})
