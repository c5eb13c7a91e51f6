"""The rank actors of a tensor-parallel target and how they are placed.

Rank 0 (:class:`TargetLeaderActor`) is the ordinary target ``WorkerActor``
whose runner is wrapped in a :class:`~saguaro_ray.workers.tp_runner.TPRunnerProxy`;
ranks 1..T-1 (:class:`TargetFollowerActor`) run
:func:`~saguaro_ray.workers.tp_runner.follow` in a thread. Each loads only its
slice of the checkpoint in its constructor — no communication needed — and
joins the group later (:meth:`join`), so a restarted rank simply reloads and
waits to be re-joined under a fresh address. The T actors live in one
placement group of their own (``target_placement_strategy``, STRICT_PACK by
default), one device or CPU bundle each.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
import torch

from saguaro_ray.models.spec import ModelRef
from saguaro_ray.runtime.actors import WorkerActor, make_runner
from saguaro_ray.runtime.data_plane import DataPlaneStore, StoreClient
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.runtime.placement import actor_options, reserve
from saguaro_ray.runtime.process_memory import memory
from saguaro_ray.runtime.restart_budget import RAY_MAX_RESTARTS
from saguaro_ray.runtime.target_group import TargetGroup
from saguaro_ray.runtime.threads import own_threads
from saguaro_ray.workers.checkpoint import open_checkpoint
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.tensor_parallel import ShardPlan, TPContext
from saguaro_ray.workers.tp_runner import TPRunnerProxy, follow

log = logging.getLogger(__name__)


def rank_runner(model: str, config: EngineConfig, rank: int) -> tuple[ModelRunner, TPContext]:
    """Rank ``rank``'s runner over its slice of ``model``, and its (unjoined) group context."""
    ckpt = open_checkpoint(model)
    tp = TPContext(ShardPlan.for_rank(ckpt.config, rank, config.target_tp))
    return make_runner(ckpt, config, tp), tp


def join_group(tp: TPContext, address: str, key: bytes, device: torch.device, timeout_s: float) -> None:
    """Join ``tp``'s group through the rank-0 store at ``address``.

    The store is the data plane's closed rendezvous (a
    :class:`~saguaro_ray.runtime.data_plane.store.DataPlaneStore`): every
    operation is a call authenticated with the engine's ``key``, where the
    ``tcp://`` TCPStore it replaces listened on every interface and let any
    peer list, read and write the ranks' addresses. A client without the key
    fails here with :class:`~saguaro_ray.errors.JoinTimeout`."""
    client = StoreClient.connect(address, key, timeout_s, f"tensor-parallel rank {tp.rank} at {address}")
    try:
        tp.connect(client, device)  # the process group keeps the client, its store, alive
    except BaseException:
        client.close()
        raise


class TargetLeaderActor(WorkerActor):
    """Rank 0: the target worker the coordinator sees, driving the followers,
    and the host of their group's store."""

    def __init__(self, role: str, model: ModelRef, config: EngineConfig, key: bytes, tcp_host: str | None) -> None:
        self._key = key
        self._store: DataPlaneStore | None = None
        super().__init__(role, model, config, key, tcp_host)

    def _make_runner(self, model: ModelRef, config: EngineConfig) -> TPRunnerProxy:
        runner, self.tp = rank_runner(model.path, config, 0)  # a target: never quantised
        return TPRunnerProxy(runner, self.tp)

    def rendezvous(self) -> str:
        """The address of a fresh store for the group (a formation never sees
        an earlier one's keys), bound where this worker's server is: the node
        address, or an IPC socket when the engine runs on one node."""
        if self._store is not None:
            self._store.close()
        host = ray.util.get_node_ip_address() if self.server.endpoint.startswith("tcp://") else None
        self._store = DataPlaneStore(self._key, host)
        return self._store.address

    def join(self, address: str, timeout_s: float) -> None:
        join_group(self.tp, address, self._key, self.logic.runner.device, timeout_s)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "tp_rank": 0, "tp_size": self.tp.world}

    def shutdown(self) -> None:
        super().shutdown()
        if self._store is not None:
            self._store.close()


class TargetFollowerActor:
    """Rank r > 0: loads its slice, then replays rank 0's runner calls."""

    def __init__(self, model: str, config: EngineConfig, rank: int, key: bytes) -> None:
        logging.basicConfig(level=logging.INFO)
        config.start_worker_process()
        self.runner, self.tp = rank_runner(model, config, rank)
        self._key = key
        self._thread: threading.Thread | None = None

    def join(self, address: str, timeout_s: float) -> None:
        join_group(self.tp, address, self._key, self.runner.device, timeout_s)
        self._thread = threading.Thread(target=self._follow, name=f"saguaro-tp-rank{self.tp.rank}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            follow(self.runner, self.tp)
        except BaseException:
            # out of step with rank 0: the group is unusable, let Ray restart this rank
            log.exception("tensor-parallel rank %d failed; exiting", self.tp.rank)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        return {
            "role": f"target.rank{self.tp.rank}",
            **memory(),  # pid and memory: the soak samples every rank, not only rank 0
            "python_threads": len(own_threads()),
            "node": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "tp_rank": self.tp.rank,
            "tp_size": self.tp.world,
            "following": self._thread is not None and self._thread.is_alive(),
        }


def reserve_target_group(config: EngineConfig, timeout_s: float) -> Any:
    """The target ranks' placement group, ready (or a ConfigError saying what to change)."""
    bundles = [config.bundle("target") for _ in range(config.target_tp)]
    return reserve(
        bundles,
        config.target_placement_strategy,
        f"{config.name}-target-pg" if config.name else "",
        timeout_s,
        f"{config.target_tp} target ranks {bundles[0]} with {config.target_placement_strategy}",
        "lower target_tp or worker_cpus/gpus_per_worker, add devices to one node, or set target_placement_strategy='PACK'",
    )


def launch_target_group(
    config: EngineConfig, model: ModelRef, key: bytes, tcp_host: str | None, lifetime: str | None, pg: Any
) -> TargetGroup:
    """Start the T rank actors in ``pg`` and form their group."""
    actors = []
    for rank in range(config.target_tp):
        opts = {**actor_options(config, pg, rank, "target", lifetime), "max_restarts": RAY_MAX_RESTARTS}
        if rank == 0:
            actors.append(ray.remote(TargetLeaderActor).options(**opts).remote("target", model, config, key, tcp_host))
        else:
            actors.append(ray.remote(TargetFollowerActor).options(**opts).remote(model.path, config, rank, key))
    group = TargetGroup(actors, pg)
    try:
        group.join(timeout_s=config.call_timeout_s + 300.0)
    except Exception:
        group.kill()
        raise
    return group
