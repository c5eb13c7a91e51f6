"""AR: the proposal is empty; verification samples one token per sequence."""

from __future__ import annotations

from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.strategies import PlainStrategy
from saguaro_ray.engine.timeline import RoundRecord
from saguaro_ray.workers.messages import Proposal


class ARStrategy(PlainStrategy):
    def run(self, running: list[SequenceState], rec: RoundRecord) -> None:
        loop = self.loop
        proposals = [Proposal([]) for _ in running]
        outcomes = loop.verified(loop.verify(running, proposals, rec), rec)
        loop.emit(running, proposals, outcomes, rec)
