"""What a process's threads are, for leak checks (the soak and load tests).

A leak shows as threads that accumulate per request. Counting them by kind —
the thread's name less a pool's running number — says which code started
them. Threads Python did not start (Ray's native threads that once ran a
Python callback) appear as one ``Dummy`` wrapper each, which Python keeps for
the thread's life: their number follows Ray's own pools, not our requests,
so :func:`own_threads` leaves them out.
"""

from __future__ import annotations

import re
import threading
from collections import Counter


def own_threads() -> list[threading.Thread]:
    """The live threads this process's Python code started."""
    return [t for t in threading.enumerate() if not isinstance(t, threading._DummyThread)]


def thread_kinds() -> dict[str, int]:
    """Live threads by kind (name without its trailing number), foreign ones as ``Dummy``."""
    return dict(Counter(re.sub(r"[-_]?\d+$", "", t.name) for t in threading.enumerate()))
