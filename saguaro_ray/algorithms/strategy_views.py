"""What the ``auto`` policy and the round loop exchange: a sequence's view before a round, its
choice, and what a finished round cost (see :mod:`saguaro_ray.algorithms.strategy_model`).

Pure data with its validation, so the engine's side (``engine/strategies/assign.py``) and the
policy agree on one shape; a bad value is a :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from saguaro_ray.errors import ConfigError

AUTO_MODES = ("ar", "sd", "ssd")  # the fixed modes auto chooses among
RESULT_MODES = (*AUTO_MODES, "pyramid")  # what a finished round may report (fixed requests included)
BUCKETS = ("t=0", "t<=0.5", "t<=1", "t>1")


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
    drops its cached speculation, entering it costs a backup proposal.
    ``lagging``: its drafts have not seen the tokens of its last AR rounds
    (the engine's catch-up threshold), or are still taking them: chosen to
    speculate, it runs AR while they catch up. ``unseen``: the tokens its
    drafts would be sent to catch up now (what the catch-up's work grows with).
    ``context``: the tokens it holds, which each of its rows attends (a verification of
    K + 1 tokens reads them K + 1 times, a draft step once)."""

    seq_id: int
    temperature: float
    k_cap: int
    modes: tuple[str, ...]
    current: str | None
    lagging: bool = False
    unseen: int = 0
    context: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.k_cap, int) or self.k_cap < 0:
            raise ConfigError(f"SeqView.k_cap must be an integer >= 0, got {self.k_cap!r}")
        for name in ("unseen", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"SeqView.{name} must be an integer >= 0, got {value!r}")
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
    for AR), ``accepted`` of them.

    SSD looks up *after* verification, keyed on the round's outcome: ``hit`` is
    the lookup this round made, which serves the *next* round's proposal (and
    whose miss drafted a backup in this round); ``source`` says what served the
    proposal verified in this one — the last round's lookup. Read as one, the
    acceptance of a round whose own lookup hit (one that accepted all its draft
    tokens, mostly: the fan-out covers that outcome best) was filed under hits
    (the coder pair at K = 4: 4.6 tokens, where the rounds hits served emitted
    3.8), and SD, priced from that table, looked 20-35 % better than it ran."""

    seq_id: int
    temperature: float
    mode: str
    proposed: int
    accepted: int
    hit: bool | None  # None: not SSD, or the sequence finished (no lookup)
    # SSD: what served its proposal — "cache" (a hit), "neural" or "fast" (a backup's: a miss, an entry); None: not SSD
    source: str | None = None
    # SSD: its tree was built afresh in this round where a build had been planned and started ahead
    # for it, but did not fit what was verified (entries are the policy's own knowledge)
    rebuilt: bool = False
    # SSD: the K this round's build made its speculations for — the K chosen the round before when
    # the build was made ahead, so a change of K shows in the build a round before it is verified
    # (0: not SSD, or not known)
    built: int = 0
    # the tokens it held when the round started: what each row of its verification and of its
    # drafting attended (0: not known)
    context: int = 0


@dataclass(frozen=True)
class RoundCosts:
    """One finished round, times in seconds."""

    batch: int  # sequences verified
    verify_tokens: int  # tokens the target scored: Σ (proposed + 1)
    verify_s: float  # the target's verification time
    draft_steps: int  # sequential draft steps before verification (the SD group's largest K; 0: none)
    draft_batch: int  # sequences in those steps
    draft_s: float  # their time (0.0 when none)
    ssd_batch: int  # SSD sequences this round
    ssd_exposed_s: float  # SSD on the critical path: build overrun, the lookup (a miss's backup is drafted in it), later backups
    wall_s: float  # the whole round as the coordinator saw it
    seqs: tuple[SeqResult, ...]
    ssd_build_s: float = math.nan  # when the SSD build ended, from verification's start (NaN: none this round)
    catch_up_sent: int = 0  # tokens sent to the drafts this round to catch up sequences that ran AR
    catching_up: int = 0  # sequences whose drafts' catch-up ran beside this round


@dataclass(frozen=True)
class StepCosts:
    """Step times measured on an engine's own workers before its first request (seconds).

    What ``auto`` knows of the machine before a round has run (see
    :meth:`~saguaro_ray.algorithms.strategy_model.AutoPolicy.seed`):
    ``verify``: (tokens, sequences, context, seconds) of one target call, decode
    (tokens = sequences) and verification of K + 1 tokens per sequence, each
    sequence holding ``context`` tokens;
    ``draft``: (sequences, context, seconds) of one sequential draft step;
    ``build``: (SSD sequences, context, seconds) of one step of SSD's tree build over
    their branches (empty: not measured; the build is then priced as draft
    steps); ``draft_call``: (sequences, seconds) of a draft call's own part
    beyond its steps (feeding what the last round accepted, the first draw),
    which an SD round's drafting pays once (empty: not measured, taken as 0).
    Measured at two contexts, the rows seed what a row's attention over the
    tokens its sequence holds costs (a request's rounds grow it)."""

    verify: tuple[tuple[int, int, int, float], ...]
    draft: tuple[tuple[int, int, float], ...] = ()
    build: tuple[tuple[int, int, float], ...] = ()
    draft_call: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.verify:
            raise ConfigError("StepCosts.verify needs at least one measured target call")
        for name, rows in (("verify", self.verify), ("draft", self.draft), ("build", self.build), ("draft_call", self.draft_call)):
            for row in rows:
                *counts, seconds = row
                if any(not isinstance(c, int) or c < 1 for c in counts) or not (math.isfinite(seconds) and seconds >= 0.0):
                    raise ConfigError(f"StepCosts.{name} rows need positive integer counts and seconds >= 0; got {row!r}")

    def to_json(self) -> dict[str, list[list[float]]]:
        rows = {"verify": self.verify, "draft": self.draft, "build": self.build, "draft_call": self.draft_call}
        return {name: [list(r) for r in table] for name, table in rows.items()}

    @classmethod
    def from_json(cls, d: dict[str, list[list[float]]]) -> "StepCosts":
        """The inverse of :meth:`to_json`; a malformed table is a :class:`ConfigError`."""
        try:
            return cls(
                tuple((int(a), int(b), int(c), float(s)) for a, b, c, s in d["verify"]),
                tuple((int(a), int(c), float(s)) for a, c, s in d.get("draft", ())),
                tuple((int(a), int(c), float(s)) for a, c, s in d.get("build", ())),
                tuple((int(a), float(s)) for a, s in d.get("draft_call", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"a step-cost table is malformed: {e!r}") from e
