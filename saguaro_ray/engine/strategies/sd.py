"""SD: the draft proposes K tokens, then the target verifies them.

Without a draft up, the proposal is the fast point-mass guess (exact, slower).
"""

from __future__ import annotations

import time

from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.strategies import PlainStrategy
from saguaro_ray.engine.timeline import RoundRecord


class SDStrategy(PlainStrategy):
    def run(self, running: list[SequenceState], rec: RoundRecord) -> None:
        loop = self.loop
        ks = [loop.spec_len(s, loop.spec.k) for s in running]
        t0 = time.perf_counter()
        got = loop.draft_value(loop.draft_call("propose", lambda full: ([loop.step(s, full) for s in running], ks)))
        if got is None:
            proposals, rec.draft = loop.fast(running, ks), (t0, time.perf_counter())
        else:
            proposals, rec.draft = got
        outcomes = loop.verified(loop.verify(running, proposals, rec), rec)
        loop.emit(running, proposals, outcomes, rec)
