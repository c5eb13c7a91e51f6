"""The Ray-side worker handle: ZeroMQ for the calls, Ray for liveness and restarts.

:class:`RayWorkerHandle` implements the round loop's worker-handle contract
(``submit`` → future of :class:`Timed`, ``recover``, ``close``). Calls go over
the worker's :class:`CommandClient`. While calls are pending, a watchdog asks
Ray about the actor every ``check_interval_s``: if the actor's process is
gone, restarting, or was replaced (a different pid), every pending call fails
at once with :class:`WorkerLost` — no waiting for a call timeout.
:meth:`recover` waits for Ray's restart of the actor (``max_restarts``),
connects to its new endpoint, and raises :class:`WorkerGone` once Ray reports
the actor dead for good — or once the restart exceeds the worker's
:class:`RestartBudget` (Ray restarts workers without limit; the engine
decides), stopping the actor for good first. A handle waits for its worker
through restarts from the start: a worker that dies while the engine
launches costs one restart, not the launch.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import ray

from saguaro_ray.engine.calls import Forwarded
from saguaro_ray.engine.transport import WorkerGone, WorkerLost
from saguaro_ray.runtime.control import CommandClient
from saguaro_ray.runtime.restart_budget import RestartBudget
from saguaro_ray.workers.messages import Timed

log = logging.getLogger(__name__)

RECOVER_TIMEOUT_S = 300.0  # how long a worker may take to come (back) up


def actor_info(actor: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """``actor.info()``, waiting through a restart (Ray answers "unavailable"
    while it restarts an actor); ActorDiedError means it is gone for good."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise ray.exceptions.GetTimeoutError(f"actor unavailable for {timeout_s:.0f} s") from None
            time.sleep(0.2)


def same_processes(actors: Sequence[Any], pids: Sequence[int], timeout_s: float) -> bool:
    """Is every actor still running the process we know (``pids[i]``)?

    Only a definite answer says no: Ray reports an actor dead or restarting
    (unavailable), or it answers from another process. An answer that takes
    longer than ``timeout_s`` says nothing — a worker busy on a loaded
    machine is slow, not dead, and the next check asks again. (Taken for
    dead, a slow draft had its calls failed and was dropped from the engine
    while its process lived on, holding the KV of the sequences whose
    releases no longer reached it; a slow sharded target was killed and
    restarted. The soak test caught it under two test processes.)"""
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return True
    except ray.exceptions.RayActorError:  # died, or unavailable while Ray restarts it
        return False
    return [i["pid"] for i in infos] == list(pids)


class RayWorkerHandle:
    def __init__(
        self,
        name: str,
        actor: Any,
        key: bytes,
        budget: RestartBudget,
        timeout_s: float = 120.0,
        check_interval_s: float = 0.5,
        recover_timeout_s: float = RECOVER_TIMEOUT_S,
        charge_prior_restart: bool = True,
    ) -> None:
        """``charge_prior_restart``: a worker Ray restarted before this handle
        first reached it died while the engine launched, and that costs a
        restart of its budget (not so when the caller restarted it on purpose)."""
        self.name = name
        self.actor = actor
        self._key = key
        self._timeout_s = timeout_s
        self._check_interval_s = check_interval_s
        self._recover_timeout_s = recover_timeout_s
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._closed = threading.Event()
        self.restarts = 0
        self.budget = budget
        # called after a restart, before any call is re-sent (the coordinator rebuilds the data plane)
        self.on_recovered: Callable[["RayWorkerHandle"], None] | None = None
        info = self._first_info()
        self._pid = info["pid"]
        if info.get("restarted") and charge_prior_restart:  # it died before we first reached it (e.g. loading its model)
            self._spend_restart()
        self._client = self._connect(info["endpoint"])
        self._watchdog = threading.Thread(target=self._watch, name=f"saguaro-watch-{name}", daemon=True)
        self._watchdog.start()

    def _first_info(self) -> dict[str, Any]:
        """The worker's info once it is up, waiting through Ray's restarts of it."""
        try:
            return actor_info(self.actor, timeout_s=self._recover_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerGone(f"worker {self.name} did not come up within {self._recover_timeout_s:.0f} s") from None
        except ray.exceptions.ActorDiedError as exc:
            raise WorkerGone(f"worker {self.name} died before it came up ({type(exc).__name__})") from None

    def _spend_restart(self) -> None:
        """Count a restart of the worker; past its budget, stop it for good."""
        self.restarts += 1
        if self.budget.spend():
            return
        log.error("worker %s restarted %d times, more than its budget (%s); stopping it", self.name, self.restarts, self.budget)
        self._stop_for_good()
        raise WorkerGone(f"worker {self.name} was restarted more often than its budget allows ({self.budget}); it is stopped")

    def _stop_for_good(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def _connect(self, endpoint: str) -> CommandClient:
        return CommandClient(self.name, endpoint, self._key, timeout_s=self._timeout_s)

    @property
    def client(self) -> CommandClient:
        return self._client

    # ------------------------------------------------------------ calls
    def submit(self, method: str, *args: Any) -> "Future[Timed]":
        with self._lock:
            inner = self._client.submit(method, *args)
        return self._track(inner)

    def expect(self, method: str) -> tuple[bytes, int, "Future[Timed]"]:
        """A call that arrives by broadcast: (client identity, call id, future)."""
        with self._lock:
            client = self._client
            cid, inner = client.expect(method)
        return client.identity, cid, self._track(inner)

    def forwarded(self, method: str) -> Forwarded:
        """A call another worker places on this one for us (see
        :class:`~saguaro_ray.runtime.control.CallForwarder`): where to send it
        and the future of its answer."""
        with self._lock:
            client = self._client
            cid, inner = client.expect(method)
        return Forwarded(self, client.address_for(cid), self._track(inner), lambda: client.forget(cid))

    def _track(self, inner: "Future[Timed]") -> "Future[Timed]":
        """A future the watchdog can fail at once if the worker dies."""
        outer: Future[Timed] = Future()
        with self._lock:
            self._pending.add(outer)

        def relay(f: Future) -> None:
            with self._lock:
                self._pending.discard(outer)
            if outer.done():
                return
            exc = f.exception()
            if exc is None:
                outer.set_result(f.result())
            else:
                outer.set_exception(exc)

        inner.add_done_callback(relay)  # outside the lock: it may run right here
        return outer

    # --------------------------------------------------------- liveness
    @property
    def pids(self) -> list[int]:
        """The process(es) this handle talks to (a restart it has not yet noticed has others)."""
        return [self._pid]

    def _alive(self) -> bool:
        """Is the very process we talk to still up? (False while Ray restarts it.)"""
        return same_processes([self.actor], [self._pid], max(2.0, 4 * self._check_interval_s))

    def _watch(self) -> None:
        while not self._closed.wait(self._check_interval_s):
            with self._lock:
                pending = list(self._pending)
            if not pending or self._alive():
                continue
            log.warning("worker %s (pid %s) is gone; failing %d pending calls", self.name, self._pid, len(pending))
            err = WorkerLost(f"worker {self.name} was lost (its process died or was restarted)")
            with self._lock:
                for f in pending:
                    self._pending.discard(f)
                    if not f.done():
                        f.set_exception(err)

    def recover(self) -> None:
        deadline = time.monotonic() + self._recover_timeout_s
        while True:
            if time.monotonic() > deadline:
                raise WorkerGone(f"worker {self.name} did not come back within {self._recover_timeout_s:.0f} s")
            try:
                info = actor_info(self.actor, timeout_s=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.ActorDiedError as exc:
                raise WorkerGone(f"worker {self.name} died and cannot be restarted ({type(exc).__name__})") from None
            if info["pid"] != self._pid:
                break
            time.sleep(0.2)  # Ray has not noticed the death yet
        self._reconnect(info)

    def _reconnect(self, info: dict[str, Any]) -> None:
        """Talk to the restarted process described by ``info`` from now on
        (:class:`WorkerGone` if this restart is past the budget)."""
        self._spend_restart()
        with self._lock:
            old, self._client = self._client, self._connect(info["endpoint"])
            self._pid = info["pid"]
        old.close()
        log.warning("worker %s is back (pid %s, restart %d)", self.name, self._pid, self.restarts)
        if self.on_recovered is not None:
            self.on_recovered(self)

    def close(self) -> None:
        self._closed.set()
        self._client.close()
