"""One round strategy per mode: how a round makes and verifies its proposals.

The round loop (:mod:`saguaro_ray.engine.round_loop`) calls its strategy once
per round with the running sequences and the round's record; everything a
mode keeps between rounds (SSD's estimators and the KV deltas of its hits)
lives in its strategy, so a round of any mode reads top to bottom in the
loop and one file here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import RoundRecord

if TYPE_CHECKING:
    from saguaro_ray.engine.round_loop import RoundLoop


class RoundStrategy(Protocol):
    def run(self, running: list[SequenceState], rec: RoundRecord) -> None:
        """One round for ``running``: propose, verify, emit (through the loop)."""

    def ended(self, rec: RoundRecord) -> None:
        """The round is over (``rec.end`` is set): learn from it."""

    def dropped(self, seqs: Sequence[SequenceState], finished: bool) -> None:
        """``seqs`` leave the batch (``finished``, or cancelled/failed): let go
        of what the strategy holds for them."""


class PlainStrategy:
    """A strategy that keeps nothing between rounds (the base of AR, SD and PyramidSD)."""

    def __init__(self, loop: "RoundLoop") -> None:
        self.loop = loop

    def run(self, running: list[SequenceState], rec: RoundRecord) -> None:
        raise NotImplementedError

    def ended(self, rec: RoundRecord) -> None:
        return None

    def dropped(self, seqs: Sequence[SequenceState], finished: bool) -> None:
        return None


def strategy_for(mode: str, loop: "RoundLoop") -> RoundStrategy:
    """The strategy of ``mode`` (``ar``, ``sd``, ``ssd``, ``pyramid``) driving ``loop``."""
    from saguaro_ray.engine.strategies.ar import ARStrategy
    from saguaro_ray.engine.strategies.pyramid import PyramidStrategy
    from saguaro_ray.engine.strategies.sd import SDStrategy
    from saguaro_ray.engine.strategies.ssd import SSDStrategy

    kinds: dict[str, type] = {"ar": ARStrategy, "sd": SDStrategy, "ssd": SSDStrategy, "pyramid": PyramidStrategy}
    return kinds[mode](loop)
