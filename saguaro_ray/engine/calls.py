"""Worker calls as the round loop makes them: retried when a worker lost its state.

The loop and its strategies only ever submit calls and wait on futures
(:mod:`saguaro_ray.engine.transport`); this module is what makes a call
survive a worker restart or a lost data-plane transfer, the one broadcast
every transport can do, and the shape of a call another worker places for
the round loop (:class:`Forwarded`: SSD's lookups, placed by the target).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from saguaro_ray.engine.transport import TransferLost, WorkerGone, WorkerHandle, WorkerLost
from saguaro_ray.workers.messages import NeedsPrefillError, Timed

log = logging.getLogger(__name__)

ArgsFn = Callable[[bool], tuple]
# one call to many workers at once: (workers, method, args) -> one future per worker
BroadcastFn = Callable[[Sequence[WorkerHandle], str, tuple], "list[Future[Timed]]"]


@dataclass
class Forwarded:
    """A call another worker places on ``worker`` for this coordinator:
    ``address`` is what that worker needs to send it (endpoint, server id,
    reply routing id, call id), ``future`` its answer, ``forget()`` withdraws it."""

    worker: WorkerHandle
    address: list[Any]
    future: "Future[Timed]"
    forget: Callable[[], None]


# register one forwarded call per worker: (workers, method) -> Forwarded per worker
ForwardFn = Callable[[Sequence[WorkerHandle], str], "list[Forwarded]"]


def submit_each(workers: Sequence[WorkerHandle], method: str, args: tuple) -> "list[Future[Timed]]":
    """The plain broadcast: one call per worker (in process, or without a broadcast socket)."""
    return [w.submit(method, *args) for w in workers]


class RetryingCall:
    """A worker call that survives the worker losing its state.

    ``args_fn(full)`` builds the call's arguments; ``full=True`` makes them
    self-contained: every sequence's whole history from position 0, and
    nothing that refers to another worker's data-plane transfers (a proposal's
    q rows become a point mass on its tokens — still exact, as the tokens do
    not depend on the verifier's randomness; a peer's KV delta is dropped). A
    worker that answers :class:`NeedsPrefillError` (it was restarted, or never
    saw a sequence) or :class:`TransferLost` gets the self-contained call; a
    worker that was lost mid-call is recovered first (blocking) — unless
    ``degradable``, in which case :class:`WorkerLost` reaches the caller,
    which carries on without it.
    """

    def __init__(self, worker: WorkerHandle, method: str, args_fn: ArgsFn, degradable: bool = False, fut: "Future[Timed] | None" = None) -> None:
        self.worker, self.method, self.args_fn, self.degradable = worker, method, args_fn, degradable
        self.fut = worker.submit(method, *args_fn(False)) if fut is None else fut  # ``fut``: already sent (a broadcast)
        self.resent = False  # the answer came from a self-contained re-send, not the first call

    def result(self, attempts: int = 3) -> Timed:
        for _ in range(attempts):
            try:
                return self.fut.result()
            except (NeedsPrefillError, TransferLost):
                pass
            except WorkerLost:
                if self.degradable:
                    raise
                log.warning("%s lost; recovering and re-prefilling", self.worker.name)
                self.worker.recover()
            self.resent = True
            self.fut = self.worker.submit(self.method, *self.args_fn(True))
        return self.fut.result()

    def value(self) -> tuple[Any, tuple[float, float]]:
        timed = self.result()
        return timed.value, (timed.start, timed.end)


def released(worker: str, fut: "Future[Timed]") -> None:
    """Report how a release ended (see ``RoundLoop._release``)."""
    try:
        fut.result()
    except (WorkerLost, WorkerGone, NeedsPrefillError):
        log.info("release on %s skipped: its state is already gone", worker)
    except Exception as e:  # the sequences are finished either way; their room is lost until a restart
        log.warning("release on %s failed: %s", worker, e)


def caught_up(worker: str, fut: "Future[Timed]") -> None:
    """Report a draft catch-up that failed (see ``RoundLoop.drafts_ready``):
    harmless — the next call the draft cannot serve is re-sent self-contained."""
    if fut.exception() is not None:
        log.info("catch-up on %s failed: %s", worker, fut.exception())


def discarded(worker: str, fut: "Future[Timed]") -> None:
    """Report a discard that failed (see ``RoundLoop.discard``): its sender keeps the transfer until the data plane is rebuilt."""
    if fut.exception() is not None:
        log.info("discard on %s failed: %s", worker, fut.exception())
