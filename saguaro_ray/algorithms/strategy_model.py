"""The ``auto`` strategy: which fixed strategy each sequence runs next round, from costs fitted online.

Every strategy is exact (each proposal is verified against the target's law
with the law it was drawn from), so the choice changes speed only. Before a
round :class:`AutoPolicy` picks, for every ``auto`` sequence, AR (K = 0), SD
with K or SSD with K so as to maximise the batch's expected emitted tokens
per second of the round, Σ_i E_i(mode_i, K_i) / T(the whole assignment), with
the batch's fixed-strategy sequences in both sums (they share the round);
:meth:`AutoPolicy.observe` then fits what the round cost.

``docs/auto.md`` explains the model term by term and why each term is there
(verification, SD drafting, SSD's build overrun and lookup, control plane,
acceptance per position and temperature, switching costs), the AR guard, the
Dinkelbach search over groups of alike sequences, the time-charged
exploration and the cold start. The model and its search stay in one module:
the search linearises exactly the round-time model it evaluates, so splitting
them would put one formula in two places. The data the engine and the policy
exchange is :mod:`~saguaro_ray.algorithms.strategy_views`, the estimators
:mod:`~saguaro_ray.algorithms.strategy_fits`, the guard
:mod:`~saguaro_ray.algorithms.strategy_guard`.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from saguaro_ray.algorithms.strategy_fits import ALPHA_MAX, Acceptance, EwLeastSquares, HitRates, KneeFit
from saguaro_ray.algorithms.strategy_guard import ARGuard
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

log = logging.getLogger(__name__)

_SEQUENTIAL = ("sd", "pyramid")  # modes drafted step by step before verification
SWITCH_HORIZON = 16  # rounds a choice is expected to hold: the SSD switch cost is spread over them
EXPLORE_MARGIN = 0.3  # a choice whose drafting cost is uncertain is explored within this share of the best
EVIDENCE_MIN = 3.0  # fewer (decayed) rounds than this behind a cost: its estimate is uncertain
COST_DECAY = 0.98  # per round: cost fits weigh the last ~50 rounds
SEQ_STALE_ROUNDS = 256  # a sequence unseen this long is gone: its statistics are dropped
TRIAL_WINDOW = 256  # the exploration budget holds at most explore × this many mean rounds' time

# the acceptance prior (a moderately good draft) and the hit rate's
_ACCEPT_PRIOR = 0.7
_HIT_PRIOR = 0.5
_SEQ_WEIGHT = 32.0  # a sequence's own rate ← its bucket's
_SCALE_STEPS = 10  # a sequence's rate relative to its bucket's is quantised to 10% for grouping
_DRAFT_STEP_PRIOR = 0.2  # an unmeasured draft step costs this share of a verification of as many tokens
_SSD_EXPOSED_PRIOR = 0.1  # unmeasured SSD exposure: this share of the verification intercept
_DINKELBACH_ITERS = 4
# an exploration into SSD runs past its entry (a forced miss, no hit rate) until about this many
# lookups were seen, at most _ENTRY_EXPLORE_MAX rounds in all (see AutoPolicy._try_explore)
_ENTRY_EXPLORE_LOOKUPS = 8
_ENTRY_EXPLORE_MAX = 6
# the first rounds' (mode, K as a share of max_k) (see AutoPolicy._cold_start)
_COLD_START = (("ar", 0.0), ("sd", 0.25), ("sd", 0.5), ("ssd", 0.5), ("ssd", 0.5), ("ssd", 0.5))
_REUSE_ROUNDS = 3  # a batch unchanged in shape keeps its choice this many more rounds before a new search


@dataclass
class _SeqStat:
    tested: float = 0.0
    accepted: float = 0.0
    seen: int = 0  # the round it was last observed
    full: bool | None = None  # its last round accepted every draft token (what its next lookup looks up)


def _expected_tokens(alphas: Sequence[float], scale: float, k_max: int) -> list[float]:
    """E[emitted] for K = 0..k_max speculated: 1 + Σ_{i≤K} Π_{j≤i} α_j (α_j scaled, capped)."""
    out = [1.0]
    run = 1.0
    for j in range(k_max):
        run *= min(ALPHA_MAX, alphas[j] * scale)
        out.append(out[-1] + run)
    return out


class _Load:
    """A round's totals as the cost model sees them: the fixed sequences' part, then a candidate's."""

    __slots__ = ("n", "tokens", "e", "n_sd", "steps", "n_ssd", "ssd_k", "log_hit", "miss_k")

    def __init__(self) -> None:
        self.n = 0
        self.tokens = 0
        self.e = 0.0  # expected emitted tokens (switch costs included)
        self.n_sd = 0
        self.steps = 0  # the SD group's largest K: its sequential draft steps
        self.n_ssd = 0
        self.ssd_k = 0  # the SSD group's largest K: a neural backup's sequential steps
        self.log_hit = 0.0  # log P(every SSD sequence hits)
        self.miss_k = 0.0  # expected Σ K over the SSD sequences that miss

    def add(self, count: int, mode: str, k: int, e: float, hit: float) -> None:
        self.n += count
        self.tokens += count * (k + 1)
        self.e += count * e
        if mode in _SEQUENTIAL:
            self.n_sd += count
            if k > self.steps:
                self.steps = k
        elif mode == "ssd":
            self.n_ssd += count
            if k > self.ssd_k:
                self.ssd_k = k
            self.log_hit += count * math.log(min(max(hit, 1e-9), 1.0 - 1e-9))
            self.miss_k += count * (1.0 - hit) * k

    def copy(self) -> "_Load":
        out = _Load.__new__(_Load)
        for name in _Load.__slots__:
            setattr(out, name, getattr(self, name))
        return out


@dataclass
class _Costs:
    """The fitted coefficients one choice is made with (plain floats, read once per round)."""

    ver: tuple[float, float, float, int, float]  # a, per token past the knee, per sequence, the knee, with SSD (KneeFit)
    draft: tuple[float, float, float]  # a (per round), per step, per step and sequence
    build: tuple[float, float, float, float]  # the build's end after verification's start: a, per SSD sequence, per K, per K and sequence
    after: tuple[float, float, float, float]  # lookup and backups: a, per SSD sequence, per backup step when any misses, per missed K
    # a, per sequence of each kind (plain, drafting, SSD), with drafting, per draft step, with SSD
    ctl: tuple[float, float, float, float, float, float, float]

    def round_time(self, load: _Load) -> float:
        sequential = bool(load.n_sd and load.steps)
        c = self.ctl
        ctl = c[0] + c[1] * (load.n - load.n_sd - load.n_ssd) + c[2] * load.n_sd + c[3] * load.n_ssd
        ctl += (c[4] + c[5] * load.steps if sequential else 0.0) + (c[6] if load.n_ssd else 0.0)
        v = self.ver
        verify = max(0.0, v[0] + v[1] * max(0, load.tokens - v[3]) + v[2] * load.n + (v[4] if load.n_ssd else 0.0))
        t = max(0.0, ctl) + verify
        if sequential:
            d = self.draft
            t += max(0.0, d[0] + load.steps * (d[1] + d[2] * load.n_sd))
        if load.n_ssd:
            b, a = self.build, self.after
            t += max(0.0, b[0] + b[1] * load.n_ssd + load.ssd_k * (b[2] + b[3] * load.n_ssd) - verify)
            p_any = 1.0 - math.exp(load.log_hit)
            t += max(0.0, a[0] + a[1] * load.n_ssd + a[2] * load.ssd_k * p_any + a[3] * load.miss_k)
        return t


class _Group:
    """Sequences the model cannot tell apart: one choice for all of them."""

    __slots__ = ("bucket", "scale", "cap", "modes", "in_ssd", "members", "seq_ids", "hit", "hit_pooled", "e_sd", "e_ssd", "entry", "leave", "opt")

    def __init__(self, bucket: int, scale: float, cap: int, modes: frozenset[str], in_ssd: bool) -> None:
        self.bucket = bucket
        self.scale = scale  # the members' own acceptance relative to their bucket's
        self.cap = cap
        self.modes = modes
        self.in_ssd = in_ssd
        self.hit: list[float] = [_HIT_PRIOR] * (cap + 1)  # SSD's hit rate by K
        self.hit_pooled = _HIT_PRIOR  # over every K: what the search linearises P(all hit) with
        self.members: list[int] = []  # indices into the round's auto sequences
        self.seq_ids: list[int] = []
        self.e_sd: list[float] = [1.0]  # expected tokens by K (index 0: AR), switch cost included
        self.e_ssd: list[float] = [1.0]
        self.entry: list[float] = [0.0]  # tokens an SSD entry's forced miss costs, by K
        self.leave = 0.0  # a sequence in SSD choosing AR or SD pays this (the hysteresis band)
        self.opt: tuple[str, int] = ("ar", 0)

    def value(self, opt: tuple[str, int]) -> float:
        mode, k = opt
        if mode == "ssd":
            return self.e_ssd[k]
        return (self.e_sd[k] if mode == "sd" else 1.0) - self.leave

    def excursion(self, opt: tuple[str, int]) -> float:
        """Tokens per member that trying ``opt`` for one round costs beyond
        :meth:`value`'s amortised switch: an entry into SSD, or the re-entry
        after a round out of it, is paid in full."""
        if opt[0] == "ssd" and not self.in_ssd:
            return self.entry[opt[1]] * (1.0 - 1.0 / SWITCH_HORIZON)
        if opt[0] != "ssd" and self.in_ssd:
            return self.leave * (SWITCH_HORIZON - 1.0)
        return 0.0


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
        self.explore = float(explore)
        self._rng = random.Random(seed)
        self._verify = KneeFit(COST_DECAY)
        self._drafting = EwLeastSquares(3, COST_DECAY)
        self._build = EwLeastSquares(4, COST_DECAY, intercept_share=0.5)
        self._after = EwLeastSquares(4, COST_DECAY, intercept_share=0.5)
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
        self._held: dict[int, tuple[Choice, int]] = {}  # an exploration in progress: choice, rounds left
        self._observed = 0
        self._chosen = 0
        self._explored = 0
        self._last_counts = {m: 0 for m in AUTO_MODES}
        self._last_rate = 0.0  # the last search's predicted tokens/s: the next one's starting λ
        self._guard = ARGuard()
        self._budget_s = 0.0  # exploration budget: explore × wall time observed, less what trials cost
        self._trial_rate: float | None = None  # the round just chosen is a trial: the rate it is charged against
        self._trial_s = 0.0  # seconds trials measured beyond their reference rates
        self._explore_ref = 0.0  # the rate the exploration in progress displaced
        self._wall_s = 0.0  # wall time observed
        self._wall_mean: float | None = None  # decayed mean round time (the budget's cap)
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
        fits are refreshed by what the engine then measures. A draft step over n
        sequences is observed at 1 and at ``max_k`` steps (the per-step cost told
        from the round's own part, which a probe does not have); a build step over
        n SSD sequences is fitted as what it costs beyond a draft step over as many
        sequences (the build's model, :meth:`_observe_ssd`)."""
        for tokens, batch, seconds in costs.verify:
            self._verify.add(tokens, batch, seconds)
        for n, seconds in costs.draft:
            for steps in dict.fromkeys((1, self.max_k)):
                self._drafting.add((1.0, float(steps), float(steps * n)), steps * seconds)
        draft = self._drafting.theta
        for n, seconds in costs.build:
            beyond = max(0.0, seconds - (draft[1] + draft[2] * n if draft is not None else 0.0))
            for k in dict.fromkeys((1, self.max_k)):
                self._build.add((1.0, float(n), float(k), float(n * k)), k * beyond, [0.0, 0.0, 0.0, 0.0])
        self._seeded = True

    # ------------------------------------------------------------------ learning

    def observe(self, costs: RoundCosts) -> None:
        """Fit the model to one finished round (fixed-strategy sequences included)."""
        if costs.seqs:
            self._guard.add(
                ARGuard.context(costs.batch, [r.temperature for r in costs.seqs]),
                ARGuard.arm(r.mode for r in costs.seqs),
                float(sum(min(r.accepted, r.proposed) + 1 for r in costs.seqs)),
                costs.wall_s,
            )
        self._observed += 1
        self._charge_trial(costs)
        if costs.verify_tokens > 0 and costs.verify_s >= 0.0:
            self._verify.add(costs.verify_tokens, costs.batch, costs.verify_s, costs.ssd_batch > 0)
        steps = costs.draft_steps if costs.draft_batch > 0 else 0
        if steps > 0:
            self._drafting.add((1.0, float(steps), float(steps * costs.draft_batch)), costs.draft_s)
        else:
            self._drafting.decay_only()
        ssd = [r for r in costs.seqs if r.mode == "ssd"]
        if costs.ssd_batch > 0 and ssd:
            self._observe_ssd(costs, ssd)
        else:
            self._after.decay_only()
            self._build.decay_only()
        control = costs.wall_s - costs.verify_s - costs.draft_s - costs.ssd_exposed_s
        if costs.batch > 0:
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
        if self._observed % SEQ_STALE_ROUNDS == 0:
            stale = self._observed - SEQ_STALE_ROUNDS
            self._seqs = {s: st for s, st in self._seqs.items() if st.seen > stale}

    def _charge_trial(self, costs: RoundCosts) -> None:
        """Credit the exploration budget with ``explore`` of the round's wall
        time (capped); a trial round is charged what it took beyond the time its
        tokens would have taken at its reference rate."""
        wall = costs.wall_s
        if not (wall >= 0.0 and math.isfinite(wall)):
            self._trial_rate = None
            return
        self._wall_s += wall
        self._wall_mean = wall if self._wall_mean is None else COST_DECAY * self._wall_mean + (1.0 - COST_DECAY) * wall
        cap = self.explore * TRIAL_WINDOW * self._wall_mean
        self._budget_s = min(cap, self._budget_s + self.explore * wall)
        if self._trial_rate:
            tokens = sum(min(r.accepted, r.proposed) + 1 for r in costs.seqs)
            excess = max(0.0, wall - tokens / self._trial_rate)
            self._budget_s -= excess
            self._trial_s += excess
        self._trial_rate = None

    def _curve(self, b: int) -> tuple[list[float], list[float], float, HitRates]:
        """Bucket ``b``'s acceptance by position (SD and hits; misses), pooled rate and hit rates."""
        d = self._accept[b]
        return d.alphas(), self._miss[b].alphas(), d.pooled(), self._hit[b]

    def _observe_seq(self, r: SeqResult) -> None:
        st = self._seqs.get(r.seq_id)
        if st is None:
            st = self._seqs[r.seq_id] = _SeqStat()
        st.seen = self._observed
        after_full, st.full = st.full, r.proposed > 0 and r.accepted >= r.proposed
        if r.mode not in ("sd", "ssd") or r.proposed <= 0:
            return  # AR speculates nothing; PyramidSD's proposals are qualified tokens, another law
        b = temperature_bucket(r.temperature)
        accepted = max(0, min(r.accepted, r.proposed))
        if r.mode == "ssd":
            entering = r.seq_id in self._entering
            if r.hit is None and not entering:
                return  # it finished: its count may be cut short, and hit or miss is unknown
            if not entering:  # an entry round's miss is forced (with or without a lookup), not the cache's rate
                self._hit[b].add(r.proposed, bool(r.hit), after_full)
            if self._missed(r):
                self._miss[b].add(r.proposed, accepted)
                return
        self._accept[b].add(r.proposed, accepted)
        st.tested += min(r.proposed, accepted + 1)
        st.accepted += accepted

    def _missed(self, r: SeqResult) -> bool:
        """An SSD sequence's proposal came from the backup: its lookup missed, or it
        just entered SSD (no cache yet; the engine may report no lookup at all)."""
        return r.hit is False or (r.hit is None and r.seq_id in self._entering)

    def _observe_ssd(self, costs: RoundCosts, ssd: Sequence[SeqResult]) -> None:
        """Fit SSD's two exposed parts: when the build ended (where it ran this
        round) and the rest of the exposure, the lookup and backups. Both start
        from the draft's measured step costs: a build is K sequential steps of
        the draft SD measures, and so is a neural backup."""
        n, k_max = float(costs.ssd_batch), max(r.proposed for r in ssd)
        missed = [r.proposed for r in ssd if self._missed(r)]
        draft = self._drafting.theta
        overrun = 0.0
        if math.isfinite(costs.ssd_build_s):
            # fitted beyond K sequential draft steps over the SSD sequences (a tree step costs at
            # least a draft step over as many sequences), so a K-slope the recent rounds leave
            # open, every one at one K, is the draft's measured step and not 0
            x_b = (1.0, n, float(k_max), n * k_max)
            steps = k_max * (draft[1] + draft[2] * n) if draft is not None else 0.0
            prior_b = None if self._build.has_prior or draft is None else [0.0, 0.0, 0.0, 0.0]
            self._build.add(x_b, _clamp_time(costs.ssd_build_s) - steps, prior_b)
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
        if not auto:  # nothing to choose: not a round of the exploration budget either
            choices: list[Choice] = []
        elif not self._seeded and (self._observed < len(_COLD_START) or self._verify.theta is None):
            self._chosen += 1
            choices = [self._cold_start(v) for v in auto]
        else:
            self._chosen += 1
            choices = self._search(auto, fixed)
            if any(c.mode != "ar" for c in choices):
                temps = [v.temperature for v in auto] + [v.temperature for v, _ in fixed]
                arm = ARGuard.arm([c.mode for c in choices] + [c.mode for _, c in fixed])
                if self._guard.hold(ARGuard.context(len(temps), temps), arm, self._budget_s):
                    choices = [Choice("ar", 0) for _ in auto]
                    self._trial_rate = None  # an exploration displaced by AR is no trial
                    if self.prediction is not None and self._ar_option is not None:
                        self.prediction = {"chosen": self._ar_option, "runner_up": self.prediction["chosen"], "guard": True}
                elif self._guard.retest_rate is not None:
                    self._trial_rate = self._guard.retest_rate
        counts = {m: 0 for m in AUTO_MODES}
        for c in choices:
            counts[c.mode] += 1
        self._last_counts = counts
        self._entering = {v.seq_id for v, c in (*zip(auto, choices), *fixed) if c.mode == "ssd" and v.current != "ssd"}
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

    def _costs(self) -> _Costs:
        ver = self._verify.theta
        assert ver is not None
        # unmeasured costs: priors relative to the measured verification
        draft = self._drafting.theta or [0.0, _DRAFT_STEP_PRIOR * ver[0], _DRAFT_STEP_PRIOR * ver[1]]
        build = self._build_coefficients(draft)
        after = self._after.theta or [_SSD_EXPOSED_PRIOR * ver[0], 0.0, draft[1], draft[2]]
        ctl = self._ctl.theta or [0.0] * 7
        return _Costs(ver, (draft[0], draft[1], draft[2]), tuple(build), tuple(after), tuple(ctl))  # type: ignore[arg-type]

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
        groups: dict[tuple, _Group] = {}
        for i, v in enumerate(auto):
            modes = self.modes.intersection(v.modes)
            cap = min(v.k_cap, self.max_k) if len(modes) > 1 else 0
            hold = self._held.get(v.seq_id)
            if hold is not None and hold[0].mode in modes and hold[0].k <= cap:
                out[i] = hold[0]
                held.append((v, hold[0]))
                continue
            b = temperature_bucket(v.temperature)
            scale = self._seq_scale(v.seq_id, curve(b)[2])
            key = (b, scale, cap, modes, v.current == "ssd")
            g = groups.get(key)
            if g is None:
                g = groups[key] = _Group(b, scale, cap, modes, v.current == "ssd")
            g.members.append(i)
            g.seq_ids.append(v.seq_id)
        self._age_holds()
        fixed_all = (*fixed, *held)
        glist = list(groups.values())
        shape = (tuple((key, len(g.members)) for key, g in groups.items()), tuple((v.temperature, c) for v, c in fixed_all))
        if not held and shape == self._reuse[0] and self._reuse[1] > 0:
            # the batch looks as it did a round ago: its choice stands (estimates move slowly)
            self._reuse = (shape, self._reuse[1] - 1, self._reuse[2], self._reuse[3])
            for g, opt in zip(glist, self._reuse[2]):
                g.opt = opt
            self.prediction = self._reuse[3]
        else:
            for g in glist:
                alphas, miss, _, hits = curve(g.bucket)
                _fill_values(g, alphas, miss, hits.values, hits.pooled.value)
            costs = self._costs()
            base = self._fixed_load(fixed_all, curve)
            best = self._optimise(glist, base, costs)
            searched = [g.opt for g in glist]
            # every auto sequence held in an exploration: the round is the trial's, nothing was searched
            self.prediction = self._predict(glist, base, costs) if glist else None
            self._reuse = (shape, _REUSE_ROUNDS, searched, self.prediction)
            if held:
                self._explored += 1
                self._trial_rate = self._explore_ref
                if self.prediction is not None:  # the held sequences run a trial beside the searched ones
                    self.prediction = {**self.prediction, "trial": True}
            elif self.explore:
                self._try_explore(glist, base, costs, best)
                if [g.opt for g in glist] != searched:  # a trial runs: predicted as any choice, the search's the runner-up
                    trial = self._option(glist, [g.opt for g in glist], base, costs)
                    self.prediction = {"chosen": trial, "runner_up": self.prediction["chosen"], "trial": True}
        for g in glist:
            c = Choice(*g.opt)
            for i in g.members:
                out[i] = c
        return out  # type: ignore[return-value]

    @classmethod
    def _option(cls, groups: list[_Group], opts: list[tuple[str, int]], base: _Load, costs: _Costs) -> dict[str, Any]:
        """One option's prediction: its label (``sd:4``; ``ar+ssd:4`` when groups differ),
        expected emitted tokens of the batch and predicted round seconds."""
        e, t, _ = cls._round_of(groups, opts, base, costs)
        label = "+".join(sorted({"ar" if m == "ar" else f"{m}:{k}" for m, k in opts}))
        return {"option": label, "tokens": e, "seconds": t}

    def _predict(self, groups: list[_Group], base: _Load, costs: _Costs) -> dict[str, Any]:
        """What the search's choice (every group's ``opt``) is predicted to do, and the
        runner-up: the best option of another mode for every auto sequence (AR; SD or
        SSD at one K, capped per group) — the option a misprediction would have
        preferred. Sets :attr:`_ar_option` (what the AR guard switches to)."""
        chosen = self._option(groups, [g.opt for g in groups], base, costs)
        best: dict[str, dict[str, Any]] = {}
        self._ar_option = best["ar"] = self._option(groups, [("ar", 0)] * len(groups), base, costs)
        for mode in ("sd", "ssd"):
            cap = max((g.cap for g in groups if mode in g.modes), default=0)
            for k in range(1, cap + 1):
                opts = [(mode, min(k, g.cap)) if mode in g.modes and g.cap >= 1 else ("ar", 0) for g in groups]
                o = self._option(groups, opts, base, costs)
                if mode not in best or _rate(o) > _rate(best[mode]):
                    best[mode] = o
        modes = {m for m, _ in (g.opt for g in groups)}
        others = [o for m, o in best.items() if modes != {m}]
        runner_up = max(others, key=_rate) if others else None
        return {"chosen": chosen, "runner_up": runner_up}

    def _age_holds(self) -> None:
        self._held = {s: (c, left - 1) for s, (c, left) in self._held.items() if left > 1}

    def _fixed_load(self, fixed: Sequence[tuple[SeqView, Choice]], curve) -> _Load:
        load = _Load()
        for v, c in fixed:
            b = temperature_bucket(v.temperature)
            alphas, miss, pooled, hits = curve(b)
            k = min(c.k, self.max_k)
            e_draft = _expected_tokens(alphas, self._seq_scale(v.seq_id, pooled), k)
            e, hit = e_draft[k], hits.values(_all_accepted(e_draft))[k]
            if c.mode == "ssd":
                e = hit * e + (1.0 - hit) * _expected_tokens(miss, 1.0, k)[k]
            load.add(1, c.mode, c.k, e, hit)
        return load

    def _evaluate(
        self, groups: list[_Group], opts: list[tuple[str, int]], base: _Load, costs: _Costs, extra: float = 0.0
    ) -> tuple[float, float]:
        """(expected tokens per second, P(every SSD sequence hits)) of the round if group i
        runs opts[i] (``extra``: tokens to add, e.g. an excursion's cost)."""
        e, t, hit = self._round_of(groups, opts, base, costs, extra)
        return (e / t if t > 0 else math.inf), hit

    @staticmethod
    def _round_of(
        groups: list[_Group], opts: list[tuple[str, int]], base: _Load, costs: _Costs, extra: float = 0.0
    ) -> tuple[float, float, float]:
        """(expected tokens, predicted seconds, P(every SSD sequence hits)) of that round."""
        load = base.copy()
        load.e += extra
        for g, opt in zip(groups, opts):
            load.add(len(g.members), opt[0], opt[1], g.value(opt), g.hit[opt[1]])
        return load.e, costs.round_time(load), math.exp(load.log_hit)

    def _optimise(self, groups: list[_Group], base: _Load, costs: _Costs) -> float:
        """Sets every group's ``opt``; returns the predicted tokens per second.

        A configuration is the SD group's step count S and the SSD group's
        largest K, Q. For one, every group's best choice separates once the
        ratio is linearised at λ (and P(all SSD sequences hit) at the
        incumbent's): N − λ·T. Each candidate is then evaluated exactly; S and
        Q are swept in turn from the incumbent's, λ ← the best ratio, until the
        incumbent stands (Dinkelbach). Each sweep also tries the other mode
        off: a step count held fixed would hide its own fixed cost. λ starts
        at the last round's ratio, where it usually already is."""
        d_step = costs.draft[2]
        # verification is flat up to its knee and linear past it: the picks are linearised with the
        # slope past it and, where there is a flat part, with none (tokens under the knee are free)
        slopes = (costs.ver[1], 0.0) if costs.ver[3] > 0 and costs.ver[1] > 0 else (costs.ver[1],)
        # the build's overrun, max(0, B − V), has no slope to linearise by: picks leave it out
        # and every Q of the sweep is evaluated exactly (with it)
        s_max = max([g.cap for g in groups if "sd" in g.modes] + [base.steps])
        q_max = max([g.cap for g in groups if "ssd" in g.modes] + [base.ssd_k])
        s_values = ([0] if not base.steps else []) + list(range(max(1, base.steps), s_max + 1))
        q_values = ([0] if not base.ssd_k else []) + list(range(max(1, base.ssd_k), q_max + 1))
        best_opts: list[tuple[str, int]] = [("ar", 0)] * len(groups)
        best, all_hit = self._evaluate(groups, best_opts, base, costs)
        config = (s_values[0], q_values[0])
        lam = max(best, self._last_rate)
        seen: set[tuple[tuple[str, int], ...]] = set()
        # P(some SSD sequence misses) is not additive: a group is charged its share of it either
        # as the one that joins the incumbent's SSD sequences (dear) or as one of every group
        # that may run SSD (cheap); both kinds of candidate are generated and evaluated exactly
        weights = [len(g.members) * -math.log(min(max(g.hit_pooled, 1e-9), 1.0 - 1e-9)) if "ssd" in g.modes else 0.0 for g in groups]
        total_weight = sum(weights)
        p_all = 1.0 - math.exp(base.log_hit - total_weight)
        for _ in range(_DINKELBACH_ITERS):
            per_slope = {b_tok: self._linearised(groups, best_opts, weights, lam, b_tok, costs, all_hit, p_all) for b_tok in slopes}

            def picks(s: int, q: int, share: int, per_group: list[tuple[float, list, list, tuple[float, float]]]) -> list[tuple[str, int]]:
                opts = []
                for ar_val, sd_pref, ssd_pref, any_costs in per_group:
                    any_cost = any_costs[share]
                    v, pick = ar_val, ("ar", 0)
                    if s and sd_pref:
                        sv, k = sd_pref[min(s, len(sd_pref)) - 1]
                        if sv - lam * s * d_step > v:
                            v, pick = sv - lam * s * d_step, ("sd", k)
                    if q and ssd_pref:
                        qv, k = ssd_pref[min(q, len(ssd_pref)) - 1]
                        if qv - q * any_cost > v:
                            pick = ("ssd", k)
                    opts.append(pick)
                return opts

            incumbent = best_opts
            for sweep in range(2):  # S with Q held or off, then Q with S held or off
                s_off, q_off = s_values[0], q_values[0]
                if sweep == 0:
                    configs = [(v, q) for v in s_values for q in dict.fromkeys((config[1], q_off))]
                else:
                    configs = [(s, v) for v in q_values for s in dict.fromkeys((config[0], s_off))]
                for (s, q), share, per_group in itertools.product(configs, (0, 1), per_slope.values()):
                    opts = picks(s, q, share, per_group)
                    key = tuple(opts)
                    if key in seen:
                        continue  # configurations that lead to the same choices: evaluated once
                    seen.add(key)
                    r, hit = self._evaluate(groups, opts, base, costs)
                    if r > best * (1.0 + 1e-12):
                        best, best_opts, all_hit, config = r, opts, hit, (s, q)
            if best_opts is incumbent and lam == best:
                break  # λ is the incumbent's own ratio and nothing beats it
            lam = best
            seen.clear()  # λ moved: the same choices may now come from other configurations
        for g, o in zip(groups, best_opts):
            g.opt = o
        self._last_rate = best
        return best

    @staticmethod
    def _linearised(
        groups: list[_Group], incumbent: list[tuple[str, int]], weights: list[float], lam: float, b_tok: float, costs: _Costs,
        all_hit: float, p_all: float,
    ) -> list[tuple[float, list[tuple[float, int]], list[tuple[float, int]], tuple[float, float]]]:
        """Per group, N − λ·T linearised with ``b_tok`` a token: AR's value, SD's and SSD's best
        value up to each K, and SSD's share of P(some sequence misses) (dear, cheap): see
        :meth:`_optimise`."""
        _, e_seq, e_any, e_miss = costs.after
        total_weight = sum(weights)
        per_group = []
        for g, inc, w in zip(groups, incumbent, weights):
            sd = [g.e_sd[k] - g.leave - lam * b_tok * (k + 1) for k in range(1, g.cap + 1)] if "sd" in g.modes else []
            ssd = (
                [g.e_ssd[k] - lam * (b_tok * (k + 1) + e_seq + e_miss * (1.0 - g.hit[k]) * k) for k in range(1, g.cap + 1)]
                if "ssd" in g.modes
                else []
            )
            c = len(g.members)
            joined = (g.hit[inc[1]] if inc[0] == "ssd" else g.hit_pooled) ** c
            others = all_hit / joined if inc[0] == "ssd" and joined > 0 else all_hit
            dear = lam * e_any * others * (1.0 - joined) / c
            cheap = lam * e_any * p_all * w / total_weight / c if w else dear
            per_group.append((g.value(("ar", 0)) - lam * b_tok, _prefix_best(sd), _prefix_best(ssd), (dear, cheap)))
        return per_group

    # ------------------------------------------------------------------ exploring

    def _cost_evidence(self, mode: str) -> float:
        """Recent rounds behind what ``mode`` costs beyond verification: its
        drafting, or for AR the control plane of a round that drafts nothing."""
        if mode == "sd":
            return self._drafting.weight
        return self._after.weight if mode == "ssd" else self._plain

    def _optimistic(self, g: _Group) -> _Group:
        """``g`` valued with its bucket's acceptance and hit rates at their upper bounds."""
        up = _Group(g.bucket, g.scale, g.cap, g.modes, g.in_ssd)
        up.members = g.members
        hits = self._hit[g.bucket]
        _fill_values(up, self._accept[g.bucket].upper(), self._miss[g.bucket].upper(), hits.upper, hits.pooled.upper())
        return up

    def _neighbours(self, g: _Group) -> list[tuple[str, int]]:
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

    def _try_explore(self, groups: list[_Group], base: _Load, costs: _Costs, best: float) -> None:
        """Maybe move every group at one choice to a neighbouring choice
        (docs/auto.md, "Exploration": which, and when). All groups at that choice move:
        the cost fits learn from what the whole round does."""
        if self._budget_s <= 0.0 or self._explored + 1 > self.explore * self._chosen:
            return
        opts = [g.opt for g in groups]
        optimistic: dict[int, _Group] = {}
        # (kind, -score, tie-break, from, to): optimistic candidates rank before blind cost
        # checks, whose inflated score is no estimate to compare with theirs
        candidates: list[tuple[int, float, float, tuple[str, int], tuple[str, int]]] = []
        trials: dict[tuple[tuple[str, int], tuple[str, int]], tuple[list[int], list[tuple[str, int]], float]] = {}
        for opt in dict.fromkeys(opts):
            for alt in self._neighbours(next(g for g in groups if g.opt == opt)):
                moved = [i for i, g in enumerate(groups) if g.opt == opt and alt in self._neighbours(g)]
                trial = [alt if i in moved else o for i, o in enumerate(opts)]
                cost = -sum(len(groups[i].members) * groups[i].excursion(alt) for i in moved)
                trials[opt, alt] = (moved, trial, cost)
                for i in moved:
                    if i not in optimistic:
                        optimistic[i] = self._optimistic(groups[i])
                # optimistic rates: if they hold, the choice is kept, so its switch is amortised
                # as in any choice; a check of thin cost evidence is one round out, paid in full
                up = [optimistic[i] if i in moved else g for i, g in enumerate(groups)]
                score = self._evaluate(up, trial, base, costs)[0]
                if score > best:
                    candidates.append((0, -score, self._rng.random(), opt, alt))
                elif self._cost_evidence(alt[0]) < EVIDENCE_MIN:
                    score = self._evaluate(groups, trial, base, costs, cost)[0]
                    if score > (1.0 - EXPLORE_MARGIN) * best:
                        candidates.append((1, -score, self._rng.random(), opt, alt))
        if not candidates:
            return
        _, _, _, opt, alt = min(candidates)
        moved, trial, cost = trials[opt, alt]
        moved_groups = [groups[i] for i in moved]
        rounds = 1
        if alt[0] == "ssd" and not all(g.in_ssd for g in moved_groups):
            # held past the entry (a forced miss that measures no hit rate) for enough lookups
            lookups = sum(len(g.members) for g in moved_groups)
            rounds = min(_ENTRY_EXPLORE_MAX, 1 + -(-_ENTRY_EXPLORE_LOOKUPS // lookups))
        e, t, _ = self._round_of(groups, trial, base, costs, cost)
        if rounds * max(0.0, t - e / best) > self._budget_s or self._explored + rounds > self.explore * self._chosen:
            return  # the most promising waits until the budget covers all its rounds
        log.debug("auto explores %s instead of %s for %d sequence(s)", alt, opt, sum(len(g.members) for g in moved_groups))
        self._explored += 1
        self._trial_rate = self._explore_ref = best  # held rounds are charged against the same rate
        for g in moved_groups:
            g.opt = alt
            if rounds > 1:
                self._held.update({s: (Choice(*alt), rounds - 1) for s in g.seq_ids})

    # ------------------------------------------------------------------ reporting

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for engine metrics and the benchmark."""

        def coef(fit: EwLeastSquares, names: tuple[str, ...]) -> dict[str, float] | None:
            theta = fit.theta
            return None if theta is None else {n: float(v) for n, v in zip(names, theta)}

        return {
            "rounds_observed": self._observed,
            "rounds_chosen": self._chosen,
            "rounds_explored": self._explored,
            "explore_s": self._trial_s,  # what trial rounds measured beyond their reference rates
            "explore_budget_s": self._budget_s,
            "wall_s": self._wall_s,  # wall time observed (explore_s / wall_s: the share trials cost)
            "verify_s": None if self._verify.theta is None else dict(zip(("a", "per_token", "per_seq", "knee", "ssd"), self._verify.theta)),
            "draft_s": coef(self._drafting, ("a", "per_step", "per_step_seq")),
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
                        round(h, 4) for h in self._hit[b].values(_all_accepted(_expected_tokens(self._accept[b].alphas(), 1.0, self.max_k)))[1:]
                    ],
                }
                for b, name in enumerate(BUCKETS)
            },
            "last_choice": dict(self._last_counts),
            "predicted_tokens_per_s": self._last_rate,  # what the last search expected of its choice
            "guard_held": self._guard.held,  # rounds whose speculating choice gave way to AR (measuring it, or faster)
        }


def _fill_values(
    g: _Group, alphas: list[float], miss: list[float], hit_rates: Callable[[Sequence[float]], list[float]], pooled: float
) -> None:
    """A group's expected tokens by mode and K under these acceptance rates and
    hit rates (``hit_rates``: by K, from P(all K accepted) by K; ``pooled``: over every K)."""
    e_draft = _expected_tokens(alphas, g.scale, g.cap)
    hits = hit_rates(_all_accepted(e_draft))
    g.hit, g.hit_pooled = hits, pooled
    if g.cap == 0:
        return
    if "sd" in g.modes:
        g.e_sd = e_draft
    if "ssd" in g.modes:
        e_miss = _expected_tokens(miss, 1.0, g.cap)
        g.entry = [h * max(0.0, d - m) for h, d, m in zip(hits, e_draft, e_miss)]
        switch = [x / SWITCH_HORIZON for x in g.entry]
        e_ssd = [h * d + (1.0 - h) * m for h, d, m in zip(hits, e_draft, e_miss)]
        g.e_ssd = e_ssd if g.in_ssd else [e - s for e, s in zip(e_ssd, switch)]
        g.leave = max(switch) if g.in_ssd else 0.0


def _all_accepted(expected: list[float]) -> list[float]:
    """P(all K accepted) for K = 0.. from :func:`_expected_tokens`'s output (its increments)."""
    return [1.0] + [b - a for a, b in zip(expected, expected[1:])]


def _clamp_time(seconds: float) -> float:
    """A measured residual time, at least 0 (clocks overlap by a little); NaN stays NaN so
    the fit skips it."""
    return max(0.0, seconds) if seconds == seconds else seconds


def _rate(option: dict[str, Any]) -> float:
    """An option's predicted tokens per second."""
    return option["tokens"] / option["seconds"] if option["seconds"] > 0 else math.inf


def _prefix_best(values: list[float]) -> list[tuple[float, int]]:
    """For each K = 1..len: the best (value, k) with k <= K (values[k-1] is K = k's)."""
    out: list[tuple[float, int]] = []
    for k, v in enumerate(values, start=1):
        out.append((v, k) if not out or v > out[-1][0] else out[-1])
    return out
