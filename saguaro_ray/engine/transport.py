"""How a round loop reaches its workers.

The round loop only ever calls ``worker.submit(method, *args)`` and waits on
the returned future, so the same loop drives workers in this process (one
thread per worker — calls to one worker run in order, like an actor's) or in
Ray actors over ZeroMQ. One protocol, two transports.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

# the round loop catches these by type; they live in saguaro_ray.errors, imported
# here so the transport contract names them where it always has
from saguaro_ray.errors import TransferLost, WorkerGone, WorkerLost  # noqa: F401
from saguaro_ray.workers.messages import Timed


class WorkerHandle(Protocol):
    name: str

    def submit(self, method: str, *args: Any) -> "Future[Timed]":
        """Call ``method`` on the worker; the future resolves to a :class:`Timed`."""

    def recover(self) -> None:
        """Block until the worker is reachable again after :class:`WorkerLost`
        (a fresh, empty worker); raise :class:`WorkerGone` if it cannot be."""

    def close(self) -> None: ...


class InProcessWorker:
    """Runs a worker-logic object's methods on its own thread, in call order.

    With ``after_reply``, a logic's ``after_reply()`` (see ``DraftLogic.after_reply``)
    names work to run once a call has been answered; it is queued on the
    worker's thread before the answer is released, so it runs ahead of any
    later call."""

    def __init__(self, name: str, logic: Any, after_reply: bool = False) -> None:
        self.name = name
        self.logic = logic
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"saguaro-{name}")
        self._after_reply = getattr(logic, "after_reply", None) if after_reply else None

    def submit(self, method: str, *args: Any) -> "Future[Timed]":
        fn = getattr(self.logic, method)

        def run() -> Timed:
            start = time.perf_counter()
            value = fn(*args)
            timed = Timed.since(value, start)
            work = self._after_reply() if self._after_reply is not None else None
            if work is not None:
                try:
                    self._pool.submit(work)
                except RuntimeError:  # the worker is closing: nothing more will be asked of it
                    pass
            return timed

        return self._pool.submit(run)

    def call(self, method: str, *args: Any) -> Any:
        return self.submit(method, *args).result().value

    def recover(self) -> None:
        """An in-process worker cannot be lost."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
