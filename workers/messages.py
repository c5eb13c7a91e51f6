"""The worker protocol's messages: plain data, the same in-process and over the wire.

Every call a round loop makes on a worker takes a list of these items (one per
sequence in the batch) — so one round is one call per worker whatever the
batch size. Positions in a sequence are explicit: ``start`` is how many of the
sequence's committed tokens the worker must already hold (it truncates
anything past that — rejected speculation — before appending
``new_tokens``), and ``output_pos`` is the index among generated tokens of the
first token sampled in this call (it keys the random streams).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from saguaro_ray.algorithms.logprobs import TokenLogprobs
from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.errors import NeedsPrefillError  # noqa: F401  (its home is saguaro_ray.errors; workers import it from here)

RECENT_TOKENS = 4  # committed tokens each step repeats so a worker one token behind can catch up


@dataclass
class SeqStep:
    """Where a sequence stands when a worker call begins."""

    seq_id: int
    start: int
    new_tokens: list[int]
    params: SamplingParams
    seed: int
    output_pos: int
    # the committed tokens just before `start` (a few): lets a worker that is
    # slightly behind — a draft whose last proposed token was never fed
    # because everything was accepted — catch up without a full resend
    recent: list[int] = field(default_factory=list)
    # how many of the sequence's tokens are the prompt: penalties and grammars
    # read the generated tokens apart (None: not said; steps made by hand)
    prompt_len: int | None = None


class ProposalSource(str, enum.Enum):
    """Where a proposal came from: it sets the acceptance regime the fan-out
    and backup statistics file it under. A ``str`` enum, so it travels as its
    plain value (see :mod:`saguaro_ray.runtime.wire`)."""

    DRAFT = "draft"  # the draft's sequential proposal (SD, pyramid's drafting)
    CACHE = "cache"  # an SSD cache hit
    NEURAL = "neural"  # SSD's neural backup: K draft steps from the real outcome
    FAST = "fast"  # SSD's fast backup (or any draft-less fallback): a point-mass n-gram guess
    QUALIFIED = "qualified"  # PyramidSD: the qualifier's tokens

    def __str__(self) -> str:
        return self.value


@dataclass
class Proposal:
    """A speculation: tokens, and where a lossy fuzzy PyramidSD stage reads
    it, the exact law each was drawn from.

    ``q`` is ``[len(tokens), V]`` — the rows really sampled from — for a
    draft's proposal to a fuzzy stage 1 and a fuzzy stage 1's qualified block;
    ``None`` everywhere else: the drafter-invariant rule compares tokens, and
    the fuzzy test reads point masses (greedy drafting, fast backups) as
    δ_token.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    source: ProposalSource = ProposalSource.DRAFT

    def __post_init__(self) -> None:
        self.source = ProposalSource(self.source)  # off the wire it arrives as its value


@dataclass
class VerifyItem:
    """Check ``proposal`` after ``step``'s new tokens with ``rule``: the
    target's verification (``exact``, or PyramidSD's stage-2 test) and the
    qualifier's stage 1 alike. ``tau``/``div`` parametrise the lossy rules;
    ``div``'s default is :class:`SpeculationConfig`'s (the round loop always
    passes the configured one). ``laws`` (a qualifier's item): the qualified
    tokens carry the qualifier's rows they were drawn from, which a lossy
    fuzzy stage 2 reads as q."""

    step: SeqStep
    proposal: Proposal
    rule: str = "exact"
    tau: float = 0.0
    div: str = SpeculationConfig.div
    laws: bool = False


@dataclass
class Outcome:
    """Verification result of one sequence: k accepted draft tokens, then t*.

    ``logprobs``: the target's log-probabilities of those k + 1 tokens, from
    the verification's own rows, for a sequence whose params ask for them
    (None otherwise)."""

    seq_id: int
    accepted: int
    next_token: int
    proposed: int = 0  # how many draft tokens were checked
    logprobs: list[TokenLogprobs] | None = None

    def emitted(self, proposal: Proposal) -> list[int]:
        return proposal.tokens[: self.accepted] + [self.next_token]

    @property
    def key(self) -> tuple[int, int, int]:
        """What an SSD lookup looks up: (seq_id, k, t*)."""
        return (self.seq_id, self.accepted, self.next_token)


@dataclass
class KVDelta:
    """A cache hit's *KV delta*: what the owning draft already computed along
    the speculation it served, so no draft recomputes it.

    ``tokens`` = [t*, x_1, .., x_{K-1}] sit at positions ``start``, ``start+1``,
    … of sequence ``seq_id``; ``rankings[j]`` is the draft's ranking of the
    next token after ``tokens[: j + 1]`` (the glue rows the next build needs):
    its top tokens in order on the wire, the logit row itself in the draft
    that computed it (see :mod:`saguaro_ray.algorithms.ranking`);
    ``kv`` is the draft model's per-layer (K, V) rows ``[len(tokens), Hkv, D]``
    for those tokens — tensors in process, a data-plane descriptor between
    actors, or ``None`` where the receiver already holds them (the owner).
    """

    seq_id: int
    start: int
    tokens: list[int]
    rankings: list[Any]
    kv: Any = None


@dataclass
class BuildItem:
    """Ask a draft to pre-compute next round's speculations for the most likely
    outcomes of verifying ``proposal`` (SSD).

    With several drafts the candidate outcomes (k, t) of the fan-out are dealt
    out in a fixed order; this draft builds every ``num_shards``-th one from
    ``shard``. ``kv_delta``: a peer draft's KV delta for this sequence (the
    hit that produced ``proposal``), appended instead of recomputed."""

    step: SeqStep
    proposal: Proposal
    fanout: list[int]  # F_k for k = 0..len(proposal.tokens)
    k_next: int  # speculation length of the next round
    shard: int = 0
    num_shards: int = 1
    kv_delta: KVDelta | None = None


@dataclass
class NextRound:
    """What the round after a lookup verifies and builds for one sequence,
    whatever the outcome — made before verification (the target places the
    lookup the moment verification ends) and sent to the only draft, so that
    it serves a miss with its backup in the same call and, knowing every next
    proposal, starts the next round's build itself (``DraftLogic.after_reply``).

    Read at the real outcome (k accepted, then t) together with this round's
    build item (its step and proposal), which the draft already holds:
    ``ks``: the next round's speculation length — one entry for every
    outcome, or (near a length limit, where it depends on the outcome) entry
    k for k accepted; ``backup``: the kind that serves a miss (``neural``: K
    draft tokens from the next step; ``fast``: the n-gram guess from
    ``history``, the sequence's token ids before this outcome);
    ``after_hit`` / ``after_backup``: the next build's fan-out when the next
    proposal is a hit / that backup, entry for entry with ``ks``. See
    :func:`saguaro_ray.workers.ssd_protocol.resolve`."""

    ks: list[int]
    backup: str
    after_hit: list[list[int]]
    after_backup: list[list[int]]
    history: list[int] | None = None


@dataclass
class LookupResult:
    """A draft's answer for one real outcome: the cached speculation (None on
    a miss here), the rank of t* in the draft's ranking of row k (for fitting
    the fan-out; None if not within the kept depth), on a hit the KV delta
    peers append (see :class:`KVDelta`), and on a miss the neural backup
    speculation drafted from the real outcome when the lookup asked for one
    (:class:`NextRound`)."""

    proposal: Proposal | None
    rank: int | None
    kv_delta: KVDelta | None = None
    backup: Proposal | None = None


@dataclass
class Timed:
    """A worker call's result with its wall-clock span (``time.perf_counter``)."""

    value: Any
    start: float
    end: float

    @staticmethod
    def since(value: Any, start: float) -> "Timed":
        """A call's answer, timed from ``start`` to now — unless the method
        returned a :class:`Timed` itself: its work ran before the call (a
        build started ahead), and it names the span that work really took."""
        return value if isinstance(value, Timed) else Timed(value, start, time.perf_counter())
