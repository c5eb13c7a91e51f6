"""``auto``'s AR guard: measured speculation that runs slower than measured AR gives way to AR.

Whatever the cost model gets wrong, speculation must never lose to AR; this compares what the
rounds measured, per context, and nothing else (see the guard's paragraph in
:mod:`saguaro_ray.algorithms.strategy_model`).

A speculating round is measured under its *arm*: the modes its sequences speculated with
(:meth:`ARGuard.arm`), so a choice is judged by rounds that ran the same modes and K. With one arm for
every kind of speculation, rounds of requests that fixed a slow strategy judged ``auto``'s: on
the demo's engine (real model, batch 4), four requests fixed to PyramidSD (0.88x AR) ran just
before four ``auto`` ones, and the guard held these at AR for 52 of their 54 rounds although SSD,
what the model chose for them, had just measured 1.10x AR.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from saguaro_ray.algorithms.strategy_views import temperature_bucket

GUARD_DECAY = 0.9  # per round of an arm: its measured rate weighs its last ~10 rounds
GUARD_EVIDENCE = 3.0  # decayed rounds each arm needs before the guard compares them
GUARD_MARGIN = 0.03  # speculation gives way only when it measures this much below AR
GUARD_RETEST = 16  # a context held at AR lets the model's choice run at most once every this many rounds
# a re-test whose rounds measured nothing steady (they rebuilt SSD's cache) runs again on the next
# round, for at most this many rounds; rounds that wait for drafts to catch up are not counted (a
# catch-up over 8 sequences outlasts several rounds: counted, it expired re-tests it was sent for)
RETEST_PENDING = 4


class ARGuard:
    """Measured tokens/s of speculating rounds against AR rounds, per context (module docstring)."""

    def __init__(self) -> None:
        self._arms: dict[tuple[tuple[int, tuple[int, ...]], tuple[tuple[str, int], ...]], tuple[float, float, float]] = {}  # -> (tokens, seconds, weight)
        self._holds: dict[tuple[int, tuple[int, ...]], int] = {}
        # AR's rate measured by the engine's start-up probe, per batch size's power of two: what
        # speculation must beat before AR rounds were run (they then replace it)
        self._ar_prior: dict[int, float] = {}
        # re-tests in progress: the arm's weight when it was let through (unchanged: nothing measured yet), rounds left
        self._retesting: dict[tuple[tuple[int, tuple[int, ...]], tuple[tuple[str, int], ...]], tuple[float, int]] = {}
        self.held = 0  # rounds whose speculating choice gave way to AR (to measure it, or because it is faster)
        self.retest_rate: float | None = None  # set by a hold() that let a re-test through: AR's measured rate
        self.measuring = False  # set by a hold() that runs AR to measure its rate

    @staticmethod
    def context(batch: int, temperatures: Sequence[float]) -> tuple[int, tuple[int, ...]]:
        return (max(0, batch).bit_length(), tuple(sorted({temperature_bucket(t) for t in temperatures})))

    @staticmethod
    def arm(choices: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
        """A round's arm: the (mode, K) its sequences speculated with (``()``: an AR round).
        K is part of it: on the bench's engine, requests fixed to SSD at K = 4 (0.82x AR at
        batch 8, T = 0.7) made ``auto``'s SSD at K = 1 give way to AR from its first round."""
        return tuple(sorted({(m, k) for m, k in choices if m != "ar" and k > 0}))

    def add(self, context: tuple[int, tuple[int, ...]], arm: tuple[tuple[str, int], ...], tokens: float, seconds: float) -> None:
        if not seconds > 0 or not math.isfinite(seconds):
            return
        tok, sec, w = self._arms.get((context, arm), (0.0, 0.0, 0.0))
        self._arms[context, arm] = (GUARD_DECAY * tok + tokens, GUARD_DECAY * sec + seconds, GUARD_DECAY * w + 1.0)

    def seed_ar(self, batch: int, seconds: float) -> None:
        """AR's round at ``batch`` sequences as the start-up probe timed its target call:
        the guard compares with it until AR rounds of that batch size were measured, so
        a fresh engine spends no AR round (and, in SSD, no cache rebuild after it) only
        to learn AR's rate."""
        if batch > 0 and seconds > 0 and math.isfinite(seconds):
            self._ar_prior[batch.bit_length()] = batch / seconds

    def hold(
        self, context: tuple[int, tuple[int, ...]], arm: tuple[tuple[str, int], ...], budget_s: float = math.inf, leave_s: float = 0.0,
        waiting: bool = False,
    ) -> bool:
        """Should a speculating choice in ``context``, whose round would run ``arm``, give way to AR this round?
        Yes while AR measures faster — but for a re-test: at most every
        :data:`GUARD_RETEST`-th round, and only when ``budget_s`` (the policy's
        exploration budget, in seconds) covers what one speculating round
        measures beyond AR's time for its tokens (then :attr:`retest_rate` is
        AR's rate, the reference the policy charges the round against). And,
        to have the rate speculation must beat, every :data:`GUARD_RETEST`-th
        round while AR's is not known yet — once ``budget_s`` covers
        ``leave_s``, what leaving the choice for a round costs (SSD's cache
        rebuilt on return; then :attr:`measuring` is set and the policy pays it).
        ``waiting``: the round runs AR while drafts catch up — a re-test in progress
        keeps its rounds (:data:`RETEST_PENDING` counts the rounds that could run it)."""
        self.retest_rate, self.measuring = None, False
        plain, spec = self._arms.get((context, ())), self._arms.get((context, arm))
        if (plain is None or plain[2] < GUARD_EVIDENCE) and context[0] in self._ar_prior:
            plain = (self._ar_prior[context[0]], 1.0, GUARD_EVIDENCE)  # the probe's AR until rounds measure it
        if plain is None or plain[2] < GUARD_EVIDENCE:
            # AR's rate unknown: measured every GUARD_RETEST-th speculating round, whatever the arm
            # (counted per arm, a choice that moved K would put it off)
            n = self._holds[context] = self._holds.get(context, 0) + 1
            hold = self.measuring = n >= GUARD_RETEST and leave_s <= budget_s
            if hold:
                self._holds[context] = 0
                self.held += 1
            return hold
        if spec is None or spec[2] < GUARD_EVIDENCE:
            return False
        pending = self._retesting.pop((context, arm), None)
        if pending is not None and pending[0] == spec[2] and pending[1] > 0:
            # the re-test measured no steady round yet (a round the guard does not count): it runs again
            self._retesting[context, arm] = (pending[0], pending[1] - (not waiting))
            self.retest_rate = plain[0] / plain[1]
            return False
        n = self._holds[context] = self._holds.get(context, 0) + 1
        ar_rate = plain[0] / plain[1]
        hold = spec[0] / spec[1] < (1.0 - GUARD_MARGIN) * ar_rate
        if hold and n >= GUARD_RETEST and spec[1] / spec[2] - spec[0] / spec[2] / ar_rate <= budget_s:
            hold, self._holds[context], self.retest_rate = False, 0, ar_rate
            self._retesting[context, arm] = (spec[2], RETEST_PENDING)
        self.held += hold
        return hold
