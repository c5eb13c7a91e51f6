"""How a round loop reaches its workers.

The round loop only ever calls ``worker.submit(method, *args)`` and waits on
the returned future, so the same loop drives workers in this process (one
thread per worker — calls to one worker run in order, like an actor's) or in
Ray actors over ZeroMQ. One protocol, two transports.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ContextManager, Protocol

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

    def __init__(self, name: str, logic: Any, after_reply: bool = False, turns: threading.Lock | None = None) -> None:
        """``turns``: a lock the workers of one device share, so their calls
        take turns (the in-process engine on CUDA: a CUDA graph being recorded
        in one worker's thread fails — and fails the other worker's call —
        when another thread launches work on the device meanwhile, as the
        first GPU run showed)."""
        self.name = name
        self.logic = logic
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"saguaro-{name}")
        self._after_reply = getattr(logic, "after_reply", None) if after_reply else None
        self._turn: ContextManager[Any] = turns if turns is not None else contextlib.nullcontext()

    def submit(self, method: str, *args: Any) -> "Future[Timed]":
        if self.logic is None:
            raise RuntimeError(f"the {self.name} worker is closed")
        fn = getattr(self.logic, method)

        def run() -> Timed:
            start = time.perf_counter()
            with self._turn:
                value = fn(*args)
            timed = Timed.since(value, start)
            work = self._after_reply() if self._after_reply is not None else None
            if work is not None:
                try:
                    self._pool.submit(self._in_turn, work)
                except RuntimeError:  # the worker is closing: nothing more will be asked of it
                    pass
            return timed

        return self._pool.submit(run)

    def _in_turn(self, work: Any) -> None:
        with self._turn:
            work()

    def call(self, method: str, *args: Any) -> Any:
        return self.submit(method, *args).result().value

    def recover(self) -> None:
        """An in-process worker cannot be lost."""

    def close(self) -> None:
        """Finish the calls in flight, then let go of the logic: its model and
        KV cache are freed with the last reference, not when the engine object is."""
        self._pool.shutdown(wait=True)
        self.logic = self._after_reply = None
