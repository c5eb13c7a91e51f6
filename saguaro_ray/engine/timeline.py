"""The round timeline: what each round did and when, for benchmarks, debugging
and the backup policy's per-round cost.

A :class:`RoundRecord` is filled in by the round loop and its strategy as the
round runs; :func:`round_components` splits one into where its time went. It
reads a record or its JSON form alike, so the benchmarks (which keep the JSON)
and the round loop (which keeps the record) apply the same rule.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# the coordinator's round history for benchmarks and debugging, in (estimated) bytes:
# ~10k rounds of a batch of 8 (at 100k rounds it held ~150 MB of a coordinator's RSS)
TIMELINE_BYTES = 16 * 2**20

Span = tuple[float, float]


@dataclass
class RoundRecord:
    """One round of the timeline (perf_counter seconds; None when not run)."""

    index: int
    batch: int
    start: float = 0.0  # the round as the coordinator saw it (perf_counter)
    end: float = 0.0
    verify: Span | None = None
    draft: Span | None = None  # SD drafting, pyramid drafting+qualifying, SSD backups
    build: Span | None = None  # SSD cache construction
    lookup: Span | None = None
    miss_backup: Span | None = None  # SSD: backups drafted for this round's misses after the lookup
    hits: int = 0
    misses: int = 0
    # SSD: each lookup's outcome, [accepted, proposed, hit 0/1] per sequence looked up: whether the
    # misses come at full acceptance (the bonus token not cached) or at a rejection (see the bench's hit_by_outcome)
    looked_up: list[list[int]] = field(default_factory=list)
    backup: str | None = None
    accepted: list[int] = field(default_factory=list)  # per sequence, in the order the round verified them
    proposed: list[int] = field(default_factory=list)  # ... the draft tokens each was verified with
    modes: dict[str, int] = field(default_factory=dict)  # sequences per mode this round
    prefill: bool = False  # an admission round (prompts prefilled, first tokens sampled)
    # the coordinator's side of the control plane (perf_counter): verification
    # sent / its result in the round loop's hands; the same for the SSD lookup
    sent: float | None = None
    back: float | None = None
    lookup_sent: float | None = None
    lookup_back: float | None = None
    forwarded: bool = False  # SSD: the target placed this round's lookups itself (lookup_sent = verification's end)
    budget: int | None = None  # SSD with an auto fan-out: speculations built per sequence (per draft)
    ahead: bool = False  # SSD: the draft started this round's build itself, after the previous lookup
    # auto: tokens sent to the drafts this round for sequences that ran AR (a catch-up), and the
    # sequences whose catch-up was running as the round started (their drafts work beside it)
    catch_up_sent: int = 0
    catching_up: int = 0
    # auto's prediction for the round (None: no auto sequence, or a cold-start round): the option
    # it chose and the runner-up, each {"option", "tokens", "seconds", "verify"}, and "measured": what the
    # round then took (tokens emitted, wall seconds); see :func:`prediction_error`
    auto: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def hidden(self) -> bool | None:
        """SSD: was the cache build finished by the time verification ended?"""
        if self.build is None or self.verify is None:
            return None
        return self.build[1] <= self.verify[1]


def record_bytes(rec: RoundRecord) -> int:
    """What ``rec`` holds in memory, estimated: measured with ``tracemalloc``
    over 2,000 filled-in records (every span and control-plane time set),
    ~1.18 kB at batch 1 and ~1.6 kB at batch 32 (the per-sequence lists),
    ~0.75 kB more with auto's prediction, ~90 B per SSD lookup's outcome; the
    estimate errs a little high."""
    return 1200 + 16 * len(rec.accepted) + 16 * len(rec.modes) + 90 * len(rec.looked_up) + (800 if rec.auto else 0)


class Timeline:
    """The most recent rounds, bounded in bytes: appending a record drops the
    oldest ones while the estimated total (:func:`record_bytes`, taken when a
    record is appended — the round is over by then) exceeds ``max_bytes``.
    A bound in rounds let a long-running server's coordinator hold ~150 MB of
    history; bytes bound what the history costs whatever the batch size."""

    def __init__(self, max_bytes: int = TIMELINE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._records: deque[tuple[RoundRecord, int]] = deque()
        self.bytes = 0  # estimated, of the records held
        self.appended = 0  # rounds recorded since the start, dropped ones too

    def append(self, rec: RoundRecord) -> None:
        size = record_bytes(rec)
        self.appended += 1
        self._records.append((rec, size))
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._records) > 1:
            self.bytes -= self._records.popleft()[1]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RoundRecord]:
        return (rec for rec, _ in self._records)


def _as_span(x: Any) -> Span | None:
    return None if x is None else (float(x[0]), float(x[1]))


def _length(span: Span | None) -> float:
    return span[1] - span[0] if span else 0.0


def round_components(r: RoundRecord | Mapping[str, Any]) -> dict[str, float]:
    """One decode round (a :class:`RoundRecord`, or its JSON) split into
    verify, drafting (busy and exposed on the critical path), cache lookup,
    and control plane (the rest of the round)."""
    get = r.get if isinstance(r, Mapping) else lambda name: getattr(r, name)
    verify, build = _as_span(get("verify")), _as_span(get("build"))
    drafted = _length(_as_span(get("draft"))) + _length(_as_span(get("miss_backup")))
    exposed = drafted  # sequential drafting before verification, or for misses after the lookup
    if build and verify:
        exposed += max(0.0, build[1] - verify[1])  # a cache build that outlived verification
    wall, v, lk = get("end") - get("start"), _length(verify), _length(_as_span(get("lookup")))
    return {
        "wall": wall,
        "verify": v,
        "draft_busy": _length(build) + drafted,
        "draft_exposed": exposed,
        "lookup": lk,
        "control": max(0.0, wall - v - exposed - lk),
    }


def prediction_error(rounds: Sequence[RoundRecord | Mapping[str, Any]]) -> dict[str, float] | None:
    """How far ``auto``'s predictions were from what its rounds then took, over the decode
    rounds that carry one: the median of |predicted / measured − 1| for the round's
    seconds and for its emitted tokens, the mean predicted / measured seconds (below 1:
    auto expected its rounds faster than they ran) and the same for the verification alone
    (``verify_ratio``: where it is near 1 and ``seconds_ratio`` is not, drafting or the
    control plane was mispredicted), and how many rounds were compared.
    A round where some sequence auto chose to speculate ran AR while its drafts caught up
    did not run what was predicted: it is counted apart (``not_ready_rounds``), not
    compared; so are the catch-ups' tokens and the rounds that ran beside one
    (``catch_up_tokens``, ``catch_up_rounds``). None when no round carries a prediction."""
    secs, toks, verify, not_ready, caught, beside = [], [], [], 0, 0, 0
    for r in rounds:
        get = r.get if isinstance(r, Mapping) else lambda name, r=r: getattr(r, name)
        pred = get("auto")
        if not pred or get("prefill"):
            continue
        caught += get("catch_up_sent") or 0
        beside += bool(get("catching_up"))
        if pred.get("not_ready"):
            not_ready += 1
            continue
        wall = get("end") - get("start")
        emitted = sum(get("accepted")) + len(get("accepted"))
        if wall > 0:
            secs.append(pred["chosen"]["seconds"] / wall)
        span = get("verify")
        if span is not None and span[1] > span[0] and "verify" in pred["chosen"]:
            verify.append(pred["chosen"]["verify"] / (span[1] - span[0]))
        if emitted > 0:
            toks.append(pred["chosen"]["tokens"] / emitted)
    if not secs:
        return None
    return {
        "rounds": float(len(secs)),
        "not_ready_rounds": float(not_ready),
        "catch_up_tokens": float(caught),
        "catch_up_rounds": float(beside),
        "seconds_error": statistics.median(abs(x - 1.0) for x in secs),
        "seconds_ratio": statistics.fmean(secs),
        "verify_ratio": statistics.fmean(verify) if verify else math.nan,
        "tokens_error": statistics.median(abs(x - 1.0) for x in toks) if toks else math.nan,
    }
