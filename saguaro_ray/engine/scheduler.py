"""Continuous batching: requests join and leave the running batch at round boundaries.

One thread owns the :class:`RoundLoop`. Between rounds it admits queued
requests (prefilled on every worker, then part of the next round), runs one
round for everything running, streams each sequence's newly emitted tokens to
its listener, and completes requests whose samples have all finished (their
KV is freed on every worker as they finish). Every request keeps its own
sampling parameters and seed; the backup policy sees the live batch size
because each round passes the whole running batch.

A failing round fails the requests it was running with that error and frees
them; the scheduler keeps serving the others — nothing hangs.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from saguaro_ray.engine.rounds import RoundLoop
from saguaro_ray.engine.sequence import SequenceState

log = logging.getLogger(__name__)

TokenListener = Callable[[SequenceState, list[int]], None]


@dataclass
class _Request:
    seqs: list[SequenceState]
    future: "Future[list[SequenceState]]"
    listener: TokenListener | None
    sent: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens already streamed


class Scheduler:
    def __init__(self, loop: RoundLoop, max_batch_size: int = 64, name: str = "saguaro-scheduler") -> None:
        self.loop = loop
        self.max_batch_size = max_batch_size
        self._queue: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ clients
    def submit(self, seqs: list[SequenceState], listener: TokenListener | None = None) -> "Future[list[SequenceState]]":
        """Queue one request (its samples); the future resolves when all finish."""
        fut: Future[list[SequenceState]] = Future()
        with self._cv:
            if self._stop:
                raise RuntimeError("scheduler is shut down")
            self._queue.append(_Request(seqs, fut, listener, {s.seq_id: 0 for s in seqs}))
            self._cv.notify()
        return fut

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._queue)

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        running: list[SequenceState] = []
        owners: dict[int, _Request] = {}
        while True:
            with self._cv:
                while not self._stop and not self._queue and not running:
                    self._cv.wait()
                if self._stop:
                    break
                admitted: list[_Request] = []
                room = self.max_batch_size - len(running)
                # admit while the next request fits; an idle engine always takes
                # the head, even a request with more samples than the batch size
                while self._queue and (len(self._queue[0].seqs) <= room or not (running or admitted)):
                    req = self._queue.popleft()
                    admitted.append(req)
                    room -= len(req.seqs)
            for req in admitted:
                for s in req.seqs:
                    owners[s.seq_id] = req
            new = [s for req in admitted for s in req.seqs]
            try:
                if new:
                    running += self.loop.admit(new)
                if running:
                    running = self.loop.advance(running)
            except Exception as exc:  # a failed round fails the requests it touched
                log.exception("round failed; failing %d running sequences", len(running) + len(new))
                touched = {id(owners[s.seq_id]): owners[s.seq_id] for s in running + new}
                try:
                    self.loop.release([s for s in running + new if not s.finished])
                except Exception:
                    log.exception("releasing failed sequences also failed")
                for req in touched.values():
                    if not req.future.done():
                        req.future.set_exception(exc)
                    for s in req.seqs:
                        owners.pop(s.seq_id, None)
                running = []
                continue
            self._publish(owners)
        # shutting down: release what is still running, fail pending requests
        if running:
            try:
                self.loop.release(running)
            except Exception:
                log.exception("release during shutdown failed")
        err = RuntimeError("engine shut down before the request finished")
        for req in {id(r): r for r in owners.values()}.values():
            if not req.future.done():
                req.future.set_exception(err)
        with self._cv:
            while self._queue:
                self._queue.popleft().future.set_exception(err)

    def _publish(self, owners: dict[int, _Request]) -> None:
        """Stream new tokens; complete requests whose samples are all done."""
        for req in {id(r): r for r in owners.values()}.values():
            for s in req.seqs:
                sent = req.sent[s.seq_id]
                if req.listener is not None and len(s.output_ids) > sent:
                    try:
                        req.listener(s, s.output_ids[sent:])
                    except Exception:
                        log.exception("token listener failed; continuing")
                req.sent[s.seq_id] = len(s.output_ids)
            if all(s.finished for s in req.seqs):
                for s in req.seqs:
                    owners.pop(s.seq_id, None)
                if not req.future.done():
                    req.future.set_result(req.seqs)
