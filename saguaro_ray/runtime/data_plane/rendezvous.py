"""Forming one generation of the data-plane group through the closed store.

Group objects, not the global group. A member may also run a tensor-parallel
model that owns ``init_process_group``'s default group, and the data-plane
group must be rebuilt whenever a worker restarts (a dead member breaks a
group for good). So each generation builds its own backend object —
``ProcessGroupGloo`` on the CPU, ``ProcessGroupNCCL`` on CUDA — over a
``PrefixStore("gen{generation}/", store)`` of the coordinator's
:class:`~saguaro_ray.runtime.data_plane.store.DataPlaneStore`. A rebuild is
every member closing its plane and joining the next generation number;
generations are never reused, and a rank claimed twice in one generation is
refused, so a late member of an old generation cannot pair with a new one.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from saguaro_ray.errors import DataPlaneError, JoinTimeout
from saguaro_ray.runtime.data_plane.store import StoreClient

log = logging.getLogger(__name__)

_POLL_S = 0.005  # how often a member looks whether the others have joined


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def join_group(
    address: str,
    key: bytes,
    rank: int,
    world_size: int,
    generation: int,
    dev: torch.device,
    timeout_s: float,
    backend: str | None,
    gloo_host: str | None,
    linger_s: float,
) -> tuple[Any, StoreClient, str]:
    """Join ``generation`` as ``rank`` of ``world_size``; returns the backend
    process group, the store client it was formed over (it must live as long
    as the group) and the backend's name. See
    :meth:`~saguaro_ray.runtime.data_plane.group.DataPlane.join`."""
    if not (0 <= rank < world_size):
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"data-plane backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and (dev.type != "cuda" or not dist.is_nccl_available()):
        raise DataPlaneError(f"the nccl data plane needs a CUDA device and an NCCL build of torch (device {dev})")
    where = f"data plane generation {generation} at {address}"
    deadline = time.monotonic() + timeout_s
    client = StoreClient.connect(address, key, timeout_s, where)
    try:
        store = dist.PrefixStore(f"gen{generation}/", client)
        _claim(store, where, deadline, timeout_s, rank, world_size)
        pg = _backend(store, where, deadline, rank, world_size, dev, backend, gloo_host, linger_s)
    except BaseException:
        client.close()  # its I/O thread; a plane that joined closes it in close()
        raise
    log.info("joined %s as rank %d/%d (%s)", where, rank, world_size, backend)
    return pg, client, backend


def _claim(store: Any, where: str, deadline: float, timeout_s: float, rank: int, world_size: int) -> None:
    """Claim ``rank`` in this generation, then wait until every member has."""
    if store.add(f"rank{rank}", 1) != 1:
        raise DataPlaneError(f"{where}: rank {rank} has already joined; every rebuild needs a new generation number")
    store.add("joined", 1)
    while store.add("joined", 0) < world_size:
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if not store.check([f"rank{r}"])]
            raise JoinTimeout(
                f"{where}: rank {rank} waited {timeout_s:g}s but only {world_size - len(missing)} of "
                f"{world_size} members joined (missing ranks {missing}); check that those workers are alive "
                f"and joined the same generation"
            )
        time.sleep(_POLL_S)


def _backend(
    store: Any,
    where: str,
    deadline: float,
    rank: int,
    world_size: int,
    dev: torch.device,
    backend: str,
    gloo_host: str | None,
    linger_s: float,
) -> Any:
    """The backend object over the generation's store (``gloo_host``: see
    :meth:`~saguaro_ray.runtime.data_plane.group.DataPlane.join`). NCCL's
    timeout is ``linger_s`` (long): its watchdog aborts the communicator
    when an operation outlives it, and a posted receive may wait that long
    for its sender."""
    left = _td(max(1.0, deadline - time.monotonic()))
    try:
        if backend == "gloo":
            if gloo_host is None:
                return dist.ProcessGroupGloo(store, rank, world_size, left)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = left
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)]
            return dist.ProcessGroupGloo(store, rank, world_size, opts)
        torch.cuda.set_device(dev)
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = _td(linger_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, nccl)
    except Exception as e:  # noqa: BLE001 — gloo connect failures are plain RuntimeErrors
        raise JoinTimeout(f"{where}: rank {rank} could not connect to its peers: {e}") from None
