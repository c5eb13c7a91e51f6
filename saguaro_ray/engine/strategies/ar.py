"""AR: the proposal is empty; verification samples one token per sequence."""

from __future__ import annotations

from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import Span
from saguaro_ray.workers.messages import Proposal


class ARStrategy:
    rule = ("exact", 0.0)

    def propose(self, seqs: list[SequenceState]) -> tuple[list[Proposal], Span | None]:
        return [Proposal([]) for _ in seqs], None
