"""Fan-out: how many speculations to pre-compute for each number of accepted tokens.

A round accepting k of K draft tokens has probability ``a^k (1 - a)`` for k < K
and ``a^K`` for k = K (a = per-position acceptance rate). Given F candidates at
row k, the outcome is missed with probability ≈ ``c·F^(-r)`` (power law in the
draft's rank of the true t*). Minimising the expected miss rate under a budget
``Σ F_k = B`` gives the geometric allocation of the paper (Speculative
Speculative Decoding, Theorem 12):

    F_k ∝ a^(k/(1+r))                    for k < K
    F_K ∝ a^(K/(1+r)) · (1 - a)^(-1/(1+r))

(the constant c cancels). :class:`FanoutEstimator` fits a and r online so
``fan_out="auto"`` tracks the models actually being served.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import ConfigError

_A_EPS = 1e-6


def largest_remainder(weights: list[float], budget: int) -> list[int]:
    """Integers proportional to ``weights`` that sum to exactly ``budget``.

    Floors first, then hands the remaining units to the largest fractional
    parts (ties: lower index). Non-positive total weight → uniform split.
    """
    n = len(weights)
    if n == 0:
        return []
    total = sum(weights)
    if not (total > 0 and math.isfinite(total)):
        weights, total = [1.0] * n, float(n)
    shares = [budget * w / total for w in weights]
    floors = [int(math.floor(s)) for s in shares]
    left = budget - sum(floors)
    order = sorted(range(n), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return floors


def geometric_weights(k: int, accept_rate: float, r: float) -> list[float]:
    """Unnormalised optimal fan-out weights for k = 0..K (Theorem 12).

    ``accept_rate`` is clamped into [1e-6, 1 - 1e-6] so a = 0 or 1 stays finite.
    Degenerate input (non-finite a or r, or r <= -1 where the optimum is not
    defined) returns uniform weights.
    """
    if not (math.isfinite(accept_rate) and math.isfinite(r)) or r <= -1.0:
        return [1.0] * (k + 1)
    a = min(max(accept_rate, _A_EPS), 1.0 - _A_EPS)
    e = 1.0 / (1.0 + r)
    # work in log space so large K with small a does not underflow to all-zero
    logs = [j * e * math.log(a) for j in range(k)]
    logs.append(k * e * math.log(a) - e * math.log(1.0 - a))
    top = max(logs)
    return [math.exp(x - top) for x in logs]


def geometric_fanout(budget: int, k: int, accept_rate: float, r: float) -> list[int]:
    """K+1 non-negative ints summing to ``budget``: the geometric allocation,
    scaled to the budget and rounded by largest remainder.

    Falls back to a uniform split for degenerate ``accept_rate`` / ``r`` (NaN,
    inf, r <= -1); see :func:`geometric_weights`.
    """
    if k < 0:
        raise ConfigError(f"speculation length K must be >= 0, got {k}")
    if budget < 0:
        raise ConfigError(f"fan-out budget must be >= 0, got {budget}")
    return largest_remainder(geometric_weights(k, accept_rate, r), int(budget))


def parse_fanout(spec: str, k: int) -> list[int] | Literal["auto"]:
    """Parse a ``--fan-out`` value: ``"auto"`` or K+1 comma-separated ints >= 0."""
    text = str(spec).strip()
    if text.lower() == "auto":
        return "auto"
    parts = [s.strip() for s in text.split(",")]
    try:
        values = [int(s) for s in parts]
    except ValueError:
        raise ConfigError(
            f"fan_out must be 'auto' or {k + 1} comma-separated non-negative integers "
            f"(one per accepted count k = 0..{k}), got {spec!r}"
        ) from None
    if len(values) != k + 1:
        raise ConfigError(
            f"fan_out lists {len(values)} values but speculation length K={k} needs {k + 1} "
            f"(one per accepted count k = 0..{k}), got {spec!r}"
        )
    if any(v < 0 for v in values):
        raise ConfigError(f"fan_out values must be >= 0, got {spec!r}")
    return values


def fit_power_law(ranks: list[int] | torch.Tensor, f_max: int, min_tail: int = 5) -> float | None:
    """Fit r in ``P(rank > F) ≈ c·F^(-r)`` by least squares of log P on log F.

    Uses F = 1..f_max where at least ``min_tail`` observations exceed F (the
    tail estimate is too noisy below that). The intercept (log c) is free: it
    absorbs how often the top-1 candidate misses and does not change the
    allocation. Returns None when fewer than two usable points exist.
    """
    x = torch.as_tensor(ranks, dtype=torch.float64).reshape(-1)
    fs = torch.arange(1, f_max + 1, dtype=torch.float64)
    return fit_power_law_tail((x.unsqueeze(0) > fs.unsqueeze(1)).sum(1).tolist(), x.numel(), min_tail)


def fit_power_law_tail(tail: list[int], n: int, min_tail: int = 5) -> float | None:
    """:func:`fit_power_law` from the tail counts: ``tail[F-1]`` observations
    of ``n`` exceed F, for F = 1..len(tail) (what an estimator keeps up to
    date as ranks arrive, so a fit costs O(f_max), not O(history))."""
    pts = [(math.log(f), math.log(c / n)) for f, c in enumerate(tail, start=1) if c >= min_tail]
    if n == 0 or len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    denom = sum((x - mx) ** 2 for x, _ in pts)
    if denom <= 0:
        return None
    return -sum((x - mx) * (y - my) for x, y in pts) / denom


@dataclass
class _Rate:
    """Acceptance counts with a prior worth ``weight`` attempted positions."""

    prior: float
    weight: float
    accepted: float = 0.0
    attempted: float = 0.0

    @property
    def value(self) -> float:
        return (self.prior * self.weight + self.accepted) / (self.weight + self.attempted)


@dataclass
class FanoutEstimator:
    """Online estimates of a (acceptance rate) and r (miss power law) for auto fan-out.

    Call :meth:`observe` once per sequence per verified round. The acceptance
    rate is the maximum-likelihood per-position rate: accepted tokens over
    attempted positions (k accepted + 1 rejected position, or K when all were
    accepted), blended with a prior worth ``prior_weight`` positions.

    Rounds that verified a *backup* speculation are tracked separately, per
    backup kind (``after_backup=True`` or ``"neural"`` / ``"fast"``): their
    acceptance differs from the primary draft's, and the cache built during such
    a round must be allocated with it. For a point-mass ("fast") backup the
    acceptance rate is near 0 (its prior ``prior_fast_accept`` is 0.05 and the
    data drive it lower), so the geometric weights ``a^(k/(1+r))`` collapse and
    nearly all the budget goes to k = 0 — it emerges from the formula, no special
    case.

    r is shared by all regimes (it describes the draft's ranking of the true
    outcome, not the proposal) and stays at ``prior_r`` until ``min_rank_obs``
    ranked outcomes exist; fits are clamped to [``r_min``, ``r_max``]. It is
    refitted each time the count of ranks seen passes a multiple of
    ``refit_every``, not per rank: the SSD round
    reads it between sending verification and sending the build, and one more
    rank among thousands moves it by far less than its own noise.
    """

    prior_accept: float = 0.7
    prior_backup_accept: float = 0.7
    prior_fast_accept: float = 0.05
    prior_weight: float = 10.0
    prior_r: float = 1.0
    f_max: int = 32
    min_rank_obs: int = 50
    r_min: float = 0.05
    r_max: float = 8.0
    max_history: int = 20000
    refit_every: int = 16
    _rates: dict[str, _Rate] = field(default_factory=dict, repr=False)
    _ranks: deque[int] = field(default_factory=deque, repr=False)  # the latest max_history ranks
    _tail: list[int] = field(default_factory=list, repr=False)  # _tail[F-1]: how many of them exceed F
    _hits: int = 0
    _hit_rounds: int = 0
    _r_cache: float | None = field(default=None, repr=False)
    _seen: int = 0  # ranks observed in all
    _fit_epoch: int = 0  # _seen // refit_every when r was last fitted

    def __post_init__(self) -> None:
        if self.refit_every < 1:
            raise ValueError(f"refit_every must be at least 1, got {self.refit_every}")

    def _rate(self, after_backup: bool | str) -> _Rate:
        key = _regime(after_backup)
        if key not in self._rates:
            prior = {"primary": self.prior_accept, "fast": self.prior_fast_accept}.get(key, self.prior_backup_accept)
            self._rates[key] = _Rate(prior=prior, weight=self.prior_weight)
        return self._rates[key]

    def observe(
        self,
        accepted: int,
        k_max: int,
        recovery_rank: int | None,
        *,
        after_backup: bool | str = False,
        hit: bool | None = None,
    ) -> None:
        """Record one verified round of one sequence.

        Args:
            accepted: k, draft tokens accepted.
            k_max: the round's draft length (a row may have fewer than K).
            recovery_rank: 1-based rank of the true t* among the draft's
                candidates at row ``accepted`` (the sampled s_{k+1} excluded),
                or None when unknown. Ranks beyond ``f_max`` may be passed as is.
            after_backup: False for a primary (cache-hit or first-choice)
                speculation; True / "neural" / "fast" when the round verified a
                backup speculation.
            hit: whether this round's outcome was found in the cache (for
                :attr:`hit_rate`); None if not known.
        """
        if not 0 <= accepted <= k_max:
            raise ValueError(f"accepted={accepted} must lie in [0, k_max={k_max}]")
        rate = self._rate(after_backup)
        rate.accepted += accepted
        rate.attempted += accepted + (1 if accepted < k_max else 0)
        if recovery_rank is not None:
            if recovery_rank < 1:
                raise ValueError(f"recovery_rank is 1-based, got {recovery_rank}")
            self._count_rank(int(recovery_rank), +1)
            self._ranks.append(int(recovery_rank))
            if len(self._ranks) > self.max_history:
                self._count_rank(self._ranks.popleft(), -1)
            self._seen += 1
        if hit is not None:
            self._hits += int(bool(hit))
            self._hit_rounds += 1

    def _count_rank(self, rank: int, delta: int) -> None:
        if len(self._tail) != self.f_max:
            self._tail = [0] * self.f_max
        for f in range(min(rank - 1, self.f_max)):  # rank exceeds F = 1..rank-1
            self._tail[f] += delta

    def accept_rate_for(self, after_backup: bool | str = False) -> float:
        """Estimated per-position acceptance rate for a regime."""
        return self._rate(after_backup).value

    @property
    def accept_rate(self) -> float:
        """Primary-draft acceptance rate estimate."""
        return self.accept_rate_for(False)

    @property
    def r(self) -> float:
        """Miss power-law exponent estimate (prior until enough ranked outcomes)."""
        epoch = self._seen // self.refit_every
        if self._r_cache is None or epoch != self._fit_epoch:
            self._fit_epoch = epoch
            fit = None
            if len(self._ranks) >= self.min_rank_obs:
                fit = fit_power_law_tail(self._tail, len(self._ranks))
            r = self.prior_r if fit is None or not math.isfinite(fit) else fit
            self._r_cache = min(max(r, self.r_min), self.r_max)
        return self._r_cache

    @property
    def hit_rate(self) -> float:
        """Observed per-sequence cache hit rate (0.0 before any hit/miss was reported)."""
        return self._hits / self._hit_rounds if self._hit_rounds else 0.0

    def allocation(self, budget: int, k: int, after_backup: bool | str = False) -> list[int]:
        """Geometric fan-out (K+1 ints summing to ``budget``) from current estimates,
        using the acceptance rate of the regime of the round being verified."""
        return geometric_fanout(budget, k, self.accept_rate_for(after_backup), self.r)


def _regime(after_backup: bool | str) -> str:
    if after_backup is False or after_backup is None:
        return "primary"
    if after_backup is True:
        return "backup"
    if after_backup in ("neural", "fast", "backup"):
        return str(after_backup)
    raise ValueError(f"after_backup must be a bool, 'neural' or 'fast', got {after_backup!r}")


def deal_candidates(fanout: list[int], rows: int, shard: int = 0, num_shards: int = 1) -> list[tuple[int, int]]:
    """The predicted outcomes one of ``num_shards`` drafts pre-computes.

    A fan-out F_k names the candidates (k, j): the j-th ranked recovery token
    of row k, j < F_k. Listed rank-major — (0,0), (1,0), …, (0,1), (1,1), … —
    so consecutive candidates have similar hit probability, and dealt out
    round-robin, every draft gets an equal share of the budget and of the
    likely outcomes. Every draft ranks rows with the same model, so the shares
    are disjoint and together cover the whole fan-out.
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} outside 0..{num_shards - 1}")
    f = [fanout[k] if k < len(fanout) else 0 for k in range(rows)]
    cands = [(k, j) for j in range(max(f, default=0)) for k in range(rows) if j < f[k]]
    return cands[shard::num_shards]


class BudgetController:
    """The SSD budget actually spent per sequence: as much of the configured
    ceiling as the draft can build while the target verifies.

    Theorem 7's denominator holds ``max(1, T_p)``: a cache build that outlasts
    verification (T_p > 1) adds its excess to every round, which at a large
    batch — where the tree grows with batch × budget and a full-batch hit is
    unlikely anyway — costs more than the extra hits return. T_p is measured
    as when the build ends, from the start of the verification it overlaps,
    in verification times (a build the draft started before verification has
    that head start). The budget shrinks multiplicatively while it is above
    ``high`` and grows back towards the ceiling while it is below ``low``.

    The one budget controller (issue 18): a search over budget levels for the
    most tokens per second (``BudgetSearch``) stacked on top of it did not
    pay. Interleaved, tiny family, Ray, 32 prompts × 64, three runs each on a
    shared two-core machine (tok/s), with the lookups sent by the
    coordinator: both 669/458/442 (b = 1) and 1694/2487/2069 (b = 16), this
    cap alone 665/425/880 and 2467/1912/3064, the search alone 283/426/672
    and 1601/1962/2656 (it keeps big trees: hit rate 0.36–0.74 against
    0.22–0.27); again with the lookups placed by the target: both
    433/886/830 and 2524/3137/2732, the cap alone 658/858/714 and
    2521/3130/2201.
    """

    def __init__(self, ceiling: int, high: float = 1.1, low: float = 0.9, shrink: float = 0.8, grow: float = 1.1) -> None:
        if ceiling < 1:
            raise ValueError(f"budget ceiling must be at least 1, got {ceiling}")
        self.ceiling = ceiling
        self.high, self.low, self.shrink, self.grow = high, low, shrink, grow
        self._budget = float(ceiling)

    @property
    def budget(self) -> int:
        return max(1, min(self.ceiling, round(self._budget)))

    def observe(self, build_over_verify: float) -> None:
        """One round's T_p: its build's end, from its verification's start, in verification times."""
        if build_over_verify > self.high:
            self._budget = max(1.0, self._budget * self.shrink)
        elif build_over_verify < self.low:
            self._budget = min(float(self.ceiling), self._budget * self.grow)
