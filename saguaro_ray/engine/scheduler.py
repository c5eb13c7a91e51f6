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
from saguaro_ray.errors import OutOfKVBlocksError

log = logging.getLogger(__name__)

TokenListener = Callable[[SequenceState, list[int]], None]


@dataclass
class _Request:
    seqs: list[SequenceState]
    future: "Future[list[SequenceState]]"
    listener: TokenListener | None
    sent: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens already streamed


class Scheduler:
    """``kv_tokens``: the smallest KV capacity (tokens) among the workers; a
    request is admitted only when the worst-case KV of everything running plus
    it fits, and one that could never fit is refused at once."""

    def __init__(self, loop: RoundLoop, max_batch_size: int = 64, kv_tokens: int | None = None, block_size: int = 16, name: str = "saguaro-scheduler") -> None:
        self.loop = loop
        self.max_batch_size = max_batch_size
        self.kv_tokens = kv_tokens
        self.block_size = block_size
        self._queue: deque[tuple[_Request, SequenceState]] = deque()  # samples wait individually
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ clients
    def submit(self, seqs: list[SequenceState], listener: TokenListener | None = None) -> "Future[list[SequenceState]]":
        """Queue one request (its samples); the future resolves when all finish."""
        fut: Future[list[SequenceState]] = Future()
        need = max(self._kv_need([s]) for s in seqs)
        if self.kv_tokens is not None and need > self.kv_tokens:
            fut.set_exception(
                OutOfKVBlocksError(
                    f"one sample needs up to {need} KV tokens (prompt + max_tokens + speculation) but the "
                    f"engine holds {self.kv_tokens}; lower max_tokens or raise max_kv_tokens"
                )
            )
            return fut
        req = _Request(seqs, fut, listener, {s.seq_id: 0 for s in seqs})
        with self._cv:
            if self._stop:
                raise RuntimeError("scheduler is shut down")
            self._queue.extend((req, s) for s in seqs)
            self._cv.notify()
        return fut

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
                with self._cv:  # their samples still waiting will not run
                    self._queue = deque((r, q) for r, q in self._queue if id(r) not in touched)
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
                req, _ = self._queue.popleft()
                if not req.future.done():
                    req.future.set_exception(err)

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
