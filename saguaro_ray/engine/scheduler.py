"""Continuous batching: requests join and leave the running batch at round boundaries.

One thread owns the :class:`RoundLoop`. Between rounds it admits queued
requests (prefilled on every worker, then part of the next round), runs one
round for everything running, streams each sequence's newly emitted tokens to
its listener, and completes requests whose samples have all finished (their
KV is freed on every worker as they finish). Every request keeps its own
sampling parameters and seed; the backup policy sees the live batch size
because each round passes the whole running batch.

A failure is one request's, not the batch's: when an admission or a round
fails, every worker forgets the sequences it carried and each is retried
alone (its worker state rebuilt from the authoritative history, so a retried
sequence continues exactly); only the requests whose own retry fails get the
error. ``abort(request_id)`` drops a request at the next round boundary and
frees its KV everywhere, through the same release path finished sequences
take — nothing hangs and nothing keeps decoding for a client that left. A
request past its ``deadline_s`` is dropped the same way. The admission queue
is bounded (``max_queued`` samples): past it a request is refused at once
with :class:`EngineOverloadedError`, before anything of it is queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from saguaro_ray.engine.round_loop import RoundLoop
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.transport import WorkerGone
from saguaro_ray.errors import DeadlineExceededError, EngineOverloadedError, OutOfKVBlocksError, RequestAbortedError

log = logging.getLogger(__name__)

TokenListener = Callable[[SequenceState, list[int]], None]




@dataclass
class _Request:
    seqs: list[SequenceState]
    future: "Future[list[SequenceState]]"
    listener: TokenListener | None
    request_id: str | None = None
    deadline: float | None = None  # time.monotonic() past which it is aborted
    sent: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens already streamed


class Scheduler:
    """``kv_tokens``: the smallest KV capacity (tokens) among the workers; a
    request is admitted only when the worst-case KV of everything running plus
    it fits, and one that could never fit is refused at once. ``max_queued``:
    samples that may wait for admission (None: unbounded)."""

    def __init__(
        self,
        loop: RoundLoop,
        max_batch_size: int = 64,
        kv_tokens: int | None = None,
        block_size: int = 16,
        name: str = "saguaro-scheduler",
        max_queued: int | None = None,
    ) -> None:
        self.loop = loop
        self.max_queued = max_queued
        self.max_batch_size = max_batch_size
        self.kv_tokens = kv_tokens
        self.block_size = block_size
        self._queue: deque[tuple[_Request, SequenceState]] = deque()  # samples wait individually
        self._aborts: set[str] = set()  # request ids to drop at the next round boundary
        self._running = 0  # samples in the running batch (for ``active``)
        self._timed: list[_Request] = []  # requests with a deadline that may still be live
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ clients
    def submit(
        self, seqs: list[SequenceState], listener: TokenListener | None = None, request_id: str | None = None
    ) -> "Future[list[SequenceState]]":
        """Queue one request (its samples); the future resolves when all finish.
        ``request_id`` names it for :meth:`abort` (several requests may share one)."""
        return self.submit_many([seqs], listener, request_id)[0]

    def submit_many(
        self, requests: list[list[SequenceState]], listener: TokenListener | None = None, request_id: str | None = None
    ) -> "list[Future[list[SequenceState]]]":
        """Queue several requests at once, all or none: raises
        :class:`EngineOverloadedError` when their samples do not fit the
        admission queue."""
        now = time.monotonic()
        reqs = []
        for seqs in requests:
            fut: Future[list[SequenceState]] = Future()
            need = max(self._kv_need([s]) for s in seqs)
            if self.kv_tokens is not None and need > self.kv_tokens:
                fut.set_exception(
                    OutOfKVBlocksError(
                        f"one sample needs up to {need} KV tokens (prompt + max_tokens + speculation) but the "
                        f"engine holds {self.kv_tokens}; lower max_tokens or raise max_kv_tokens"
                    )
                )
            limits = [s.params.deadline_s for s in seqs if s.params.deadline_s is not None]
            deadline = now + min(limits) if limits else None
            # a resumed sample's output so far is its caller's already: only what follows is published
            reqs.append(_Request(seqs, fut, listener, request_id, deadline, {s.seq_id: len(s.output_ids) for s in seqs}))
        todo = [r for r in reqs if not r.future.done()]
        with self._cv:
            if self._stop:
                raise RuntimeError("scheduler is shut down")
            waiting, adding = len(self._queue), sum(len(r.seqs) for r in todo)
            if self.max_queued is not None and waiting + adding > self.max_queued:
                raise EngineOverloadedError(
                    f"the engine is overloaded: {waiting} samples wait for admission and this request adds {adding} "
                    f"(at most {self.max_queued} may wait); retry later"
                )
            for r in todo:
                self._queue.extend((r, s) for s in r.seqs)
            self._timed += [r for r in todo if r.deadline is not None]
            self._cv.notify()
        return [r.future for r in reqs]

    def abort(self, request_id: str) -> None:
        """Drop every request named ``request_id`` at the next round boundary:
        its samples stop decoding, their KV is freed on every worker, and its
        future fails with :class:`RequestAbortedError`. Unknown or finished
        ids are ignored (the client may race the last round)."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        """Samples waiting for admission."""
        with self._cv:
            return len(self._queue)

    @property
    def active(self) -> int:
        """Samples queued or running (0: the engine is idle)."""
        with self._cv:
            return len(self._queue) + self._running

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        running: list[SequenceState] = []
        owners: dict[int, _Request] = {}
        while True:
            with self._cv:
                while not self._stop and not self._queue and not running and not self._aborts:
                    self._cv.wait()
                if self._stop:
                    break
                aborts, self._aborts = self._aborts, set()
                if aborts:
                    self._queue = deque(self._drop_aborted(self._queue, aborts))
                new: list[SequenceState] = []
                room = self.max_batch_size - len(running)
                kv_room = None if self.kv_tokens is None else self.kv_tokens - self._kv_need(running)
                # admit samples in arrival order while they fit the batch and the KV
                while self._queue and len(new) < room:
                    req, seq = self._queue[0]
                    need = self._kv_need([seq])
                    if kv_room is not None and need > kv_room and (running or new):
                        break
                    self._queue.popleft()
                    new.append(seq)
                    owners[seq.seq_id] = req
                    if kv_room is not None:
                        kv_room -= need
                self._running = len(running) + len(new)
            if aborts:
                for req in {id(r): r for r in owners.values() if r.request_id in aborts}.values():
                    self._fail(req, RequestAbortedError(f"request {req.request_id} was aborted"), owners)
            self._expire(owners)
            running = self._purge(running, owners)
            new = [s for s in new if s.seq_id in owners]  # a request that just expired is not prefilled
            if new:
                running += self._admit(new, owners)
            if running:
                running = self._advance(running, owners)
            self._publish(owners)
            with self._cv:
                self._running = len(running)
        # shutting down: release what is still running, fail pending requests
        if running:
            self._release(running)
        err = RuntimeError("engine shut down before the request finished")
        for req in {id(r): r for r in owners.values()}.values():
            if not req.future.done():
                req.future.set_exception(err)
        with self._cv:
            while self._queue:
                req, _ = self._queue.popleft()
                if not req.future.done():
                    req.future.set_exception(err)

    def _expire(self, owners: dict[int, _Request]) -> None:
        """Fail the requests past their deadline, queued or running."""
        now = time.monotonic()
        with self._cv:
            self._timed = [r for r in self._timed if not r.future.done()]
            late = [r for r in self._timed if r.deadline <= now]  # type: ignore[operator]
        for req in late:
            limit = min(s.params.deadline_s for s in req.seqs if s.params.deadline_s is not None)
            self._fail(req, DeadlineExceededError(f"the request ran past its deadline of {limit:g} s and was aborted"), owners)

    @staticmethod
    def _drop_aborted(queue: deque[tuple[_Request, SequenceState]], aborts: set[str]) -> list[tuple[_Request, SequenceState]]:
        """The queue without aborted requests' samples (their futures fail)."""
        kept = []
        for req, seq in queue:
            if req.request_id in aborts:
                if not req.future.done():
                    req.future.set_exception(RequestAbortedError(f"request {req.request_id} was aborted"))
            else:
                kept.append((req, seq))
        return kept

    def _admit(self, new: list[SequenceState], owners: dict[int, _Request]) -> list[SequenceState]:
        """Prefill ``new``; if that fails, each sample alone, so that only the
        requests whose own prefill fails get the error."""
        try:
            return self._purge(self.loop.admit(new), owners)
        except Exception as exc:  # noqa: BLE001 — one request's failure must stay its own
            return self._isolate(self.loop.admit, new, owners, exc, "admission")

    def _advance(self, running: list[SequenceState], owners: dict[int, _Request]) -> list[SequenceState]:
        """One round for ``running``; if it fails, each sequence alone (see :meth:`_isolate`)."""
        try:
            return self._purge(self.loop.advance(running), owners)
        except Exception as exc:  # noqa: BLE001 — one request's failure must stay its own
            return self._isolate(self.loop.advance, running, owners, exc, "round")

    def _isolate(
        self,
        step: Callable[[list[SequenceState]], list[SequenceState]],
        seqs: list[SequenceState],
        owners: dict[int, _Request],
        exc: Exception,
        what: str,
    ) -> list[SequenceState]:
        """After ``step(seqs)`` failed with ``exc``: every worker forgets
        ``seqs`` (the failed call may have left any of them half-done), then
        each is stepped alone; a worker that no longer knows a sequence asks
        for its whole history, so the survivors continue exactly. Only the
        requests whose own step fails get its error. A lost worker fails
        them all at once (retrying one by one could not succeed)."""
        alone = len(seqs) == 1 or isinstance(exc, WorkerGone)
        log.warning("%s of %d sequences failed (%s: %s)%s", what, len(seqs), type(exc).__name__, exc, "" if alone else "; retrying each alone")
        self._release(seqs)
        for s in seqs:
            s.proposal = None  # a speculation the workers no longer hold: the next round makes a backup
        if alone:
            for s in seqs:
                if s.seq_id in owners:
                    self._fail(owners[s.seq_id], exc, owners)
            return []
        survivors: list[SequenceState] = []
        for s in seqs:
            if s.seq_id not in owners or s.finished:  # its request failed already / it finished before the failure
                continue
            try:
                survivors += step([s])
            except Exception as own:  # noqa: BLE001
                log.warning("sequence %d failed alone: %s: %s", s.seq_id, type(own).__name__, own)
                self._release([s])
                self._fail(owners[s.seq_id], own, owners)
        return self._purge(survivors, owners)

    def _fail(self, req: _Request, exc: BaseException, owners: dict[int, _Request]) -> None:
        """End ``req`` with ``exc``: its queued samples will not run, its running
        ones leave the batch at the next :meth:`_purge`."""
        if not req.future.done():
            req.future.set_exception(exc)
        for s in req.seqs:
            owners.pop(s.seq_id, None)
        with self._cv:
            self._queue = deque((r, q) for r, q in self._queue if r is not req)

    def _purge(self, running: list[SequenceState], owners: dict[int, _Request]) -> list[SequenceState]:
        """``running`` without the samples of ended requests (failed or
        aborted), which are freed on every worker."""
        gone = [s for s in running if s.seq_id not in owners]
        if gone:
            self._release(gone)
        return [s for s in running if s.seq_id in owners]

    def _release(self, seqs: list[SequenceState]) -> None:
        try:
            self.loop.release(seqs)
        except Exception:  # noqa: BLE001 — the sequences are over either way
            log.exception("releasing %d sequences failed", len(seqs))

    def _kv_need(self, seqs: list[SequenceState]) -> int:
        """Worst-case KV tokens of ``seqs``, rounded up to whole blocks."""
        margin = self.loop.speculation_margin
        bs = self.block_size
        return sum(-(-(len(s.prompt_ids) + s.params.max_tokens + margin) // bs) * bs for s in seqs)

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
