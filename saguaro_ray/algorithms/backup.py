"""Backup speculation policy: what to verify next when the cache misses.

*neural*: K sequential draft steps from the true outcome — costs about an SD
draft phase (T_b > 0) but is accepted like a normal draft. *fast*: a point-mass
guess — nearly free (T_b ≈ 0) but almost never accepted (≈ 1 token per round).

A batch of b sequences avoids the backup path only if every sequence hits,
which happens with probability ``p_hit ** b``; so at large batch the cheap
backup can win even though it emits fewer tokens. The choice maximises the
expected speedup of the paper (Speculative Speculative Decoding, Theorem 7):

    [p·E_hit + (1-p)·E_miss] / [P·max(1, T_p) + (1-P)·(1 + T_b) + T_c],   P = p^b

with E the expected tokens a sequence emits per round (its own hit or miss
decides that, whatever the rest of the batch does), P the chance the whole
batch hits (only then does the round skip the backup), and T latencies
relative to one target verification (T_p: building the primary speculation, hidden behind the
verification when ≤ 1). T_c is what every round costs beyond its worker
time — the control plane, measured — which the paper's model leaves out: a
round that emits few tokens (a verified point-mass guess) pays it all the
same, so with T_c = 0 the fast backup looks better than it is wherever the
control plane is a sizeable part of a round (a CPU box: 15–20%). The hit probability p depends on the choice: the cache
built while a backup is verified is allocated for that backup's acceptance, so
p is the stationary share of cache rounds given how often a lookup hits after
each kind of speculation (:meth:`BackupStats.hit_rate_with`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError

BackupKind = Literal["neural", "fast"]
BACKUP_MODES = ("auto", "neural", "fast")


def expected_speedup(
    p_hit: float,
    e_hit: float,
    e_miss: float,
    t_p: float,
    t_b: float,
    batch_size: int = 1,
    t_c: float = 0.0,
) -> float:
    """Expected tokens per sequence per unit of verification time (Theorem 7,
    plus ``t_c``: every round's fixed cost beyond its worker time).

    ``p_hit`` is the per-sequence hit probability. Tokens are per sequence (a
    sequence's yield does not depend on whether the others hit); the round's
    time is the batch's: it avoids the backup only if every sequence hits,
    with probability ``p_hit ** batch_size``. At batch 1 both coincide.
    """
    p = float(p_hit)
    full = p ** int(batch_size)
    num = p * e_hit + (1.0 - p) * e_miss
    den = full * max(1.0, t_p) + (1.0 - full) * (1.0 + t_b) + max(0.0, t_c)
    return num / den


@dataclass
class BackupStats:
    """Measured inputs of :func:`expected_speedup`, as exponential moving averages.

    The defaults are priors that hold before any data (a moderately good draft,
    K around 4): each observation moves an estimate by ``smoothing`` of the gap,
    so after n observations the prior's weight is ``(1 - smoothing) ** n``.
    """

    p_hit: float = 0.5
    # P(the next lookup hits | the proposal just verified came from the cache /
    # a neural / a fast backup): the build after a backup is allocated for that
    # backup's acceptance (after a point-mass guess nearly all of it goes to
    # k = 0), so hits follow the kinds of speculation differently
    hit_after: dict[str, float] = field(default_factory=lambda: {"cache": 0.5, "neural": 0.5, "fast": 0.5})
    hit_seen: dict[str, int] = field(default_factory=lambda: {"cache": 0, "neural": 0, "fast": 0})
    e_hit: float = 3.0
    e_miss_neural: float = 3.0
    e_miss_fast: float = 1.05
    t_primary: float = 1.0
    t_neural: float = 0.5
    t_fast: float = 0.0
    t_round: float = 0.0  # T_c: a round's control plane (no prior: 0 until measured)
    smoothing: float = 0.05

    def _ema(self, old: float, new: float) -> float:
        return old + self.smoothing * (float(new) - old)

    def observe_sequence(self, hit: bool, tokens: int | None = None, backup: BackupKind | None = None) -> None:
        """One sequence's round: was its outcome in the cache, and (optionally) how
        many tokens the verification of the speculation it got emitted.

        On a hit ``tokens`` updates E_hit; on a miss it updates the E of
        ``backup`` (the backup kind whose speculation was verified).
        """
        self.p_hit = self._ema(self.p_hit, 1.0 if hit else 0.0)
        if tokens is None:
            return
        if hit:
            self.e_hit = self._ema(self.e_hit, tokens)
        elif backup == "neural":
            self.e_miss_neural = self._ema(self.e_miss_neural, tokens)
        elif backup == "fast":
            self.e_miss_fast = self._ema(self.e_miss_fast, tokens)
        elif backup is not None:
            raise ValueError(f"backup must be 'neural' or 'fast', got {backup!r}")

    def observe_lookup(self, after: str, hit: bool) -> None:
        """One sequence's lookup: did it hit, after verifying a speculation from
        ``after`` ("cache", "neural" or "fast")?"""
        if after not in self.hit_after:
            raise ValueError(f"after must be 'cache', 'neural' or 'fast', got {after!r}")
        self.hit_after[after] = self._ema(self.hit_after[after], 1.0 if hit else 0.0)
        self.hit_seen[after] += 1

    def hit_rate_with(self, kind: BackupKind) -> float:
        """The long-run per-sequence hit probability if misses are served by
        ``kind``: the stationary share of cache rounds in the two-state chain
        cache ⇄ backup, π = h_b / (1 - h_c + h_b). Until both transitions have
        been observed, the pooled ``p_hit``."""
        if not (self.hit_seen["cache"] and self.hit_seen[kind]):
            return self.p_hit
        h_c, h_b = self.hit_after["cache"], self.hit_after[kind]
        denom = 1.0 - h_c + h_b
        return h_b / denom if denom > 0 else 1.0

    def observe_latency(
        self,
        t_primary: float | None = None,
        t_neural: float | None = None,
        t_fast: float | None = None,
        t_round: float | None = None,
    ) -> None:
        """Measured latencies relative to one verification (None leaves an estimate as is)."""
        if t_round is not None:
            self.t_round = self._ema(self.t_round, t_round)
        if t_primary is not None:
            self.t_primary = self._ema(self.t_primary, t_primary)
        if t_neural is not None:
            self.t_neural = self._ema(self.t_neural, t_neural)
        if t_fast is not None:
            self.t_fast = self._ema(self.t_fast, t_fast)

    def speedup(self, kind: BackupKind, batch_size: int) -> float:
        """Expected speedup if misses are served by ``kind``."""
        e_miss, t_b = (self.e_miss_neural, self.t_neural) if kind == "neural" else (self.e_miss_fast, self.t_fast)
        return expected_speedup(self.hit_rate_with(kind), self.e_hit, e_miss, self.t_primary, t_b, batch_size, self.t_round)


class BackupPolicy:
    """Which backup serves this round's misses: fixed, or ``auto`` by expected speedup.

    ``auto`` also explores: after ``explore_every - 1`` misses in a row served
    by one kind it picks the other kind once (report each served decision with
    :meth:`served`; a decision that found no miss to serve does not count). The estimates of a kind only move
    when its speculations are verified, so without this a kind that lost once
    would be judged forever by stale numbers — e.g. the point-mass guess wins
    on repetitive greedy text, the workload turns to sampling, and the neural
    backup's old, lower E would never be revisited. Either kind is exact, so
    exploring costs speed only, at most 1 round in ``explore_every``
    (0 disables it)."""

    def __init__(self, mode: str = "auto", explore_every: int = 10) -> None:
        if mode not in BACKUP_MODES:
            raise ConfigError(f"backup must be one of {', '.join(BACKUP_MODES)}; got {mode!r}")
        if explore_every < 0 or explore_every == 1:
            raise ConfigError(f"explore_every must be 0 (off) or at least 2, got {explore_every!r}")
        self.mode = mode
        self.explore_every = explore_every
        self._last: BackupKind | None = None
        self._streak = 0

    def choose(self, batch_size: int, stats: BackupStats) -> BackupKind:
        """``neural`` or ``fast``; ``auto`` takes the larger expected speedup (ties: neural), exploring as above."""
        if self.mode != "auto":
            return self.mode  # type: ignore[return-value]
        neural = stats.speedup("neural", batch_size)
        fast = stats.speedup("fast", batch_size)
        kind: BackupKind = "fast" if fast > neural else "neural"
        if self.explore_every and kind == self._last and self._streak >= self.explore_every - 1:
            kind = "neural" if kind == "fast" else "fast"
        return kind

    def served(self, kind: BackupKind) -> None:
        """``kind`` served this round's misses (what exploration counts)."""
        self._streak = self._streak + 1 if kind == self._last else 1
        self._last = kind
