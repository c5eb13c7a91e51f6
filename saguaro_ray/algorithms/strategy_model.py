"""The ``auto`` strategy: which fixed strategy each sequence runs next round, from costs fitted online.

Every strategy is exact (each proposal is verified against the target's law
with the law it was drawn from), so the choice changes speed only. Before a
round :class:`AutoPolicy` picks, for every ``auto`` sequence, AR (K = 0), SD
with K or SSD with K so as to maximise the batch's expected emitted tokens
per second of the round, Σ_i E_i(mode_i, K_i) / T(the whole assignment), with
the batch's fixed-strategy sequences in both sums (they share the round);
:meth:`AutoPolicy.observe` then fits what the round cost.

``docs/auto.md`` explains the model term by term and why each term is there
(verification, SD drafting, SSD's build overrun and lookup, control plane, the
tokens a sequence holds, acceptance per position and temperature, switching
costs), the AR guard, the Dinkelbach search over groups of alike sequences,
the time-charged exploration and the cold start. This module learns (the fits, acceptance and
hit rates, from every round), groups the batch and decides (cold start,
search, guard, trials); the round-time model and its search are
:mod:`~saguaro_ray.algorithms.strategy_search` (one module: the search
linearises exactly the model it evaluates), the trials and their budget
:mod:`~saguaro_ray.algorithms.strategy_explore`, the estimators
:mod:`~saguaro_ray.algorithms.strategy_fits`, the guard
:mod:`~saguaro_ray.algorithms.strategy_guard`, and the data the engine and
the policy exchange :mod:`~saguaro_ray.algorithms.strategy_views`. What is
left here (~630 lines) is one concept, the policy's state and its use: every
fit, the per-sequence statistics, the sequences entering, rebuilding or leaving SSD and
what switching costs are read by the choice and written by the observation of
the round it made; split apart, each half would reach into the other's state.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from saguaro_ray.algorithms.strategy_fits import Acceptance, CostPerUnit, EwLeastSquares, ExcessRatio, HitRates, KneeFit, held_costs
from saguaro_ray.algorithms.strategy_explore import Trials
from saguaro_ray.algorithms.strategy_guard import ARGuard
from saguaro_ray.algorithms.strategy_search import (
    SWITCH_HORIZON,
    Costs,
    Group,
    Held,
    Load,
    all_accepted,
    expected_tokens,
    fill_values,
    optimise,
    option,
    predict,
)
from saguaro_ray.algorithms.strategy_views import (  # noqa: F401 — the policy's interface, re-exported
    AUTO_MODES,
    BUCKETS,
    RESULT_MODES,
    Choice,
    RoundCosts,
    SeqResult,
    SeqView,
    StepCosts,
    temperature_bucket,
)
from saguaro_ray.errors import ConfigError

COST_DECAY = 0.98  # per round: cost fits weigh the last ~50 rounds
SEQ_STALE_ROUNDS = 256  # a sequence unseen this long is gone: its statistics are dropped

# the acceptance prior (a moderately good draft) and the hit rate's
_ACCEPT_PRIOR = 0.7
_HIT_PRIOR = 0.5
_SEQ_WEIGHT = 32.0  # a sequence's own rate ← its bucket's
_SCALE_STEPS = 10  # a sequence's rate relative to its bucket's is quantised to 10% for grouping
_DRAFT_STEP_PRIOR = 0.2  # an unmeasured draft step costs this share of a verification of as many tokens
_SSD_EXPOSED_PRIOR = 0.1  # unmeasured SSD exposure: this share of the verification intercept
# the first rounds' (mode, K as a share of max_k) (see AutoPolicy._cold_start)
_COLD_START = (("ar", 0.0), ("sd", 0.25), ("sd", 0.5), ("ssd", 0.5), ("ssd", 0.5), ("ssd", 0.5))
_REUSE_ROUNDS = 3  # a batch unchanged in shape keeps its choice this many more rounds before a new search
# a round that enters SSD, or whose build made ahead the engine could not use (SeqResult.rebuilt;
# a change of K is not one: it takes effect in the next round's plan), builds afresh (the
# coder pair at batch 1: its build then ends at 1.9 verifications, one started ahead at 0.95):
# what it takes beyond the steady round's prediction, as a multiple of the predicted build,
# weighs the last ~5 such rounds and ages by COST_DECAY a round besides (a stall measured once,
# with no rebuild after it, would otherwise keep SSD dear for good); the prior is one
# pseudo-round of no excess: before one is measured, nothing beyond its forced miss (a prior of
# one whole build exposed kept a fresh engine out of SSD in simulation where it won by 1.2x and
# entries cost no more than their misses). A round where an SSD sequence leaves for SD waits, with
# builds started ahead, for the build in flight before its drafts can run (the coder pair at batch 1:
# its drafting started 212 ms into the round): learned the same way, as the leave ratio
_REBUILD_DECAY = 0.8
# the build's overrun is priced over this many recent steady SSD rounds' spread (Costs.overrun): the
# last ~15 s at the coder pair's batch 1, recent enough to follow the machine's state within the hour
SPREAD_ROUNDS = 32


@dataclass
class _SeqStat:
    tested: float = 0.0
    accepted: float = 0.0
    seen: int = 0  # the round it was last observed
    ssd_k: int = 0  # the K chosen for its last round, if that ran SSD: the K of the plan it went into
    ssd_k_before: int = 0  # ... and for the round before, if both ran SSD (what its next round verifies: the lesser)


class AutoPolicy:
    """Chooses AR / SD K / SSD K per ``auto`` sequence each round (docs/auto.md: the model).

    ``modes``: the fixed modes it may choose (``ar`` always; ``sd``/``ssd``
    need a draft). ``max_k``: the largest K it considers. ``explore``: the
    largest share of rounds that may explore, and of wall time that trial
    rounds may cost beyond the choices they displace.
    ``seed``: makes exploration (the only randomness) reproducible."""

    def __init__(self, modes: tuple[str, ...] = AUTO_MODES, max_k: int = 8, explore: float = 0.05, seed: int = 0) -> None:
        if "ar" not in modes or any(m not in AUTO_MODES for m in modes):
            raise ConfigError(f"auto modes must include 'ar' and name only {', '.join(AUTO_MODES)}; got {modes!r}")
        if not isinstance(max_k, int) or max_k < 1:
            raise ConfigError(f"max_k must be a positive integer, got {max_k!r}")
        if not (isinstance(explore, (int, float)) and 0.0 <= explore < 1.0):
            raise ConfigError(f"explore must be in [0, 1), got {explore!r}")
        self.modes = frozenset(modes)
        self.max_k = max_k
        self._trials = Trials(float(explore), seed, COST_DECAY)
        self._verify = KneeFit(COST_DECAY)
        self._drafting = EwLeastSquares(3, COST_DECAY)
        self._build = EwLeastSquares(4, COST_DECAY, intercept_share=0.5)
        # what the tokens a sequence holds cost the calls that attend them, measured by the probe
        # (held_costs: the rounds of a request cannot tell it from the rest); the fits are of the rest
        self._held = Held()
        self._after = EwLeastSquares(4, COST_DECAY, intercept_share=0.5)
        # steady SSD rounds' (verified tokens, sequences, SSD sequences, K, build end, verification, and
        # the tokens held: by the sequences, by the verification's rows, by the SSD sequences), measured
        self._spread: deque[tuple[int, int, int, int, float, float, float, float, float]] = deque(maxlen=SPREAD_ROUNDS)
        self._ctl = EwLeastSquares(7, COST_DECAY)
        self._plain = 0.0  # decayed count of rounds that drafted nothing: the evidence behind AR's control plane
        # SD, and SSD hits. A sampled bucket not seen yet starts from the greedy bucket's rate (under
        # the drafter-invariant rule a draft's agreement falls little with temperature: 0.91 at T = 0,
        # 0.95 at 0.7 on the real model), not from a fixed guess (0.5 at T = 0.7 held a fresh engine
        # at AR for 40 rounds in simulation where SSD won by 1.45x)
        self._accept = [Acceptance(max_k, _ACCEPT_PRIOR)]
        self._accept += [Acceptance(max_k, self._accept[0]) for _ in BUCKETS[1:]]
        # SSD misses (the backup's proposal), a priori accepted like the draft: backup="auto"
        # serves misses neurally where they are rare (small batches), which is where a prior
        # matters; where the point-mass backup wins, misses are common and the data soon rule
        self._miss = [Acceptance(max_k, d) for d in self._accept]
        self._hit = [HitRates(max_k, _HIT_PRIOR) for _ in BUCKETS]
        self._seqs: dict[int, _SeqStat] = {}
        self._entering: set[int] = set()  # sequences whose SSD round just chosen is a forced miss
        self._chosen_ssd: dict[int, int] = {}  # the K just chosen for each auto sequence put in SSD
        self._speculating: set[int] = set()  # auto sequences the round just chosen speculates with
        self._rebuild = ExcessRatio(_REBUILD_DECAY, COST_DECAY)  # a rebuild round's excess, in predicted builds
        self._leave = ExcessRatio(_REBUILD_DECAY, COST_DECAY)  # a round leaving SSD for SD: the same
        self._catch_up = CostPerUnit(COST_DECAY)  # what the drafts' catch-ups slow verification by, per token sent
        self._observed = 0
        self._switch_full_s = 0.0  # seconds of rebuild the last choice pays in its round (a re-test's budget covers it)
        self._leave_full_s = 0.0  # ... and that a round of AR instead would cost (SSD's rebuild on return)
        self._last_counts = {m: 0 for m in AUTO_MODES}
        self._last_rate = 0.0  # the last search's predicted tokens/s: the next one's starting λ
        self._guard = ARGuard()
        # the last search's batch shape, how many more rounds its choice may stand, that choice and its prediction
        self._reuse: tuple[Any, int, list[tuple[str, int]], dict[str, Any] | None] = (None, 0, [], None)
        self._seeded = False  # step costs measured on the engine's workers started the fits: no cold start
        self._ar_option: dict[str, Any] | None = None  # the last search's prediction for every auto sequence in AR
        # what the round just chosen is predicted to do (None: a cold-start round, whose costs the model
        # does not know yet): {"chosen": option, "runner_up": option or None}, an option being
        # {"option": label, "tokens": expected emitted tokens, "seconds": predicted round time}
        self.prediction: dict[str, Any] | None = None

    def seed(self, costs: StepCosts) -> None:
        """Start the cost fits from step times measured on this engine's own workers
        (docs/auto.md, "Cold start"), so the first round is already a search.

        Each measurement is one observation of its fit, as a round is: the rounds
        run afterwards outweigh them within ~1 / (1 − COST_DECAY) rounds, so the
        fits are refreshed by what the engine then measures. A draft call over n
        sequences is observed at 1 and at ``max_k`` steps, its own part (what an
        SD round's drafting pays beyond its steps: on the coder pair's 0.5B ~30-60
        ms at batch 1, ~10 % of an SD round at K = 7, which left out had SD
        predicted that much short on a fresh engine) and its steps; a build step over
        n SSD sequences is fitted as what it costs beyond a draft step over as many
        sequences (the build's model, :meth:`_observe_ssd`). What the tokens a sequence
        holds cost (:class:`Held`) is taken from the rows measured at two contexts and
        kept; every fit, here and in :meth:`observe`, is of the rest."""
        verify_seq, verify_token = held_costs([((t, b), (b * c, t * c), s) for t, b, c, s in costs.verify])
        [step] = held_costs([(n, (n * c,), s) for n, c, s in costs.draft]) or [0.0]
        held = self._held = Held(verify_seq, verify_token, step)
        for tokens, batch, context, seconds in costs.verify:
            self._verify.add(tokens, batch, seconds - held.verify(batch * context, tokens * context))
            if tokens == batch:  # a decode: AR's round, for the guard until AR rounds measure it
                self._guard.seed_ar(batch, seconds)
        own = dict(costs.draft_call)
        for n, context, seconds in costs.draft:
            for steps in dict.fromkeys((1, self.max_k)):
                self._drafting.add((1.0, float(steps), float(steps * n)), own.get(n, 0.0) + steps * (seconds - held.step * n * context))
        draft = self._drafting.theta
        probe = EwLeastSquares(4, COST_DECAY)
        for n, context, seconds in costs.build:
            beyond = max(0.0, seconds - held.step * n * context - (draft[1] + draft[2] * n if draft is not None else 0.0))
            for k in dict.fromkeys((1, self.max_k)):
                probe.add((1.0, float(n), float(k), float(n * k)), k * beyond, [0.0, 0.0, 0.0, 0.0])
        if probe.theta is not None:
            # in the rounds a build runs beside a verification that shares the machine: what it
            # takes beyond its steps there is, until rounds at several K tell, as the probe's
            # composition, or the steps' own (the probe measured nothing beyond them)
            widest = float(max(n for n, _, _ in costs.build))
            step_shape = [0.0, 0.0, draft[1], draft[2]] if draft is not None else None
            shape = probe.theta if any(t > 0.0 for t in probe.theta) else step_shape
            self._build.anchor(probe.theta, (1.0, widest, float(self.max_k), widest * self.max_k), shape)
        self._seeded = True

    # ------------------------------------------------------------------ learning

    def observe(self, costs: RoundCosts) -> None:
        """Fit the model to one finished round (fixed-strategy sequences included).

        A *rebuild* round (a sequence entered SSD, or the engine built its tree afresh,
        with no build made ahead that fits) teaches
        the rebuild's cost and not the steady fits, a *leave* round (a sequence
        left SSD for SD) the wait for the build in flight and not the control
        plane's; a round beside a catch-up of the drafts (sequences that ran AR sent
        what they missed) teaches what the catch-ups slow verification by
        (:meth:`_observe_catch_up`) and not the verification's fit; a round where a
        sequence chosen to speculate ran AR (its drafts catching up), a rebuild round
        and a leave round are not what a choice runs at steadily: the AR guard judges
        by the others."""
        rebuild = self._rebuilt(costs.seqs)
        left = self._left(costs.seqs)
        leave = left[0] > 0
        self._rebuild.age()
        self._leave.age()
        caught_up = costs.catching_up > 0 or any(r.seq_id in self._speculating and r.mode == "ar" for r in costs.seqs)
        if rebuild:
            self._observe_switch(costs, self._rebuild)
        elif leave:
            self._observe_switch(costs, self._leave, left)
        held_by = _round_load(costs.seqs)
        self._observe_catch_up(costs, held_by)
        if costs.seqs and not rebuild and not leave and not caught_up:
            self._guard.add(
                ARGuard.context(costs.batch, [r.temperature for r in costs.seqs]),
                ARGuard.arm((r.mode, r.proposed) for r in costs.seqs),
                float(sum(min(r.accepted, r.proposed) + 1 for r in costs.seqs)),
                costs.wall_s,
            )
        self._observed += 1
        self._trials.charge(costs)
        held = self._held
        if costs.verify_tokens > 0 and costs.verify_s >= 0.0 and not costs.catching_up:
            y_v = costs.verify_s - held.verify(held_by.held, held_by.held_rows)
            self._verify.add(costs.verify_tokens, costs.batch, y_v, costs.ssd_batch > 0)
        steps = costs.draft_steps if costs.draft_batch > 0 else 0
        if steps > 0:
            x_d = (1.0, float(steps), float(steps * costs.draft_batch))
            self._drafting.add(x_d, costs.draft_s - held.step * steps * held_by.sd_held)
        else:
            self._drafting.decay_only()
        ssd = [r for r in costs.seqs if r.mode == "ssd"]
        if costs.ssd_batch > 0 and ssd:
            self._observe_ssd(costs, ssd, held_by, rebuild)
        else:
            self._after.decay_only()
            self._build.decay_only()
        control = costs.wall_s - costs.verify_s - costs.draft_s - costs.ssd_exposed_s
        if costs.batch > 0 and not leave:
            plain = costs.batch - costs.draft_batch - costs.ssd_batch
            x_ctl = (
                1.0, float(plain), float(costs.draft_batch), float(costs.ssd_batch), float(steps > 0), float(steps), float(costs.ssd_batch > 0)
            )
            self._ctl.add(x_ctl, _clamp_time(control))
        self._plain = COST_DECAY * self._plain + float(steps == 0 and costs.ssd_batch == 0)
        for table in (*self._accept, *self._miss):
            table.age()
        for rate in self._hit:
            rate.age()
        for r in costs.seqs:
            self._observe_seq(r)
        self._entering.clear()
        self._chosen_ssd = {}
        if self._observed % SEQ_STALE_ROUNDS == 0:
            stale = self._observed - SEQ_STALE_ROUNDS
            self._seqs = {s: st for s, st in self._seqs.items() if st.seen > stale}

    def _curve(self, b: int) -> tuple[list[float], list[float], float, HitRates]:
        """Bucket ``b``'s acceptance by position (the draft's; SSD misses), pooled rate and hit rates."""
        d = self._accept[b]
        return d.alphas(), self._miss[b].alphas(), d.pooled(), self._hit[b]

    def _observe_seq(self, r: SeqResult) -> None:
        st = self._seqs.get(r.seq_id)
        if st is None:
            st = self._seqs[r.seq_id] = _SeqStat()
        st.seen = self._observed
        st.ssd_k, st.ssd_k_before = (self._chosen_ssd.get(r.seq_id, r.proposed), st.ssd_k) if r.mode == "ssd" else (0, 0)
        if r.mode not in ("sd", "ssd") or r.proposed <= 0:
            return  # AR speculates nothing; PyramidSD's proposals are qualified tokens, another law
        b = temperature_bucket(r.temperature)
        accepted = max(0, min(r.accepted, r.proposed))
        if r.mode == "ssd":
            if r.hit is None:
                return  # it finished: its count may be cut short (and it looked nothing up)
            # the lookup this round made is keyed on this round's outcome (SeqResult)
            self._hit[b].add(r.proposed, r.hit, accepted >= r.proposed)
            if r.source != "cache":  # a backup's proposal (a miss of the last lookup, or an entry)
                self._miss[b].add(r.proposed, accepted)
                if r.source != "neural":
                    return  # a point-mass guess: not the draft's law
        # the draft's law in every context it meets: SD's rounds, and SSD's served by a hit or a
        # neural backup — not hits alone, which follow outcomes the fan-out covered (easier text)
        self._accept[b].add(r.proposed, accepted)
        st.tested += min(r.proposed, accepted + 1)
        st.accepted += accepted

    def _rebuilt(self, seqs: Sequence[SeqResult]) -> bool:
        """Did the round build some SSD sequence's tree afresh: it entered SSD, or the
        engine says it could not use the build made ahead for it. Only the engine
        knows: a K chosen is verified a round or two late, from the plan it goes
        into (session 31: judged by the K verified, rebuilds of 261 ms, median, on the
        coder pair counted as steady rounds and K changes looked free)."""
        return any(r.mode == "ssd" and r.proposed > 0 and (r.seq_id in self._entering or r.rebuilt) for r in seqs)

    def _left(self, seqs: Sequence[SeqResult]) -> tuple[int, int, int]:
        """The sequences that ran SSD last round and SD in this one, the largest K of the
        builds the round waited for for them and the tokens they hold ((0, 0, 0): none left)."""
        left = [(st.ssd_k, r.context) for r in seqs if r.mode == "sd" and (st := self._seqs.get(r.seq_id)) is not None and st.ssd_k]
        return len(left), max((k for k, _ in left), default=0), sum(c for _, c in left)

    def _observe_catch_up(self, costs: RoundCosts, held_by: Load) -> None:
        """A catch-up's tokens go through the drafts beside the next rounds' verifications:
        where they share the machine with the target (CPU: 5-15 % slower verifications for
        ~10 rounds after 8 sequences' catch-up) those rounds' verification beyond what the
        fit predicts is what the catch-ups cost, per token sent."""
        self._catch_up.age()
        self._catch_up.add(units=float(costs.catch_up_sent))
        if costs.catching_up and costs.verify_tokens > 0 and self._verify.theta is not None:
            predicted = self._costs().verify_s(costs.verify_tokens, costs.batch, costs.ssd_batch > 0, held_by.held, held_by.held_rows)
            self._catch_up.add(seconds=costs.verify_s - predicted)  # unclamped: noise both ways

    @property
    def catch_up_s(self) -> float:
        """What a catch-up costs the rounds beside it, per token sent."""
        return self._catch_up.value

    def _observe_switch(self, costs: RoundCosts, ratio: ExcessRatio, left: tuple[int, int, int] = (0, 0, 0)) -> None:
        """What a switching round took beyond the steady round the model predicts for
        its load (its forced misses as misses), as a multiple of the build it switched:
        a rebuild's (this round's SSD sequences at their K), or a leave's (the build in
        flight for the ``left`` sequences, at their largest K)."""
        if self._verify.theta is None:
            return
        c = self._costs()
        load = _round_load(costs.seqs, self._missed)
        if left[0]:
            build = c.build_s(*left)
        else:
            build = c.build_s(load.n_ssd, load.ssd_k, load.ssd_held) if load.n_ssd and load.ssd_k else 0.0
        if build <= 0.0 or not math.isfinite(costs.wall_s):
            return
        ratio.add(costs.wall_s - c.round_time(load), build)

    @property
    def rebuild_ratio(self) -> float:
        """What a rebuild round costs beyond a steady one, in predicted builds."""
        return self._rebuild.value

    @property
    def leave_ratio(self) -> float:
        """What a round leaving SSD for SD costs beyond a steady one, in predicted builds."""
        return self._leave.value

    def _missed(self, r: SeqResult) -> bool:
        """An SSD sequence drafted a backup in this round, on its critical path: it just
        entered SSD (its own proposal's), or the lookup it made missed (the one its next
        round verifies)."""
        return r.hit is False or r.seq_id in self._entering

    def _observe_ssd(self, costs: RoundCosts, ssd: Sequence[SeqResult], held_by: Load, rebuild: bool = False) -> None:
        """Fit SSD's two exposed parts: when the build ended (where it ran this
        round) and the rest of the exposure, the lookup and backups. Both start
        from the draft's measured step costs: a build is K sequential steps of
        the draft SD measures, and so is a neural backup. A ``rebuild`` round's
        build (afresh, after any stale one) is not the steady build's: its end
        teaches nothing, its overrun is still not the lookup's. The build is for the K
        the engine says it built (a build made ahead is for the K chosen the round
        before: after a raise, it builds the new K beside a verification of the old)."""
        n, k_max = float(costs.ssd_batch), max(r.proposed for r in ssd)
        k_build = max(r.built or r.proposed for r in ssd)
        missed = [r.proposed for r in ssd if self._missed(r)]
        draft = self._drafting.theta
        overrun = 0.0
        if math.isfinite(costs.ssd_build_s) and rebuild:
            self._build.decay_only()
            overrun = max(0.0, costs.ssd_build_s - costs.verify_s)
        elif math.isfinite(costs.ssd_build_s):
            # fitted beyond K sequential draft steps over the SSD sequences (a tree step costs at
            # least a draft step over as many sequences), so a K-slope the recent rounds leave
            # open, every one at one K, is the draft's measured step and not 0
            x_b = (1.0, n, float(k_build), n * k_build)
            steps = k_build * (draft[1] + draft[2] * n) if draft is not None else 0.0
            steps += k_build * self._held.step * held_by.ssd_held
            prior_b = None if self._build.has_prior or draft is None else [0.0, 0.0, 0.0, 0.0]
            self._build.add(x_b, _clamp_time(costs.ssd_build_s) - steps, prior_b)
            if costs.verify_s > 0.0 and costs.ssd_build_s > 0.0:
                self._spread.append(
                    (costs.verify_tokens, costs.batch, costs.ssd_batch, k_build, costs.ssd_build_s, costs.verify_s, held_by.held,
                     held_by.held_rows, held_by.ssd_held)
                )
            overrun = max(0.0, costs.ssd_build_s - costs.verify_s)
        else:
            self._build.decay_only()
        x_a = (1.0, n, float(k_max if missed else 0), float(sum(missed)))
        y_a = _clamp_time(costs.ssd_exposed_s - overrun)
        prior_a = None
        if not self._after.has_prior and draft is not None and math.isfinite(y_a):
            rest = max(0.0, y_a - draft[1] * x_a[2] - draft[2] * x_a[3])
            prior_a = [0.5 * rest, 0.5 * rest / n, draft[1], draft[2]]
        self._after.add(x_a, y_a, prior_a)

    # ------------------------------------------------------------------ choosing

    def choose(self, auto: Sequence[SeqView], fixed: Sequence[tuple[SeqView, Choice]] = ()) -> list[Choice]:
        """One Choice per ``auto`` sequence (same order). ``fixed``: the batch's other
        sequences with the strategy their request fixed — they share the round's time."""
        self.prediction = None
        self._switch_full_s = self._leave_full_s = 0.0
        if not auto:  # nothing to choose: not a round of the exploration budget either
            choices: list[Choice] = []
        elif not self._seeded and (self._observed < len(_COLD_START) or self._verify.theta is None):
            self._trials.chosen += 1
            choices = [self._cold_start(v) for v in auto]
        else:
            self._trials.chosen += 1
            choices = self._search(auto, fixed)
            if any(c.mode != "ar" for c in choices):
                temps = [v.temperature for v in auto] + [v.temperature for v, _ in fixed]
                arm = ARGuard.arm([(c.mode, c.k) for c in choices] + [(c.mode, c.k) for _, c in fixed])
                context = ARGuard.context(len(temps), temps)
                # a re-test is paid from the budget, rebuild included
                waiting = any(v.lagging for v, c in zip(auto, choices) if c.mode != "ar")
                if self._guard.hold(context, arm, self._trials.budget_s - self._switch_full_s, self._leave_full_s, waiting):
                    if self._guard.measuring:  # a round of AR to measure it: its cost is leaving (SSD's rebuild on return)
                        self._trials.budget_s -= self._leave_full_s
                    choices = [Choice("ar", 0) for _ in auto]
                    self._trials.rate = None  # an exploration displaced by AR is no trial
                    if self.prediction is not None and self._ar_option is not None:
                        self.prediction = {"chosen": self._ar_option, "runner_up": self.prediction["chosen"], "guard": True}
                elif self._guard.retest_rate is not None:
                    self._trials.rate = self._guard.retest_rate
        counts = {m: 0 for m in AUTO_MODES}
        for c in choices:
            counts[c.mode] += 1
        self._last_counts = counts
        self._entering = {v.seq_id for v, c in (*zip(auto, choices), *fixed) if c.mode == "ssd" and v.current != "ssd"}
        self._chosen_ssd = {v.seq_id: c.k for v, c in zip(auto, choices) if c.mode == "ssd"}
        self._speculating = {v.seq_id for v, c in zip(auto, choices) if c.mode != "ar"}
        return choices

    def _cold_start(self, v: SeqView) -> Choice:
        """Before the model has a time scale, a fixed schedule (:data:`_COLD_START`):
        AR (verification at the batch's own token count, and the control plane
        of a round that drafts nothing), SD at two K (the draft's per-round and
        per-step costs told apart), then SSD (an entry and steady rounds:
        exposure and hit rate). A mode the sequence may not run gives way to
        the other speculative one, else to AR."""
        want, share = _COLD_START[self._observed]
        allowed = self.modes.intersection(v.modes)
        k = min(v.k_cap, max(1, round(share * self.max_k)))
        for mode in (want, "ssd" if want == "sd" else "sd") if want != "ar" else ():
            if mode in allowed and v.k_cap >= 1:
                return Choice(mode, k)
        return Choice("ar", 0)

    def _costs(self) -> Costs:
        ver = self._verify.theta
        assert ver is not None
        # unmeasured costs: priors relative to the measured verification
        draft = self._drafting.theta or [0.0, _DRAFT_STEP_PRIOR * ver[0], _DRAFT_STEP_PRIOR * ver[1]]
        build = self._build_coefficients(draft)
        after = self._after.theta or [_SSD_EXPOSED_PRIOR * ver[0], 0.0, draft[1], draft[2]]
        ctl = self._ctl.theta or [0.0] * 7
        c = Costs(ver, tuple(draft), tuple(build), tuple(after), tuple(ctl), held=self._held)  # type: ignore[arg-type]
        # each recent round's build and verification over what these coefficients predict for it
        pairs = (
            (build_s, verify_s, c.build_s(n, k, ssd_held), c.verify_s(tokens, batch, True, held, held_rows))
            for tokens, batch, n, k, build_s, verify_s, held, held_rows, ssd_held in self._spread
        )
        c.spread = tuple((b / pb, v / pv) for b, v, pb, pv in pairs if pb > 0.0 and pv > 0.0)
        return c

    def _build_coefficients(self, draft: Sequence[float]) -> list[float]:
        """The build's end: K draft steps (``draft``: the drafting fit or its prior) and what was
        fitted beyond them (:meth:`_observe_ssd`)."""
        b = self._build.theta or [0.0, 0.0, 0.0, 0.0]
        return [b[0], b[1], b[2] + draft[1], b[3] + draft[2]]

    def _seq_scale(self, seq_id: int, pooled: float) -> float:
        """The sequence's own pooled acceptance over its bucket's, shrunk and quantised."""
        st = self._seqs.get(seq_id)
        if st is None or st.tested <= 0.0:
            return 1.0
        own = (st.accepted + _SEQ_WEIGHT * pooled) / (st.tested + _SEQ_WEIGHT)
        return max(1, round(own / pooled * _SCALE_STEPS)) / _SCALE_STEPS

    def _search(self, auto: Sequence[SeqView], fixed: Sequence[tuple[SeqView, Choice]]) -> list[Choice]:
        curves: dict[int, tuple[list[float], list[float], float, HitRates]] = {}

        def curve(b: int) -> tuple[list[float], list[float], float, HitRates]:
            if b not in curves:
                curves[b] = self._curve(b)
            return curves[b]

        out: list[Choice | None] = [None] * len(auto)
        held: list[tuple[SeqView, Choice]] = []
        waiting: list[SeqView] = []
        groups: dict[tuple, Group] = {}
        for i, v in enumerate(auto):
            modes = self.modes.intersection(v.modes)
            cap = min(v.k_cap, self.max_k) if len(modes) > 1 else 0
            hold = self._trials.held.get(v.seq_id)
            if hold is not None and hold[0].mode in modes and hold[0].k <= cap:
                out[i] = hold[0]
                if v.lagging and hold[0].mode != "ar":
                    waiting.append(v)  # runs AR while its drafts catch up: the trial waits
                else:
                    held.append((v, hold[0]))
                continue
            b = temperature_bucket(v.temperature)
            scale = self._seq_scale(v.seq_id, curve(b)[2])
            st = self._seqs.get(v.seq_id)
            ssd_k, verify_k = (st.ssd_k, min(st.ssd_k, st.ssd_k_before or st.ssd_k)) if v.current == "ssd" and st is not None else (0, 0)
            key = (b, scale, cap, modes, v.current == "ssd", ssd_k, verify_k, v.lagging)
            g = groups.get(key)
            if g is None:
                g = groups[key] = Group(b, scale, cap, modes, v.current == "ssd", ssd_k, v.lagging, verify_k)
            g.members.append(i)
            g.seq_ids.append(v.seq_id)
            g.unseen += v.unseen if v.lagging else 0
            g.held += v.context
        self._trials.age_holds({v.seq_id for v in waiting})
        fixed_all = (*fixed, *held, *((v, Choice("ar", 0)) for v in waiting))
        glist = list(groups.values())
        shape = (tuple((key, len(g.members)) for key, g in groups.items()), tuple((v.temperature, c) for v, c in fixed_all))
        costs, rebuild, leave, catch_up = self._costs(), self.rebuild_ratio, self.leave_ratio, self.catch_up_s
        tokens_held = sum(v.context for v in auto)

        if not held and shape == self._reuse[0] and self._reuse[1] > 0:
            # the batch looks as it did a round ago: its choice stands (estimates move slowly)
            self._reuse = (shape, self._reuse[1] - 1, self._reuse[2], self._reuse[3])
            for g, opt in zip(glist, self._reuse[2]):
                g.opt = opt
                g.price_switches(costs, len(auto), rebuild, leave, catch_up, tokens_held)
            self.prediction = self._reuse[3]
        else:
            for g in glist:
                alphas, miss, _, hits = curve(g.bucket)
                fill_values(g, alphas, miss, hits.values, hits.pooled.value)
                g.price_switches(costs, len(auto), rebuild, leave, catch_up, tokens_held)
            base = self._fixed_load(fixed_all, curve)
            best = self._last_rate = optimise(glist, base, costs, self._last_rate)
            searched = [g.opt for g in glist]
            # every auto sequence held in an exploration: the round is the trial's, nothing was searched
            self.prediction, self._ar_option = predict(glist, base, costs) if glist else (None, None)
            self._reuse = (shape, _REUSE_ROUNDS, searched, self.prediction)
            if held:
                self._trials.held_round()
                if self.prediction is not None:  # the held sequences run a trial beside the searched ones
                    self.prediction = {**self.prediction, "trial": True}
            elif self.explore:
                self._trials.try_explore(glist, base, costs, best, self._optimistic, self._cost_evidence)
                if [g.opt for g in glist] != searched:  # a trial runs: predicted as any choice, the search's the runner-up
                    trial = option(glist, [g.opt for g in glist], base, costs)
                    self.prediction = {"chosen": trial, "runner_up": self.prediction["chosen"], "trial": True}
        for g in glist:
            c = Choice(*g.opt)
            for i in g.members:
                out[i] = c
            self._switch_full_s += len(g.members) * g.switch_s(g.opt) * SWITCH_HORIZON
            self._leave_full_s += len(g.members) * g.switch_s(("ar", 0)) * SWITCH_HORIZON
        return out  # type: ignore[return-value]

    def _fixed_load(self, fixed: Sequence[tuple[SeqView, Choice]], curve) -> Load:
        load = Load()
        for v, c in fixed:
            b = temperature_bucket(v.temperature)
            alphas, miss, pooled, hits = curve(b)
            k = min(c.k, self.max_k)
            e_draft = expected_tokens(alphas, self._seq_scale(v.seq_id, pooled), k)
            e, hit = e_draft[k], hits.values(all_accepted(e_draft))[k]
            if c.mode == "ssd":
                e = hit * e + (1.0 - hit) * expected_tokens(miss, 1.0, k)[k]
            load.add(1, c.mode, c.k, e, hit, held=v.context)
        return load

    # ------------------------------------------------------------------ exploring

    def _cost_evidence(self, mode: str) -> float:
        """Recent rounds behind what ``mode`` costs beyond verification: its
        drafting, or for AR the control plane of a round that drafts nothing."""
        if mode == "sd":
            return self._drafting.weight
        return self._after.weight if mode == "ssd" else self._plain

    def _optimistic(self, g: Group) -> Group:
        """``g`` valued with its bucket's acceptance and hit rates at their upper bounds, its
        switches priced as ``g``'s (a catch-up of 800 tokens made a trial look free)."""
        # a copy: the choice, if its rates hold, is kept, so its switch is amortised as any
        # choice's; fill_values replaces (never mutates) the values it computes
        up = copy.copy(g)
        hits = self._hit[g.bucket]
        fill_values(up, self._accept[g.bucket].upper(), self._miss[g.bucket].upper(), hits.upper, hits.pooled.upper())
        return up

    @property
    def explore(self) -> float:
        """The largest share of rounds that may explore, and of wall time trials may cost."""
        return self._trials.share

    @explore.setter
    def explore(self, share: float) -> None:
        """A share of 0 stops exploring: a trial in progress ends too (its held rounds would explore)."""
        self._trials.share = share
        if not share:
            self._trials.held = {}

    # ------------------------------------------------------------------ reporting

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for engine metrics and the benchmark."""

        def coef(fit: EwLeastSquares, names: tuple[str, ...]) -> dict[str, float] | None:
            theta = fit.theta
            return None if theta is None else {n: float(v) for n, v in zip(names, theta)}

        return {
            "rounds_observed": self._observed,
            "rounds_chosen": self._trials.chosen,
            "rounds_explored": self._trials.explored,
            "explore_s": self._trials.spent_s,  # what trial rounds measured beyond their reference rates
            "explore_budget_s": self._trials.budget_s,
            "wall_s": self._trials.wall_s,  # wall time observed (explore_s / wall_s: the share trials cost)
            "verify_s": None if self._verify.theta is None else dict(zip(("a", "per_token", "per_seq", "knee", "ssd"), self._verify.theta)),
            "draft_s": coef(self._drafting, ("a", "per_step", "per_step_seq")),
            "per_token_held": self._held._asdict(),  # seconds: the probe's (Held)
            # the build's end after verification's start (the draft's steps included)
            "ssd_build_s": (
                dict(zip(("a", "per_seq", "per_k", "per_seq_k"), self._build_coefficients(self._drafting.theta or [0.0, 0.0, 0.0])))
                if self._build.theta is not None
                else None
            ),
            "ssd_after_s": coef(self._after, ("a", "per_seq", "per_backup_step", "per_missed_k")),  # lookup and backups
            "control_s": coef(self._ctl, ("a", "per_plain_seq", "per_drafting_seq", "per_ssd_seq", "drafting", "per_draft_step", "ssd")),
            "acceptance": {
                name: {
                    "draft": [round(a, 4) for a in self._accept[b].alphas()],
                    "miss": [round(a, 4) for a in self._miss[b].alphas()],
                    "hit_rate": round(self._hit[b].pooled.value, 4),
                    "hit_rate_by_k": [
                        round(h, 4) for h in self._hit[b].values(all_accepted(expected_tokens(self._accept[b].alphas(), 1.0, self.max_k)))[1:]
                    ],
                }
                for b, name in enumerate(BUCKETS)
            },
            "last_choice": dict(self._last_counts),
            "predicted_tokens_per_s": self._last_rate,  # what the last search expected of its choice
            "rebuild_ratio": self.rebuild_ratio,  # a rebuild round's time beyond a steady one, in predicted builds
            "leave_ratio": self.leave_ratio,  # a round leaving SSD for SD: the same
            "catch_up_s_per_token": self.catch_up_s,  # what the drafts' catch-ups slow verifications by
            "guard_held": self._guard.held,  # rounds whose speculating choice gave way to AR (measuring it, or faster)
        }


def _round_load(seqs: Sequence[SeqResult], missed: Callable[[SeqResult], bool] = lambda r: False) -> Load:
    """A finished round as the :class:`Load` the model prices: each sequence in the mode it
    ran at the K it proposed (a sequence that ran AR at none), holding its context, its
    lookup a hit unless ``missed``. The fits take its tokens held (``held``, ``held_rows``,
    ``sd_held``, ``ssd_held``); a switching round's excess is measured against its round time."""
    load = Load()
    for r in seqs:
        load.add(1, r.mode, r.proposed if r.mode != "ar" else 0, 0.0, 0.0 if missed(r) else 1.0, held=r.context)
    return load


def _clamp_time(seconds: float) -> float:
    """A measured residual time, at least 0 (clocks overlap by a little); NaN stays NaN so
    the fit skips it."""
    return max(0.0, seconds) if seconds == seconds else seconds
