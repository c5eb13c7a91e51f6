"""The ``auto`` strategy: which fixed strategy each sequence runs next round, from costs fitted online.

Every strategy is exact (each proposal is verified against the target's law
with the law it was drawn from), so the choice changes speed only. Before a
round :class:`AutoPolicy` picks, for every ``auto`` sequence, AR (K = 0), SD
with K or SSD with K so as to maximise the batch's expected emitted tokens
per second of the round,

    Σ_i E_i(mode_i, K_i)  /  T(the whole assignment),

with the batch's fixed-strategy sequences in both sums (they share the
round). After the round :meth:`AutoPolicy.observe` feeds what it cost back.

What the model assumes, and why:

* **Verification** costs ``a + b·tokens`` (tokens = Σ (K_i + 1) over the
  batch). A target is memory-bound at small token counts (tokens nearly free)
  and compute-bound past a knee; an exponentially weighted least-squares line
  over recent rounds is the chord over the token counts actually run lately,
  which is the range the next choice is compared within. Exploring
  neighbouring K keeps that range around the current choice, so the chord
  follows the knee instead of extrapolating across it.
* **SD drafting** is on the critical path: S sequential draft steps, S = the
  largest K among the round's SD sequences (the others ride along in those
  steps), each step costing ``c + d·n`` for n SD sequences (a small draft is
  memory-bound too).
* **SSD drafting** hides behind verification (its whole point) except what is
  exposed — the tree build's overrun and the backups of misses — fitted as
  ``e0 + e1·n + e2·ΣK`` over rounds with n > 0 SSD sequences (none: 0). The
  build's budget and fan-out are the SSD machinery's own choice; the hit rate
  is taken per temperature bucket, independent of K and of the batch.
* **Control plane** per round, ``c0 + c1·batch``: what the coordinator sees
  beyond the workers' measured times (a round that emits one token per
  sequence pays it all the same, which is what makes AR lose on a small box).
* **Acceptance** is conditional per position, ``α_j = P(accept j | accepted
  j−1)``, per temperature bucket (T = 0, (0, 0.5], (0.5, 1], > 1: the draft's
  agreement with the target falls as sampling spreads), from exponentially
  decayed counts shrunk towards the bucket's pooled rate (a position never
  tested gets the pooled rate: the conditional rate varies slowly with the
  position). Expected emitted tokens of K speculated: ``1 + Σ_{i≤K} Π_{j≤i}
  α_j``. A sequence's own pooled rate, shrunk towards its bucket's with the
  weight of a few observations (a young sequence is its bucket), scales the
  bucket's curve: prompts differ in how predictable they are, while the
  per-position shape is the draft's. An SSD hit's speculation was drafted
  from the true outcome by the same draft, so it is accepted like SD; a miss
  is served by the backup, whose acceptance has its own table:
  ``E_ssd = h·E_hit + (1 − h)·E_miss``.
* **Switching into or out of SSD costs**: entering has no cache for the first
  round (a forced miss, the backup's E instead of SSD's), leaving drops the
  cached speculation (coming back pays the entry again). Either switch is
  charged ``(E_ssd − E_miss) / H`` tokens, H = :data:`SWITCH_HORIZON` rounds,
  the span a choice is expected to hold — a hysteresis band that keeps a
  sequence near the SD/SSD boundary from flapping every round.

**Search.** Sequences alike for the model (same bucket, quantised own rate,
K cap, allowed modes, whether in SSD) form one group and get one choice; for
fixed (a) SD step count S and (b) SSD on or off, every group's best choice
separates once the ratio is linearised at its current value λ (Dinkelbach:
maximise N − λ·T, then λ ← N/T); each of those at most 2·(max_k + 1)
configurations is then evaluated exactly and the best ratio kept, a few λ
iterations in all. Nothing is searched per sequence, so a round's choice for
64 sequences costs well under a millisecond.

**Exploration** is bounded: at most ``explore`` of the rounds chosen (counted
in :meth:`AutoPolicy.snapshot`) switch one group to a neighbouring choice (K
± 1, SD ⇄ SSD, AR ⇄ K = 1) whose evidence is thin (few recent observations
of that position's acceptance, of that mode's cost, or of verification near
that token count) and whose estimate is within :data:`EXPLORE_MARGIN` of the
best — a choice the data already rules out is not tried again until its
evidence has decayed. Without it a K never run would be judged forever by the
prior. It is deterministic given ``seed``.

**Cold start**: before any round has been observed the model has no time
scale, so a sequence starts at SD (else SSD) with K = ``max_k // 2`` — a
round that measures the draft's step cost and acceptance, the inputs every
speculative choice needs; unobserved costs are then priors relative to the
measured verification (a draft step a fifth of a verification step).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

AUTO_MODES = ("ar", "sd", "ssd")  # the fixed modes auto chooses among
RESULT_MODES = (*AUTO_MODES, "pyramid")  # what a finished round may report (fixed requests included)
BUCKETS = ("t=0", "t<=0.5", "t<=1", "t>1")
SWITCH_HORIZON = 8  # rounds a choice is expected to hold: the SSD switch cost is spread over them
EXPLORE_MARGIN = 0.3  # explore a choice only if its estimate is within this share of the best
EVIDENCE_MIN = 3.0  # fewer (decayed) rounds than this behind a cost: its estimate is uncertain
UPPER_Z = 1.5  # optimism of exploration: acceptance and hit rates this many standard errors up
COST_DECAY = 0.97  # per round: cost fits weigh the last ~30 rounds
ACCEPT_DECAY = 0.99  # per round: acceptance counts weigh the last ~100 rounds
SEQ_STALE_ROUNDS = 256  # a sequence unseen this long is gone: its statistics are dropped

# acceptance priors per bucket (a moderately good draft, worse as sampling spreads) and the
# pseudo-observations they are worth; an SSD miss's backup is unknown (fast or neural): 0.3
_ACCEPT_PRIOR = (0.7, 0.6, 0.5, 0.4)
_MISS_PRIOR = 0.3
_HIT_PRIOR = 0.5
_PRIOR_WEIGHT = 4.0  # bucket pooled rate ← prior; position rate ← pooled rate; hit rate ← prior
_SEQ_WEIGHT = 8.0  # a sequence's own rate ← its bucket's
_RATE_STEPS = 20  # a sequence's rate is quantised to 1/20 for grouping
_ALPHA_MAX = 0.99
_DRAFT_STEP_PRIOR = 0.2  # an unmeasured draft step costs this share of a verification of as many tokens
_SSD_EXPOSED_PRIOR = 0.1  # unmeasured SSD exposure: this share of the verification intercept
_DINKELBACH_ITERS = 4
_ENTRY_EXPLORE_ROUNDS = 2  # an exploration into SSD runs this many rounds (see AutoPolicy._try_explore)
_COLD_ROUNDS = 4  # rounds of the cold-start schedule (see AutoPolicy._cold_start)
_FIT_PRIOR_WEIGHT = 0.001


def temperature_bucket(temperature: float) -> int:
    """The index in :data:`BUCKETS` of a sequence sampled at ``temperature``."""
    if temperature <= 0.0:
        return 0
    if temperature <= 0.5:
        return 1
    return 2 if temperature <= 1.0 else 3


@dataclass(frozen=True)
class SeqView:
    """One sequence before a round. ``k_cap``: the largest K allowed this round
    (0: only AR). ``modes``: the fixed modes allowed for it (``ar`` always).
    ``current``: the mode it ran last round (None: new) — leaving ``ssd``
    drops its cached speculation, entering it costs a backup proposal."""

    seq_id: int
    temperature: float
    k_cap: int
    modes: tuple[str, ...]
    current: str | None

    def __post_init__(self) -> None:
        if not isinstance(self.k_cap, int) or self.k_cap < 0:
            raise ConfigError(f"SeqView.k_cap must be an integer >= 0, got {self.k_cap!r}")
        if "ar" not in self.modes or any(m not in AUTO_MODES for m in self.modes):
            raise ConfigError(f"SeqView.modes must include 'ar' and name only {', '.join(AUTO_MODES)}; got {self.modes!r}")


@dataclass(frozen=True)
class Choice:
    """A sequence's strategy for one round: ``ar`` with K = 0, or ``sd``/``ssd``
    (``pyramid`` for a fixed request) with K >= 1 draft tokens."""

    mode: str
    k: int

    def __post_init__(self) -> None:
        if self.mode not in RESULT_MODES:
            raise ConfigError(f"Choice.mode must be one of {', '.join(RESULT_MODES)}; got {self.mode!r}")
        if not isinstance(self.k, int) or (self.k != 0 if self.mode == "ar" else self.k < 1):
            raise ConfigError(f"Choice.k must be 0 for 'ar' and >= 1 otherwise; got {self.mode!r} with k={self.k!r}")


@dataclass(frozen=True)
class SeqResult:
    """One sequence in a finished round: ``proposed`` draft tokens verified (0
    for AR), ``accepted`` of them; ``hit``: an SSD lookup's outcome (None: not
    SSD, or the sequence finished)."""

    seq_id: int
    temperature: float
    mode: str
    proposed: int
    accepted: int
    hit: bool | None


@dataclass(frozen=True)
class RoundCosts:
    """One finished round, in seconds (see the field notes of the brief this
    mirrors): verification of ``verify_tokens`` for ``batch`` sequences,
    ``draft_steps`` sequential SD draft steps over ``draft_batch`` sequences,
    the SSD drafting of ``ssd_batch`` sequences not hidden behind verification,
    and the round's wall time as the coordinator saw it."""

    batch: int
    verify_tokens: int
    verify_s: float
    draft_steps: int
    draft_batch: int
    draft_s: float
    ssd_batch: int
    ssd_exposed_s: float
    wall_s: float
    seqs: tuple[SeqResult, ...]


class _EwLeastSquares:
    """``y ≈ θ·x`` (x[0] = 1, the intercept) by exponentially weighted least
    squares, anchored to a prior θ0 (set at the first observation, so it
    needs no time scale: given, or that observation split between the
    intercept and the features) only as firmly as :data:`_FIT_PRIOR_WEIGHT` of an
    observation: enough to settle a direction the data leave open (every
    round at one token count), too little to pull against a real spread. Slopes are kept
    non-negative: a cost never falls as its load grows, and a negative slope
    fitted from noise would send the search to the largest load."""

    def __init__(self, n: int, decay: float, intercept_share: float = 0.8) -> None:
        self.n = n
        self.decay = decay
        self.intercept_share = intercept_share
        self.weight = 0.0  # effective number of observations
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._prior: list[float] | None = None
        self._ridge: list[float] = [0.0] * n
        self._theta: list[float] | None = None

    def _set_prior(self, x: Sequence[float], y: float, prior: Sequence[float] | None) -> None:
        if prior is None:
            share = (1.0 - self.intercept_share) / max(1, self.n - 1)
            prior = [self.intercept_share * y] + [share * y / xi if xi > 0 else 0.0 for xi in x[1:]]
        self._prior = list(prior)
        self._ridge = [_FIT_PRIOR_WEIGHT * max(xi, 1.0) ** 2 for xi in (1.0, *x[1:])]

    @property
    def has_prior(self) -> bool:
        return self._prior is not None

    def add(self, x: Sequence[float], y: float, prior: Sequence[float] | None = None) -> None:
        """One observation; ``prior``: θ0, used only if this is the first."""
        if not (math.isfinite(y) and all(math.isfinite(v) for v in x)):
            return
        if self._prior is None:
            self._set_prior(x, y, prior)
        g = self.decay
        for i in range(self.n):
            row = self._xtx[i]
            for j in range(self.n):
                row[j] = g * row[j] + x[i] * x[j]
            self._xty[i] = g * self._xty[i] + x[i] * y
        self.weight = g * self.weight + 1.0
        self._theta = None

    def decay_only(self) -> None:
        """A round without an observation of this cost: its evidence ages."""
        self.weight *= self.decay

    @property
    def theta(self) -> list[float] | None:
        """The fitted coefficients (None before any observation)."""
        if self._prior is None:
            return None
        if self._theta is None:
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> list[float]:
        assert self._prior is not None
        free = list(range(self.n))
        while True:
            theta = [0.0] * self.n
            sol = _solve_linear(
                [[self._xtx[i][j] + (self._ridge[i] if i == j else 0.0) for j in free] for i in free],
                [self._xty[i] + self._ridge[i] * self._prior[i] for i in free],
            )
            for i, v in zip(free, sol):
                theta[i] = v
            negative = [i for i in free[1:] if theta[i] < 0.0]
            if not negative:
                return theta
            free = [i for i in free if i not in negative]  # fix those slopes at 0 and refit the rest


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the tiny (n <= 3) normal equations."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return [0.0] * n
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= f * m[c][j]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][j] * out[j] for j in range(r + 1, n))) / m[r][r]
    return out


class _Acceptance:
    """Decayed per-position counts of one kind of proposal in one bucket.

    The prior is a pseudo-count that ages with the data: estimates keep what
    was last seen while nothing new arrives (only the evidence fades, which is
    what exploration reads), instead of sliding back to the prior."""

    def __init__(self, max_k: int, prior: float) -> None:
        self.prior = prior
        self.prior_weight = _PRIOR_WEIGHT
        self.tested = [0.0] * max_k
        self.accepted = [0.0] * max_k

    def age(self) -> None:
        self.prior_weight *= ACCEPT_DECAY
        for j in range(len(self.tested)):
            self.tested[j] *= ACCEPT_DECAY
            self.accepted[j] *= ACCEPT_DECAY

    def add(self, proposed: int, accepted: int) -> None:
        # position j (1-based) was tested iff the first j-1 were accepted
        for j in range(min(proposed, accepted + 1, len(self.tested))):
            self.tested[j] += 1.0
            if accepted > j:
                self.accepted[j] += 1.0

    def pooled(self) -> float:
        return (sum(self.accepted) + self.prior_weight * self.prior) / (sum(self.tested) + self.prior_weight)

    def alphas(self) -> list[float]:
        r = self.pooled()
        return [min(_ALPHA_MAX, (a + _PRIOR_WEIGHT * r) / (t + _PRIOR_WEIGHT)) for a, t in zip(self.accepted, self.tested)]

    def upper(self) -> list[float]:
        """Optimistic per-position rates: :data:`UPPER_Z` standard errors above the estimate."""
        return [min(_ALPHA_MAX, _upper(a, t)) for a, t in zip(self.alphas(), self.tested)]


class _Rate:
    """A decayed Bernoulli rate whose prior pseudo-count ages with the data (as :class:`_Acceptance`)."""

    def __init__(self, prior: float) -> None:
        self.hits = _PRIOR_WEIGHT * prior
        self.total = _PRIOR_WEIGHT
        self.n = 0.0  # real observations (decayed): the evidence

    def age(self) -> None:
        self.hits *= ACCEPT_DECAY
        self.total *= ACCEPT_DECAY
        self.n *= ACCEPT_DECAY

    def add(self, hit: bool) -> None:
        self.n += 1.0
        self.total += 1.0
        self.hits += 1.0 if hit else 0.0

    @property
    def value(self) -> float:
        return self.hits / self.total

    def upper(self) -> float:
        return min(1.0, _upper(self.value, self.n))


def _upper(p: float, n: float) -> float:
    return p + UPPER_Z * math.sqrt(p * (1.0 - p) / (n + 1.0))


@dataclass
class _SeqStat:
    tested: float = 0.0
    accepted: float = 0.0
    seen: int = 0  # the round it was last observed


def _expected_tokens(alphas: Sequence[float], scale: float, k_max: int) -> list[float]:
    """E[emitted] for K = 0..k_max speculated: 1 + Σ_{i≤K} Π_{j≤i} α_j (α_j scaled, capped)."""
    out = [1.0]
    run = 1.0
    for j in range(k_max):
        run *= min(_ALPHA_MAX, alphas[j] * scale)
        out.append(out[-1] + run)
    return out


@dataclass
class _Load:
    """A round's totals as the cost model sees them: the fixed sequences' part, then a candidate's."""

    n: int = 0
    tokens: int = 0
    e: float = 0.0  # expected emitted tokens (switch costs included)
    n_sd: int = 0
    steps: int = 0  # the SD group's largest K: its sequential draft steps
    n_ssd: int = 0
    ssd_k: int = 0  # the SSD group's largest K: a neural backup's sequential steps
    log_hit: float = 0.0  # log P(every SSD sequence hits)
    miss_k: float = 0.0  # expected Σ K over the SSD sequences that miss

    def add(self, count: int, mode: str, k: int, e: float, hit: float) -> None:
        self.n += count
        self.tokens += count * (k + 1)
        self.e += count * e
        if mode == "sd":
            self.n_sd += count
            self.steps = max(self.steps, k)
        elif mode == "ssd":
            self.n_ssd += count
            self.ssd_k = max(self.ssd_k, k)
            self.log_hit += count * math.log(min(max(hit, 1e-9), 1.0 - 1e-9))
            self.miss_k += count * (1.0 - hit) * k

    def copy(self) -> "_Load":
        return replace(self)


@dataclass
class _Costs:
    """The fitted coefficients one choice is made with (plain floats, read once per round)."""

    ver: tuple[float, float]  # a, per token
    step: tuple[float, float]  # a, per SD sequence
    ssd: tuple[float, float, float, float]  # a, per SSD sequence, per backup step when any misses, per missed K
    ctl: tuple[float, float]  # a, per sequence

    def round_time(self, load: _Load) -> float:
        t = max(0.0, self.ctl[0] + self.ctl[1] * load.n) + max(0.0, self.ver[0] + self.ver[1] * load.tokens)
        if load.n_sd and load.steps:
            t += load.steps * max(0.0, self.step[0] + self.step[1] * load.n_sd)
        if load.n_ssd:
            p_any = 1.0 - math.exp(load.log_hit)
            t += max(0.0, self.ssd[0] + self.ssd[1] * load.n_ssd + self.ssd[2] * load.ssd_k * p_any + self.ssd[3] * load.miss_k)
        return t


class _Group:
    """Sequences the model cannot tell apart: one choice for all of them."""

    __slots__ = ("bucket", "scale", "cap", "modes", "in_ssd", "members", "seq_ids", "hit", "e_sd", "e_ssd", "leave", "opt")

    def __init__(self, bucket: int, scale: float, cap: int, modes: frozenset[str], in_ssd: bool) -> None:
        self.bucket = bucket
        self.scale = scale  # the members' own acceptance relative to their bucket's
        self.cap = cap
        self.modes = modes
        self.in_ssd = in_ssd
        self.hit = _HIT_PRIOR
        self.members: list[int] = []  # indices into the round's auto sequences
        self.seq_ids: list[int] = []
        self.e_sd: list[float] = [1.0]  # expected tokens by K (index 0: AR), switch cost included
        self.e_ssd: list[float] = [1.0]
        self.leave = 0.0  # a sequence in SSD choosing AR or SD pays this (the hysteresis band)
        self.opt: tuple[str, int] = ("ar", 0)

    def value(self, opt: tuple[str, int]) -> float:
        mode, k = opt
        if mode == "ssd":
            return self.e_ssd[k]
        return (self.e_sd[k] if mode == "sd" else 1.0) - self.leave


class AutoPolicy:
    """Chooses AR / SD K / SSD K per ``auto`` sequence each round (module docstring: the model).

    ``modes``: the fixed modes it may choose (``ar`` always; ``sd``/``ssd``
    need a draft). ``max_k``: the largest K it considers. ``explore``: the
    largest share of rounds that may try an uncertain neighbouring choice.
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
        self._verify = _EwLeastSquares(2, COST_DECAY)
        self._step = _EwLeastSquares(2, COST_DECAY)
        self._ssd = _EwLeastSquares(4, COST_DECAY, intercept_share=0.5)
        self._ctl = _EwLeastSquares(2, COST_DECAY)
        self._draft = [_Acceptance(max_k, p) for p in _ACCEPT_PRIOR]  # SD, and SSD hits
        self._miss = [_Acceptance(max_k, _MISS_PRIOR) for _ in BUCKETS]  # SSD misses (the backup's proposal)
        self._hit = [_Rate(_HIT_PRIOR) for _ in BUCKETS]
        self._tokens_seen: dict[int, float] = {}  # decayed count of verifications by log-token bin
        self._seqs: dict[int, _SeqStat] = {}
        self._entering: set[int] = set()  # sequences whose SSD round just chosen is a forced miss
        self._held: dict[int, tuple[Choice, int]] = {}  # an exploration in progress: choice, rounds left
        self._observed = 0
        self._chosen = 0
        self._explored = 0
        self._last_counts = {m: 0 for m in AUTO_MODES}

    # ------------------------------------------------------------------ learning

    def observe(self, costs: RoundCosts) -> None:
        """Fit the model to one finished round (fixed-strategy sequences included)."""
        self._observed += 1
        if costs.verify_tokens > 0 and costs.verify_s >= 0.0:
            self._verify.add((1.0, float(costs.verify_tokens)), costs.verify_s)
            for b in list(self._tokens_seen):
                self._tokens_seen[b] *= COST_DECAY
            b = _token_bin(costs.verify_tokens)
            self._tokens_seen[b] = self._tokens_seen.get(b, 0.0) + 1.0
        if costs.draft_steps > 0 and costs.draft_batch > 0:
            self._step.add((1.0, float(costs.draft_batch)), costs.draft_s / costs.draft_steps)
        else:
            self._step.decay_only()
        ssd = [r for r in costs.seqs if r.mode == "ssd"]
        if costs.ssd_batch > 0 and ssd:
            missed = [r.proposed for r in ssd if r.hit is False]
            k_max = max(r.proposed for r in ssd)
            x = (1.0, float(costs.ssd_batch), float(k_max if missed else 0), float(sum(missed)))
            self._ssd.add(x, max(0.0, costs.ssd_exposed_s), self._ssd_prior(x, costs.ssd_exposed_s))
        else:
            self._ssd.decay_only()
        control = costs.wall_s - costs.verify_s - costs.draft_s - costs.ssd_exposed_s
        self._ctl.add((1.0, float(costs.batch)), max(0.0, control))
        for table in (*self._draft, *self._miss):
            table.age()
        for rate in self._hit:
            rate.age()
        for r in costs.seqs:
            self._observe_seq(r)
        self._entering.clear()
        if self._observed % SEQ_STALE_ROUNDS == 0:
            stale = self._observed - SEQ_STALE_ROUNDS
            self._seqs = {s: st for s, st in self._seqs.items() if st.seen > stale}

    def _observe_seq(self, r: SeqResult) -> None:
        st = self._seqs.get(r.seq_id)
        if st is None:
            st = self._seqs[r.seq_id] = _SeqStat()
        st.seen = self._observed
        if r.mode not in ("sd", "ssd") or r.proposed <= 0:
            return  # AR speculates nothing; PyramidSD's proposals are qualified tokens, another law
        b = temperature_bucket(r.temperature)
        accepted = max(0, min(r.accepted, r.proposed))
        if r.mode == "ssd":
            if r.hit is None:
                return  # it finished: its count may be cut short, and hit or miss is unknown
            if r.seq_id not in self._entering:  # an entry round's miss is forced, not the cache's rate
                self._hit[b].add(r.hit)
            if not r.hit:
                self._miss[b].add(r.proposed, accepted)
                return
        self._draft[b].add(r.proposed, accepted)
        st.tested += min(r.proposed, accepted + 1)
        st.accepted += accepted

    def _ssd_prior(self, x: Sequence[float], y: float) -> list[float] | None:
        """SSD exposure's prior: a neural backup is K sequential steps of the same
        draft SD measures, so its terms start at the draft's step cost; the
        rest of the first observation is the build's overrun."""
        step = self._step.theta
        if self._ssd.has_prior or step is None:
            return None
        rest = max(0.0, y - step[0] * x[2] - step[1] * x[3])
        return [0.5 * rest, 0.5 * rest / max(1.0, x[1]), step[0], step[1]]

    # ------------------------------------------------------------------ choosing

    def choose(self, auto: Sequence[SeqView], fixed: Sequence[tuple[SeqView, Choice]] = ()) -> list[Choice]:
        """One Choice per ``auto`` sequence (same order). ``fixed``: the batch's other
        sequences with the strategy their request fixed — they share the round's time."""
        self._chosen += 1
        if self._observed < _COLD_ROUNDS or self._verify.theta is None:
            choices = [self._cold_start(v) for v in auto]
        else:
            choices = self._search(auto, fixed)
        counts = {m: 0 for m in AUTO_MODES}
        for c in choices:
            counts[c.mode] += 1
        self._last_counts = counts
        self._entering = {v.seq_id for v, c in (*zip(auto, choices), *fixed) if c.mode == "ssd" and v.current != "ssd"}
        return choices

    def _cold_start(self, v: SeqView) -> Choice:
        """Before the model has a time scale: SD at half a middle K (the
        draft's step cost), then SSD at the middle K (an entry, then steady
        rounds: hit rate and exposure, and a second token count for
        verification)."""
        mid = max(1, self.max_k // 2)
        allowed = self.modes.intersection(v.modes)
        order = ("sd", "ssd") if self._observed == 0 else ("ssd", "sd")
        for mode in order:
            if mode in allowed and v.k_cap >= 1:
                k = mid if mode == "ssd" else max(1, mid // 2)
                return Choice(mode, min(k, v.k_cap))
        return Choice("ar", 0)

    def _costs(self) -> _Costs:
        ver = self._verify.theta
        assert ver is not None
        # unmeasured costs: priors relative to the measured verification
        step = self._step.theta or [_DRAFT_STEP_PRIOR * ver[0], _DRAFT_STEP_PRIOR * ver[1]]
        ssd = self._ssd.theta or [_SSD_EXPOSED_PRIOR * ver[0], 0.0, _DRAFT_STEP_PRIOR * ver[0], 0.0]
        ctl = self._ctl.theta or [0.0, 0.0]
        return _Costs((ver[0], ver[1]), (step[0], step[1]), (ssd[0], ssd[1], ssd[2], ssd[3]), (ctl[0], ctl[1]))

    def _seq_scale(self, seq_id: int, pooled: float) -> float:
        """The sequence's own pooled acceptance over its bucket's, shrunk and quantised."""
        st = self._seqs.get(seq_id)
        if st is None or st.tested <= 0.0:
            return 1.0
        own = (st.accepted + _SEQ_WEIGHT * pooled) / (st.tested + _SEQ_WEIGHT)
        return max(1, round(own * _RATE_STEPS)) / _RATE_STEPS / pooled

    def _search(self, auto: Sequence[SeqView], fixed: Sequence[tuple[SeqView, Choice]]) -> list[Choice]:
        costs = self._costs()
        curves: dict[int, tuple[list[float], list[float], float, float]] = {}

        def curve(b: int) -> tuple[list[float], list[float], float, float]:
            if b not in curves:
                d = self._draft[b]
                curves[b] = (d.alphas(), self._miss[b].alphas(), d.pooled(), self._hit[b].value)
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
            alphas, miss, pooled, hit = curve(b)
            scale = self._seq_scale(v.seq_id, pooled)
            key = (b, scale, cap, modes, v.current == "ssd")
            g = groups.get(key)
            if g is None:
                g = groups[key] = _Group(b, scale, cap, modes, v.current == "ssd")
                _fill_values(g, alphas, miss, hit)
            g.members.append(i)
            g.seq_ids.append(v.seq_id)
        self._age_holds()
        base = self._fixed_load((*fixed, *held), curve)
        glist = list(groups.values())
        best = self._optimise(glist, base, costs)
        if held:
            self._explored += 1
        elif self.explore:
            self._try_explore(glist, base, costs, best)
        for g in glist:
            c = Choice(*g.opt)
            for i in g.members:
                out[i] = c
        return out  # type: ignore[return-value]

    def _age_holds(self) -> None:
        self._held = {s: (c, left - 1) for s, (c, left) in self._held.items() if left > 1}

    def _fixed_load(self, fixed: Sequence[tuple[SeqView, Choice]], curve) -> _Load:
        load = _Load()
        for v, c in fixed:
            b = temperature_bucket(v.temperature)
            alphas, miss, pooled, hit = curve(b)
            k = min(c.k, self.max_k)
            e = _expected_tokens(alphas, self._seq_scale(v.seq_id, pooled), k)[k]
            if c.mode == "ssd":
                e = hit * e + (1.0 - hit) * _expected_tokens(miss, 1.0, k)[k]
            load.add(1, c.mode, c.k, e, hit)
        return load

    def _evaluate(self, groups: list[_Group], opts: list[tuple[str, int]], base: _Load, costs: _Costs) -> tuple[float, float]:
        """(expected tokens per second, P(every SSD sequence hits)) of the round if group i runs opts[i]."""
        load = base.copy()
        for g, opt in zip(groups, opts):
            load.add(len(g.members), opt[0], opt[1], g.value(opt), g.hit)
        t = costs.round_time(load)
        return (load.e / t if t > 0 else math.inf), math.exp(load.log_hit)

    def _optimise(self, groups: list[_Group], base: _Load, costs: _Costs) -> float:
        """Sets every group's ``opt``; returns the predicted tokens per second.

        For each configuration — the SD group's step count S and the SSD
        group's largest K, Q — every group's best choice separates once the
        ratio is linearised at λ (and P(all SSD hit) at the incumbent's); the
        candidate is then evaluated exactly. λ and the incumbent are updated
        until the incumbent stands (Dinkelbach)."""
        b_tok, d_step = costs.ver[1], costs.step[1]
        _, e_seq, e_any, e_miss = costs.ssd
        s_max = max([g.cap for g in groups if "sd" in g.modes] + [base.steps])
        q_max = max([g.cap for g in groups if "ssd" in g.modes] + [base.ssd_k])
        s_values = ([0] if not base.steps else []) + list(range(max(1, base.steps), s_max + 1))
        q_values = ([0] if not base.ssd_k else []) + list(range(max(1, base.ssd_k), q_max + 1))
        best_opts: list[tuple[str, int]] = [("ar", 0)] * len(groups)
        best, all_hit = self._evaluate(groups, best_opts, base, costs)
        lam = best
        for _ in range(_DINKELBACH_ITERS):
            per_group = []
            for g, inc in zip(groups, best_opts):
                ar_val = g.value(("ar", 0)) - lam * b_tok
                sd_pref = _prefix_best([g.e_sd[k] - g.leave - lam * b_tok * (k + 1) for k in range(1, g.cap + 1)] if "sd" in g.modes else [])
                miss = 1.0 - g.hit
                ssd_pref = _prefix_best(
                    [g.e_ssd[k] - lam * (b_tok * (k + 1) + e_seq + e_miss * miss * k) for k in range(1, g.cap + 1)] if "ssd" in g.modes else []
                )
                # the group's share of what it adds to P(some SSD sequence misses) if all of it runs SSD
                c = len(g.members)
                joined = g.hit**c
                others = all_hit / joined if inc[0] == "ssd" and joined > 0 else all_hit
                per_group.append((ar_val, sd_pref, ssd_pref, lam * e_any * others * (1.0 - joined) / c))
            incumbent = best_opts
            for s in s_values:
                for q in q_values:
                    opts = []
                    for ar_val, sd_pref, ssd_pref, any_cost in per_group:
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
                    r, hit = self._evaluate(groups, opts, base, costs)
                    if r > best * (1.0 + 1e-12):
                        best, best_opts, all_hit = r, opts, hit
            if best_opts is incumbent:
                break
            lam = best
        for g, o in zip(groups, best_opts):
            g.opt = o
        return best

    # ------------------------------------------------------------------ exploring

    def _cost_evidence(self, mode: str, tokens: int) -> float:
        """Recent rounds behind the costs of running ``mode`` at ``tokens``: verification
        near that token count, and that mode's drafting."""
        bin_ = _token_bin(tokens)
        ev = sum(self._tokens_seen.get(b, 0.0) for b in (bin_ - 1, bin_, bin_ + 1))
        if mode == "sd":
            return min(ev, self._step.weight)
        return min(ev, self._ssd.weight) if mode == "ssd" else ev

    def _optimistic(self, g: _Group) -> _Group:
        """``g`` valued with its bucket's acceptance and hit rates at their upper bounds."""
        up = _Group(g.bucket, g.scale, g.cap, g.modes, g.in_ssd)
        up.members = g.members
        _fill_values(up, self._draft[g.bucket].upper(), self._miss[g.bucket].upper(), self._hit[g.bucket].upper())
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
        """Maybe move every group at one choice to a neighbouring choice that
        could beat the best (module docstring): its value with optimistic
        acceptance and hit rates, or — where its costs have thin evidence —
        within :data:`EXPLORE_MARGIN` of the best. All groups at that choice
        move: the cost fits learn from what the whole round does."""
        if self._explored + _ENTRY_EXPLORE_ROUNDS > self.explore * self._chosen:
            return  # wait until the budget covers any exploration, the longest included
        opts = [g.opt for g in groups]
        tokens = base.tokens + sum(len(g.members) * (g.opt[1] + 1) for g in groups)
        optimistic: dict[int, _Group] = {}
        candidates: list[tuple[tuple[str, int], tuple[str, int]]] = []
        for opt in dict.fromkeys(opts):
            for alt in self._neighbours(next(g for g in groups if g.opt == opt)):
                moved = [i for i, g in enumerate(groups) if g.opt == opt and alt in self._neighbours(g)]
                trial = [alt if i in moved else o for i, o in enumerate(opts)]
                score = 0.0
                if alt[0] != "ar":
                    up = [optimistic.setdefault(i, self._optimistic(g)) if i in moved else g for i, g in enumerate(groups)]
                    score = self._evaluate(up, trial, base, costs)[0]
                new_tokens = tokens + sum(len(groups[i].members) for i in moved) * (alt[1] - opt[1])
                if self._cost_evidence(alt[0], new_tokens) < EVIDENCE_MIN:
                    score = max(score, self._evaluate(groups, trial, base, costs)[0] / (1.0 - EXPLORE_MARGIN))
                if score > best:
                    candidates.append((opt, alt))
        if not candidates:
            return
        opt, alt = candidates[self._rng.randrange(len(candidates))]
        moved_groups = [g for g in groups if g.opt == opt and alt in self._neighbours(g)]
        # an SSD entry is held a second round: the first is a forced miss and measures no hit rate
        rounds = _ENTRY_EXPLORE_ROUNDS if alt[0] == "ssd" and not all(g.in_ssd for g in moved_groups) else 1
        log.debug("auto explores %s instead of %s for %d sequence(s)", alt, opt, sum(len(g.members) for g in moved_groups))
        self._explored += 1
        for g in moved_groups:
            g.opt = alt
            if rounds > 1:
                self._held.update({s: (Choice(*alt), rounds - 1) for s in g.seq_ids})

    # ------------------------------------------------------------------ reporting

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for engine metrics and the benchmark."""

        def coef(fit: _EwLeastSquares, names: tuple[str, ...]) -> dict[str, float] | None:
            theta = fit.theta
            return None if theta is None else {n: float(v) for n, v in zip(names, theta)}

        return {
            "rounds_observed": self._observed,
            "rounds_chosen": self._chosen,
            "rounds_explored": self._explored,
            "verify_s": coef(self._verify, ("a", "per_token")),
            "draft_step_s": coef(self._step, ("a", "per_seq")),
            "ssd_exposed_s": coef(self._ssd, ("a", "per_seq", "per_backup_step", "per_missed_k")),
            "control_s": coef(self._ctl, ("a", "per_seq")),
            "acceptance": {
                name: {
                    "draft": [round(a, 4) for a in self._draft[b].alphas()],
                    "miss": [round(a, 4) for a in self._miss[b].alphas()],
                    "hit_rate": round(self._hit[b].value, 4),
                }
                for b, name in enumerate(BUCKETS)
            },
            "last_choice": dict(self._last_counts),
        }


def _fill_values(g: _Group, alphas: list[float], miss: list[float], hit: float) -> None:
    """A group's expected tokens by mode and K under these acceptance and hit rates."""
    g.hit = hit
    if g.cap == 0:
        return
    e_draft = _expected_tokens(alphas, g.scale, g.cap)
    if "sd" in g.modes:
        g.e_sd = e_draft
    if "ssd" in g.modes:
        e_miss = _expected_tokens(miss, 1.0, g.cap)
        switch = [hit * max(0.0, d - m) / SWITCH_HORIZON for d, m in zip(e_draft, e_miss)]
        e_ssd = [hit * d + (1.0 - hit) * m for d, m in zip(e_draft, e_miss)]
        g.e_ssd = e_ssd if g.in_ssd else [e - s for e, s in zip(e_ssd, switch)]
        g.leave = max(switch) if g.in_ssd else 0.0


def _prefix_best(values: list[float]) -> list[tuple[float, int]]:
    """For each K = 1..len: the best (value, k) with k <= K (values[k-1] is K = k's)."""
    out: list[tuple[float, int]] = []
    for k, v in enumerate(values, start=1):
        out.append((v, k) if not out or v > out[-1][0] else out[-1])
    return out


def _token_bin(tokens: int) -> int:
    """Log-scale bins a factor 2^(1/4) wide: verification evidence 'near' a token count."""
    return round(4.0 * math.log2(max(1, tokens)))
