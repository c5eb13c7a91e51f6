"""The online estimators ``auto``'s cost model is made of: an exponentially weighted
least-squares fit with non-negative coefficients, and decayed acceptance and hit rates whose
priors age with the data, and SSD's hit rates by K (``docs/auto.md`` says why each is what
it is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

UPPER_Z = 1.5  # optimism of exploration: acceptance and hit rates this many standard errors up
ACCEPT_DECAY = 0.99  # per round: acceptance counts weigh the last ~100 rounds
PRIOR_WEIGHT = 4.0  # bucket pooled rate ← prior; hit rate ← prior
HIT_K_WEIGHT = 8.0  # a K's hit rate ← the pooled hit rate (lookups' worth)
POSITION_WEIGHT = 16.0  # a position's rate ← the pooled rate (a draft's conditional rate varies slowly along K)
ALPHA_MAX = 0.99
FIT_PRIOR_WEIGHT = 0.001


class EwLeastSquares:
    """``y ≈ θ·x`` (x[0] = 1, the intercept) by exponentially weighted least
    squares, anchored to a prior θ0 (set at the first observation, so it
    needs no time scale: given, or that observation split between the
    intercept and the features) only as firmly as :data:`FIT_PRIOR_WEIGHT` of an
    observation: enough to settle a direction the data leave open (every
    round at one token count), too little to pull against a real spread — or,
    through :meth:`anchor`, to the proportions of a θ0 measured elsewhere,
    whose scale the data set. Every
    coefficient is kept non-negative (each is a cost): a negative slope fitted
    from noise would send the search to the largest load, a negative intercept
    make the loads it was not fitted on look free."""

    def __init__(self, n: int, decay: float, intercept_share: float = 0.8) -> None:
        self.n = n
        self.decay = decay
        self.intercept_share = intercept_share
        self.weight = 0.0  # effective number of observations
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._yy = 0.0  # decayed Σ y²: with the normal equations, the weighted residual (sse)
        self._prior: list[float] | None = None
        self._ridge: list[float] = [0.0] * n
        self._theta: list[float] | None = None
        self._shape = False  # anchored (:meth:`anchor`): the prior fixes the coefficients' proportions, not their scale
        self._start: list[float] | None = None  # anchored: θ before any observation
        self._observed = False

    def _set_prior(self, x: Sequence[float], y: float, prior: Sequence[float] | None) -> None:
        if prior is None:
            share = (1.0 - self.intercept_share) / max(1, self.n - 1)
            prior = [self.intercept_share * y] + [share * y / xi if xi > 0 else 0.0 for xi in x[1:]]
        self._prior = list(prior)
        self._ridge = [FIT_PRIOR_WEIGHT * max(xi, 1.0) ** 2 for xi in (1.0, *x[1:])]

    @property
    def has_prior(self) -> bool:
        return self._prior is not None

    def anchor(self, theta0: Sequence[float], x: Sequence[float], shape: Sequence[float] | None = None) -> None:
        """Start from ``theta0`` (measured elsewhere) and keep the proportions of ``shape``
        (default ``theta0``) where the data leave a direction open: the ridge pulls θ towards
        s·shape for the best s, so observations at one point scale the shape to fit them instead
        of moving the coefficients the cheapest way. ``x``: a typical observation, which sizes
        the ridge. Before any observation θ = θ0.

        Why: a measurement taken in another regime says how a cost is made up, not how large it
        is now. The start-up probe times a tree build alone, the rounds beside a verification
        that shares the cores: the coder pair's build at batch 8 took 1.9x the probe's step in
        rounds. With rows from the probe as observations and every round at one K, the excess
        went where it disturbed those rows least, a cost independent of K — K = 1 predicted at
        0.65 s after rounds at K = 4, measured 0.34 s, and auto kept to AR where SSD at K = 1
        ran 1.2x faster."""
        self._start = [float(t) for t in theta0]
        self._prior = [float(t) for t in (theta0 if shape is None else shape)]
        self._ridge = [FIT_PRIOR_WEIGHT * max(abs(xi), 1.0) ** 2 for xi in (1.0, *x[1:])]
        self._shape = any(t > 0.0 for t in self._prior)
        self._theta = None

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
        self._yy = g * self._yy + y * y
        self.weight = g * self.weight + 1.0
        self._observed = True
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
            self._theta = self._solve() if self._observed else list(self._start or self._prior)
        return self._theta

    def sse(self) -> float:
        """The decayed squared residual of the fitted θ over the observations (0 before any)."""
        theta = self.theta
        if theta is None:
            return 0.0
        fit = sum(t * x for t, x in zip(theta, self._xty))
        quad = sum(theta[i] * self._xtx[i][j] * theta[j] for i in range(self.n) for j in range(self.n))
        return max(0.0, self._yy - 2.0 * fit + quad)

    def _solve(self) -> list[float]:
        assert self._prior is not None
        w, p = self._ridge, self._prior
        if self._shape:
            # Σ w_i (θ_i − s·p_i)², minimised over s: the ridge of θ's part off the line through p
            wp = [wi * pi for wi, pi in zip(w, p)]
            norm = sum(a * pi for a, pi in zip(wp, p))
            ridge = [[(w[i] if i == j else 0.0) - wp[i] * wp[j] / norm for j in range(self.n)] for i in range(self.n)]
            target = [0.0] * self.n
        else:
            ridge = [[w[i] if i == j else 0.0 for j in range(self.n)] for i in range(self.n)]
            target = [wi * pi for wi, pi in zip(w, p)]
        return solve_nonnegative(
            [[self._xtx[i][j] + ridge[i][j] for j in range(self.n)] for i in range(self.n)],
            [self._xty[i] + target[i] for i in range(self.n)],
        )


VERIFY_KNEES = (0, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # token counts a verification may be flat up to
KNEE_TOLERANCE = 0.1  # a knee must fit this much better than every lower one to be chosen
KNEE_RESELECT = 8  # observations between two choices of the knee (it moves slowly; each choice solves every knee's fit)


class KneeFit:
    """A verification's seconds: ``a + c·sequences + s·max(0, tokens − knee) + d·[SSD ran]``.

    A target is memory-bound at small token counts (the weights are read once
    whatever the count: tokens nearly free) and compute-bound past a knee; a
    straight line over both regimes charges the flat part the steep part's
    slope, so a longer K looked dear where it is free (the real model on
    2 cores: flat to ~12 tokens at batch 1, then ~5 ms a token). The knee is
    the lowest of :data:`VERIFY_KNEES` whose fit leaves a decayed residual within
    :data:`KNEE_TOLERANCE` of the least (each knee's fit is a small linear least
    squares): rounds at few token counts leave the knee open, and there a knee
    chosen by noise made the slope past it wander (a straight line is the
    default the data must beat). The knee is chosen again every
    :data:`KNEE_RESELECT` observations, the chosen knee's fit after each.
    ``d``: what a tree build running beside the verification adds to it (the
    processes share the cores and memory bandwidth); fitted apart, SSD's
    slowdown does not make every token look dear to AR and SD."""

    def __init__(self, decay: float) -> None:
        self._fits = {k: EwLeastSquares(4, decay) for k in VERIFY_KNEES}
        self._best: int | None = None
        self._adds = 0

    @staticmethod
    def features(tokens: float, batch: float, knee: int, ssd: bool) -> tuple[float, float, float, float]:
        return (1.0, float(batch), max(0.0, tokens - knee), float(ssd))

    def add(self, tokens: float, batch: float, seconds: float, ssd: bool = False) -> None:
        for knee, fit in self._fits.items():
            fit.add(self.features(tokens, batch, knee, ssd), seconds)
        self._adds += 1
        if self._adds % KNEE_RESELECT == 0:
            self._best = None

    @property
    def knee(self) -> int:
        if self._best is None:
            sse = {k: f.sse() for k, f in self._fits.items()}
            low = min(sse.values())
            self._best = min(k for k, v in sse.items() if v <= low * (1.0 + KNEE_TOLERANCE) + 1e-15)
        return self._best

    @property
    def theta(self) -> tuple[float, float, float, int, float] | None:
        """(a, per token past the knee, per sequence, knee, with SSD) or None before any observation."""
        knee = self.knee
        theta = self._fits[knee].theta
        if theta is None:
            return None
        return (theta[0], theta[2], theta[1], knee, theta[3])


def held_costs(rows: Sequence[tuple[object, Sequence[float], float]]) -> list[float]:
    """Seconds per unit of each feature from ``(key, features, seconds)`` rows, ``key`` a call's
    shape and ``features`` what grows with the tokens its sequences hold: each key's rise from
    its shortest context to its longest, least squares over the keys, each coefficient at least
    0 (a negative one is fixed at 0 and the rest refitted); 0 where no key was measured at two
    contexts.

    What the tokens a sequence holds cost the calls that attend them is measured by the
    start-up probe, and not fitted from the rounds: within a request the context grows with
    every round, as slowly as the machine's other drifts, so a fit given the freedom put a
    draft step's whole cost into it (the policy simulator: a cold start at short contexts,
    then a draft step predicted at 8 ms for a truth of 1 ms, and AR for good)."""
    n = len(rows[0][1]) if rows else 0
    by_key: dict[object, list[tuple[Sequence[float], float]]] = {}
    for key, x, seconds in rows:
        by_key.setdefault(key, []).append((x, seconds))
    xtx = [[0.0] * n for _ in range(n)]
    xty = [0.0] * n
    for points in by_key.values():
        (x_lo, s_lo), (x_hi, s_hi) = min(points, key=lambda p: p[0][0]), max(points, key=lambda p: p[0][0])
        d = [hi - lo for hi, lo in zip(x_hi, x_lo)]
        for i in range(n):
            xty[i] += d[i] * (s_hi - s_lo)
            for j in range(n):
                xtx[i][j] += d[i] * d[j]
    return solve_nonnegative(xtx, xty)


def solve_nonnegative(a: list[list[float]], b: list[float]) -> list[float]:
    """``a·θ = b`` (normal equations) with every θ_i ≥ 0: a negative coefficient is fixed at 0 and
    the rest refitted, until none is; a feature never observed (``a[i][i]`` = 0) stays at 0."""
    free = [i for i in range(len(b)) if a[i][i] > 0.0]
    while True:
        theta = [0.0] * len(b)
        for i, v in zip(free, solve_linear([[a[i][j] for j in free] for i in free], [b[i] for i in free])):
            theta[i] = v
        negative = [i for i in free if theta[i] < 0.0]
        if not negative:
            return theta
        free = [i for i in free if i not in negative]


def solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the tiny (n <= 4) normal equations."""
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


class Acceptance:
    """Decayed per-position counts of one kind of proposal in one bucket.

    The prior is a pseudo-count that ages with the data: estimates keep what
    was last seen while nothing new arrives (only the evidence fades, which is
    what exploration reads), instead of sliding back to the prior."""

    def __init__(self, max_k: int, prior: "float | Acceptance") -> None:
        self.prior = prior  # a rate, or the table whose pooled rate is this one's prior
        self.prior_weight = PRIOR_WEIGHT
        self.tested = [0.0] * max_k
        self.accepted = [0.0] * max_k

    def age(self) -> None:
        if not isinstance(self.prior, Acceptance):  # a live parent stays as firm as it is
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
        prior = self.prior.pooled() if isinstance(self.prior, Acceptance) else self.prior
        return (sum(self.accepted) + self.prior_weight * prior) / (sum(self.tested) + self.prior_weight)

    def alphas(self) -> list[float]:
        r = self.pooled()
        return [min(ALPHA_MAX, (a + POSITION_WEIGHT * r) / (t + POSITION_WEIGHT)) for a, t in zip(self.accepted, self.tested)]

    def upper(self) -> list[float]:
        """Optimistic per-position rates: :data:`UPPER_Z` standard errors above the estimate."""
        return [min(ALPHA_MAX, upper_bound(a, t)) for a, t in zip(self.alphas(), self.tested)]


class ExcessRatio:
    """What one kind of switching round takes beyond the steady round predicted for
    its load, in predicted builds: decayed over the last few such rounds
    (``decay`` each) and aged a little every round (:meth:`age`), with a prior of
    one pseudo-round of no excess (unclamped: timing noise both ways leaves the
    mean unbiased)."""

    def __init__(self, decay: float, age_decay: float) -> None:
        self.decay, self.age_decay = decay, age_decay
        self.total = 0.0  # decayed Σ excess / predicted build
        self.count = 0.0

    def age(self) -> None:
        self.total *= self.age_decay
        self.count *= self.age_decay

    def add(self, excess_s: float, build_s: float) -> None:
        self.total = self.decay * self.total + excess_s / build_s
        self.count = self.decay * self.count + 1.0

    @property
    def value(self) -> float:
        return max(0.0, self.total / (self.count + 1.0))  # + 1: the prior's pseudo-round


class CostPerUnit:
    """Seconds per unit of work whose cost shows in other rounds than the one it is counted
    in — a catch-up's tokens are sent in one round, the verifications the drafts' work slows
    follow: decayed Σ seconds over decayed Σ units, both aged every round so they stay in one
    window; 0 until a unit was counted (where the drafts work on devices of their own, the
    seconds stay near 0 and so does the cost)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.seconds = 0.0
        self.units = 0.0

    def age(self) -> None:
        self.seconds *= self.decay
        self.units *= self.decay

    def add(self, seconds: float = 0.0, units: float = 0.0) -> None:
        if math.isfinite(seconds) and math.isfinite(units):
            self.seconds += seconds
            self.units += units

    @property
    def value(self) -> float:
        return max(0.0, self.seconds / self.units) if self.units > 0.0 else 0.0


class DecayedRate:
    """A decayed Bernoulli rate whose prior pseudo-count ages with the data (as :class:`Acceptance`)."""

    def __init__(self, prior: float) -> None:
        self.hits = PRIOR_WEIGHT * prior
        self.total = PRIOR_WEIGHT
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
        return min(1.0, upper_bound(self.value, self.n))


class HitRates:
    """SSD's cache hit rate by K: each K's own lookups, shrunk towards what the
    acceptance curve predicts for that K.

    The hit rate falls with K at a fixed budget (real model, budget 2: 91–94 %
    at K = 4, 57–80 % at K = 8): a longer speculation is rejected somewhere
    more often, and the fan-out covers the outcomes after a full acceptance far
    better than those after a rejection. With one rate for every K, ``auto``
    went from K = 4 to K = 8 (which looked as good), paid for its misses there,
    then fitted its K line through both ends and settled at K = 2. So a lookup
    is counted by its K and by what the round before it ended in (every draft
    token accepted, or not); a K with few lookups of its own is predicted as
    ``A_K·h_full + (1 − A_K)·h_part``, A_K = P(all K accepted), and its own
    count takes over with :data:`HIT_K_WEIGHT` lookups' worth of weight."""

    def __init__(self, max_k: int, prior: float) -> None:
        self.pooled = DecayedRate(prior)  # every lookup: what the search linearises P(all hit) with
        self.full = DecayedRate(prior)  # lookups after a round whose every draft token was accepted
        self.part = DecayedRate(prior)  # ... after a rejection
        self.hits = [0.0] * (max_k + 1)  # index K; 0 unused (AR looks nothing up)
        self.n = [0.0] * (max_k + 1)

    def age(self) -> None:
        for rate in (self.pooled, self.full, self.part):
            rate.age()
        for k in range(len(self.n)):
            self.hits[k] *= ACCEPT_DECAY
            self.n[k] *= ACCEPT_DECAY

    def add(self, k: int, hit: bool, after_full: bool | None) -> None:
        """One lookup at K = ``k``; ``after_full``: whether the round before it
        accepted every draft token (None: not known)."""
        self.pooled.add(hit)
        if after_full is not None:
            (self.full if after_full else self.part).add(hit)
        k = max(1, min(k, len(self.n) - 1))
        self.n[k] += 1.0
        self.hits[k] += 1.0 if hit else 0.0

    def values(self, all_accepted: Sequence[float]) -> list[float]:
        """Hit rate for K = 0..len(all_accepted) − 1; ``all_accepted[K]``: A_K."""
        full, part = self.full.value, self.part.value
        return [self._own(k, a * full + (1.0 - a) * part) for k, a in enumerate(all_accepted)]

    def upper(self, all_accepted: Sequence[float]) -> list[float]:
        """Optimistic rates by K: :data:`UPPER_Z` standard errors up, a K with
        few lookups of its own counting its prediction's evidence."""
        full, part = self.full.upper(), self.part.upper()
        evidence = min(HIT_K_WEIGHT, self.pooled.n)
        return [
            min(1.0, upper_bound(self._own(k, a * full + (1.0 - a) * part), self.n[k] + evidence)) for k, a in enumerate(all_accepted)
        ]

    def _own(self, k: int, predicted: float) -> float:
        return (self.hits[k] + HIT_K_WEIGHT * predicted) / (self.n[k] + HIT_K_WEIGHT)


def upper_bound(p: float, n: float) -> float:
    return p + UPPER_Z * math.sqrt(p * (1.0 - p) / (n + 1.0))
