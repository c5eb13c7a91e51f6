"""One strategy per mode: how a sequence's proposal for a round is made.

The round loop (:mod:`saguaro_ray.engine.round_loop`) fixes each running
sequence's mode and K for the round (:mod:`.assign`), hands each mode's
sequences to that mode's strategy, and verifies the whole batch at once.
AR, SD and PyramidSD are :class:`Proposer`\\ s: they draft before
verification and keep nothing between rounds. SSD's drafting rides along the
verification itself (its builds and lookups), so it sends the round's one
verification — with the other modes' proposals beside its own — and keeps
its estimators and the KV deltas of its hits between rounds
(:class:`~saguaro_ray.engine.strategies.ssd.SSDStrategy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import Span
from saguaro_ray.workers.messages import Proposal

if TYPE_CHECKING:
    from saguaro_ray.engine.round_loop import RoundLoop


class Proposer(Protocol):
    rule: tuple[str, float]  # the rule and threshold its proposals are verified with

    def propose(self, seqs: list[SequenceState]) -> tuple[list[Proposal], Span | None]:
        """This round's proposals for ``seqs`` and the drafting span (None: no drafting)."""


def make_strategies(loop: "RoundLoop") -> dict[str, Any]:
    """Every mode's strategy driving ``loop``, by mode name."""
    from saguaro_ray.engine.strategies.ar import ARStrategy
    from saguaro_ray.engine.strategies.pyramid import PyramidStrategy
    from saguaro_ray.engine.strategies.sd import SDStrategy
    from saguaro_ray.engine.strategies.ssd import SSDStrategy

    return {"ar": ARStrategy(), "sd": SDStrategy(loop), "ssd": SSDStrategy(loop), "pyramid": PyramidStrategy(loop)}
