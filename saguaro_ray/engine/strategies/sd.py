"""SD: the draft proposes each sequence's K tokens, then the target verifies them.

Without a draft up, the proposal is the fast point-mass guess (exact, slower).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import Span
from saguaro_ray.workers.messages import Proposal

if TYPE_CHECKING:
    from saguaro_ray.engine.round_loop import RoundLoop


class SDStrategy:
    rule = ("exact", 0.0)

    def __init__(self, loop: "RoundLoop") -> None:
        self.loop = loop

    def propose(self, seqs: list[SequenceState]) -> tuple[list[Proposal], Span | None]:
        loop = self.loop
        ks = [loop.spec_len(s, s.k) for s in seqs]
        t0 = time.perf_counter()
        got = loop.draft_value(loop.draft_call("propose", lambda full: ([loop.step(s, full, "draft") for s in seqs], ks)))
        if got is None:
            return loop.fast(seqs, ks), (t0, time.perf_counter())
        return got
