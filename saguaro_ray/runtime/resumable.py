"""A request outliving its coordinator: the caller's side (:class:`EngineHandle`).

Ray restarts a lost coordinator (``max_restarts``), but the requests it ran
are gone with it. Their callers still have what each sample emitted — an
:class:`~saguaro_ray.engine.resume.Emitted` the handle keeps from the chunks
of a stream and the progress reports of a non-streamed request — so once the
coordinator answers again each is resubmitted with it, under a fresh request
id, and continues (:mod:`saguaro_ray.engine.resume` says why that is exact).
A request whose deadline (``deadline_s``), or :data:`RESUME_TIMEOUT_S`
after the loss, passes before the coordinator is back — or whose coordinator
is dead for good — fails as it did before: :class:`WorkerGone` naming the
coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import ray

from saguaro_ray.config import SamplingParams
from saguaro_ray.engine.frontend import Progress
from saguaro_ray.engine.resume import Emitted

log = logging.getLogger(__name__)

RESUME_TIMEOUT_S = 120.0  # how long a request waits for its lost coordinator to come back
_PROBE_S = 5.0  # one readiness probe of a restarting coordinator
_PAUSE_S = 0.5  # between probes that failed at once


def coordinator_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the coordinator itself was lost (not a request's own error)."""
    return isinstance(exc, ray.exceptions.RayActorError)


class Resumption:
    """One request's way across coordinator losses: its deadline, the wait
    for the coordinator, its parameters for a resubmission."""

    def __init__(self, coordinator: Any, params: SamplingParams | Sequence[SamplingParams]) -> None:
        self.coordinator = coordinator
        self.params = params
        self.start = time.monotonic()
        limits = [p.deadline_s for p in self._param_list() if p.deadline_s is not None]
        self.deadline = self.start + min(limits) if limits else None
        self.resumes = 0

    def _param_list(self) -> list[SamplingParams]:
        return [self.params] if isinstance(self.params, SamplingParams) else list(self.params)

    def _wait_until(self) -> float:
        until = time.monotonic() + RESUME_TIMEOUT_S
        return until if self.deadline is None else min(until, self.deadline)

    def current_params(self) -> SamplingParams | list[SamplingParams]:
        """The parameters to (re)submit with: a deadline counts from the first submission."""
        if self.deadline is None or not self.resumes:
            return self.params
        left = max(1e-3, self.deadline - time.monotonic())
        fresh = [p if p.deadline_s is None else replace(p, deadline_s=min(p.deadline_s, left)) for p in self._param_list()]
        return fresh[0] if isinstance(self.params, SamplingParams) else fresh

    def back(self) -> bool:
        """Block until the coordinator answers again (True), or the wait is
        over or it is dead for good (False)."""
        until = self._wait_until()
        while (left := until - time.monotonic()) > 0:
            try:
                ray.get(self.coordinator.ready.remote(), timeout=min(_PROBE_S, left))
                return self._resumed()
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:  # restarting, or its restart failed (e.g. killed for memory): Ray may try again
                if dead_for_good(self.coordinator):
                    return False
                time.sleep(min(_PAUSE_S, max(0.0, until - time.monotonic())))
        return False

    async def aback(self) -> bool:
        """:meth:`back` without holding a thread."""
        until = self._wait_until()
        while (left := until - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self.coordinator.ready.remote(), min(_PROBE_S, left))
                return self._resumed()
            except asyncio.TimeoutError:
                continue
            except ray.exceptions.RayError:
                if dead_for_good(self.coordinator):
                    return False
                await asyncio.sleep(min(_PAUSE_S, max(0.0, until - time.monotonic())))
        return False

    def _resumed(self) -> bool:
        self.resumes += 1
        log.warning("the engine's coordinator is back: resuming a request from what it emitted (resume %d)", self.resumes)
        return True


def dead_for_good(actor: Any) -> bool:
    """Whether Ray reports ``actor`` dead with no restart to come."""
    try:
        info = ray._private.state.state.actor_table(actor._actor_id.hex())  # the GCS's view, no dashboard needed
    except Exception:  # noqa: BLE001 — unknown: keep waiting until the deadline
        return False
    return isinstance(info, dict) and info.get("State") == "DEAD"


class SampleLog:
    """What each sample of a non-streamed request has emitted (from the
    coordinator's progress reports): its resubmission's ``resume``."""

    def __init__(self) -> None:
        self.samples: dict[int, Emitted] = {}

    def add(self, progress: Progress) -> None:
        for index, tokens, logprobs in progress:
            self.samples.setdefault(index, Emitted()).add(tokens, logprobs=logprobs)

    def resume(self, count: int) -> list[Emitted | None] | None:
        """One entry per sample (None: nothing emitted), or None when no sample emitted anything."""
        if not self.samples:
            return None
        return [self.samples.get(i) for i in range(count)]
