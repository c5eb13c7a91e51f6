"""A sharded target's rank actors as one worker: liveness, restart and rendezvous.

With ``target_tp = T`` the target is T actors (see
:mod:`saguaro_ray.runtime.tp_actors`): rank 0 is an ordinary target
``WorkerActor`` — the only one the coordinator talks to, over the same
ZeroMQ protocol — and ranks 1..T-1 follow it over a torch.distributed group.
:class:`TargetGroup` is the picklable record of those actors and their
placement group, held by the engine handle and the coordinator alike.

Failure model: the ranks' collectives tie them together, so losing any rank
loses the group. :class:`TargetGroupHandle` watches every rank (not just
rank 0) while calls are pending; on a loss it fails the pending calls with
:class:`WorkerLost`, and :meth:`TargetGroupHandle.recover` has Ray restart
every rank still running the old process, waits for all T fresh processes,
re-forms the group through a fresh store, and only then reconnects to rank 0's new
endpoint; the round loop re-prefills running sequences as for a single
target. Each loss costs the group one restart of its budget (Ray restarts
the ranks without limit; past the budget the whole group is stopped).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from saguaro_ray.engine.transport import WorkerGone
from saguaro_ray.runtime.ray_transport import RayWorkerHandle, actor_info, same_processes

log = logging.getLogger(__name__)

# an actor reported dead this long in a row is dead for good (a call caught
# in flight when Ray kills a restartable actor reports it dead once, too)
_DEAD_FOR_GOOD_S = 5.0


class TargetGroup:
    """The T rank actors of a sharded target (rank 0 first) and their placement group."""

    def __init__(self, actors: list[Any], pg: Any) -> None:
        self.actors = actors
        self.pg = pg

    @property
    def size(self) -> int:
        return len(self.actors)

    def join(self, timeout_s: float = 300.0) -> None:
        """Form the process group: rank 0 hosts a fresh store, every rank joins through it."""
        address = ray.get(self.actors[0].rendezvous.remote(), timeout=timeout_s)
        ray.get([a.join.remote(address, timeout_s) for a in self.actors], timeout=timeout_s)
        log.info("target group of %d ranks formed through the store at %s", self.size, address)

    def infos(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        return [actor_info(a, timeout_s) for a in self.actors]

    def info(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Rank 0's info (the worker the coordinator sees) plus every rank's."""
        infos = self.infos(timeout_s)
        return {**infos[0], "ranks": infos}

    def restart(self, old_pids: list[int], deadline: float, name: str = "target") -> list[int]:
        """Bring every rank up in a fresh process and re-form the group
        (see :func:`restart_actors`)."""
        pids = restart_actors(self.actors, old_pids, deadline, name)
        self.join(timeout_s=max(10.0, deadline - time.monotonic()))
        return pids

    def kill(self) -> None:
        stop(self.actors, self.pg)
        self.pg = None


def restart_actors(actors: list[Any], old_pids: list[int], deadline: float, name: str) -> list[int]:
    """Bring every actor up in a fresh process; returns the new pids.

    Actors still running their old process are killed so Ray restarts them;
    actors already restarted are kept. Raises :class:`WorkerGone` when one
    is dead for good or does not come back by ``deadline``.
    """
    pending = dict(enumerate(old_pids))
    killed: set[int] = set()
    dead_since: dict[int, float] = {}
    new: dict[int, int] = {}
    while pending:
        if time.monotonic() > deadline:
            raise WorkerGone(f"worker {name} (ranks {sorted(pending)}) did not come back in time")
        for rank, old in list(pending.items()):
            try:
                pid = ray.get(actors[rank].info.remote(), timeout=2.0)["pid"]
            except ray.exceptions.ActorDiedError as exc:
                since = dead_since.setdefault(rank, time.monotonic())
                if time.monotonic() - since > _DEAD_FOR_GOOD_S:
                    raise WorkerGone(f"worker {name} rank {rank} died and cannot be restarted ({type(exc).__name__})") from None
                continue
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                continue  # restarting
            dead_since.pop(rank, None)
            if pid != old:
                new[rank] = pid
                del pending[rank]
            elif rank not in killed:
                ray.kill(actors[rank], no_restart=False)
                killed.add(rank)
        if pending:
            time.sleep(0.2)
    return [new[r] for r in range(len(actors))]


class TargetGroupHandle(RayWorkerHandle):
    """The round loop's handle on a sharded target: rank 0's endpoint, every rank's liveness."""

    def __init__(self, name: str, group: TargetGroup, key: bytes, **kwargs: Any) -> None:
        self.group = group
        self._pids = [i["pid"] for i in group.infos()]
        super().__init__(name, group.actors[0], key, **kwargs)

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    def _alive(self) -> bool:
        return same_processes(self.group.actors, self._pids, max(2.0, 4 * self._check_interval_s))

    def recover(self) -> None:
        deadline = time.monotonic() + self._recover_timeout_s
        self._pids = self.group.restart(self._pids, deadline, self.name)
        self._reconnect(actor_info(self.group.actors[0]))

    def _stop_for_good(self) -> None:
        self.group.kill()


# ------------------------------------------------ one worker, sharded or not


def connect_worker(role: str, worker: Any, key: bytes, **kwargs: Any) -> RayWorkerHandle:
    """The coordinator's handle on a worker: a single actor or a target group."""
    if isinstance(worker, TargetGroup):
        return TargetGroupHandle(role, worker, key, **kwargs)
    return RayWorkerHandle(role, worker, key, **kwargs)


def restart_worker(role: str, worker: Any, timeout_s: float) -> None:
    """Have Ray restart ``worker`` (every rank of a sharded target) in a fresh,
    empty process, and wait until it is up."""
    deadline = time.monotonic() + timeout_s
    if isinstance(worker, TargetGroup):
        worker.restart([i["pid"] for i in worker.infos()], deadline, role)
    else:
        restart_actors([worker], [actor_info(worker)["pid"]], deadline, role)


def worker_info(worker: Any) -> dict[str, Any]:
    return worker.info() if isinstance(worker, TargetGroup) else actor_info(worker)


def stop(workers: list[Any], pg: Any = None) -> None:
    """Kill every worker (a rank group as a whole) for good, then free ``pg``;
    what is already gone is skipped (shutdown must not fail half-way)."""
    for w in workers:
        try:
            kill_worker(w)
        except Exception:
            log.debug("kill failed", exc_info=True)
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:
            log.debug("placement group removal failed", exc_info=True)


def kill_worker(worker: Any) -> None:
    if isinstance(worker, TargetGroup):
        worker.kill()
    else:
        ray.kill(worker, no_restart=True)
