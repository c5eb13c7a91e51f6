"""How often a worker may be restarted: N restarts in any window of W seconds.

A lifetime count (Ray's own ``max_restarts``) turns a long-running server
into a dead one after its N-th unrelated fault, days apart. A window bounds
what matters — a worker that keeps dying — and forgives faults that are far
apart. So Ray restarts worker actors without limit, and the engine spends
from a :class:`RestartBudget` each time it finds a worker restarted; when a
restart exceeds the budget the engine stops that worker for good.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

# what worker actors get as Ray's max_restarts: no limit of Ray's own, so it
# never undercuts the engine's window (the engine stops a worker past it)
RAY_MAX_RESTARTS = -1


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds
    (``math.inf``: a lifetime count)."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._spent: deque[float] = deque()  # when the restarts still inside the window happened

    def spend(self) -> bool:
        """Record a restart now; False when it is one more than the window allows."""
        now = self._clock()
        while self._spent and now - self._spent[0] >= self.window_s:
            self._spent.popleft()
        self._spent.append(now)
        return len(self._spent) <= self.max_restarts

    def exhausted(self) -> bool:
        """Whether a restart now would be one more than the window allows (what
        :meth:`spend` would answer, without recording anything)."""
        now = self._clock()
        return sum(1 for t in self._spent if now - t < self.window_s) + 1 > self.max_restarts

    def __str__(self) -> str:
        within = "in its lifetime" if math.isinf(self.window_s) else f"within {self.window_s:g} s"
        return f"max_restarts={self.max_restarts} {within}"
