"""Worker spans on the coordinator's clock.

A reply carries the span its call ran over on the worker's ``perf_counter``;
over ``tcp://`` that is another machine's clock, so the client maps each span
onto its own before the round loop's timeline uses it.
"""

from __future__ import annotations

from saguaro_ray.workers.messages import Timed


class ClockMap:
    """Maps a worker's ``perf_counter`` spans onto this process's clock.

    Each reply is an NTP-style sample: sent at ``t0`` (here), ran over
    ``[start, end]`` (there), received at ``t1`` (here); ``offset = ((start -
    t0) + (end - t1)) / 2`` with error at most ``(t1 - t0 - (end - start)) / 2``.
    The sample with the smallest error bound (aged by a generous drift rate)
    wins, so calls that waited in the worker's queue never spoil it.
    """

    DRIFT = 1e-4  # s/s

    def __init__(self) -> None:
        self.offset = 0.0
        self.bound = float("inf")
        self._at = 0.0

    def sample(self, t0: float, t1: float, start: float, end: float) -> None:
        bound = max(0.0, (t1 - t0) - (end - start)) / 2
        if bound <= self.bound + self.DRIFT * (t1 - self._at):
            self.offset = ((start - t0) + (end - t1)) / 2
            self.bound = bound
            self._at = t1

    def map(self, timed: Timed) -> Timed:
        return Timed(timed.value, timed.start - self.offset, timed.end - self.offset)
