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

Forming a generation, in order: each member claims its rank and publishes
its :class:`~saguaro_ray.runtime.data_plane.devices.DeviceIdentity`; once
all have joined, every member picks the same backend from the same list
(:func:`~saguaro_ray.runtime.data_plane.devices.choose_backend`: NCCL only
where every rank has a GPU of its own); then every pair exchanges one
warm-up message both ways (:func:`_warm_pairs`). On NCCL that is what
creates each pair's communicator — with both sides posting at once, at
formation — instead of a first real send creating it lazily, blocked until
its receiver happens to post, under the plane's lock.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from saguaro_ray.errors import DataPlaneError, JoinTimeout
from saguaro_ray.runtime.data_plane.devices import DeviceIdentity, choose_backend, identity_of
from saguaro_ray.runtime.data_plane.store import StoreClient

log = logging.getLogger(__name__)

_POLL_S = 0.005  # how often a member looks whether the others have joined
WARM_TAG = 0  # the warm-up exchange's tag; transfers use tags from 1


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
    identity: DeviceIdentity | None = None,
) -> tuple[Any, StoreClient, str, str | None, list[int]]:
    """Join ``generation`` as ``rank`` of ``world_size`` (``dev`` indexed);
    returns the backend process group, the store client it was formed over
    (it must live as long as the group), the backend's name, why it is not
    NCCL on a CUDA group (None when nothing fell back) and the peers the
    warm-up reached. ``identity``: what this member publishes (default: that
    of ``dev``; a test may give two ranks the same GPU). See
    :meth:`~saguaro_ray.runtime.data_plane.group.DataPlane.join`."""
    if not (0 <= rank < world_size):
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"data-plane backend must be 'gloo' or 'nccl', got {backend!r}")
    identity = identity_of(dev) if identity is None else identity
    where = f"data plane generation {generation} at {address}"
    deadline = time.monotonic() + timeout_s
    client = StoreClient.connect(address, key, timeout_s, where)
    pg = None
    try:
        store = dist.PrefixStore(f"gen{generation}/", client)
        _claim(store, where, deadline, timeout_s, rank, world_size, identity)
        identities = [DeviceIdentity.decode(store.get(f"dev{r}")) for r in range(world_size)]
        backend, note = choose_backend(identities, backend)
        if backend == "nccl" and dev.type != "cuda":
            raise DataPlaneError(f"{where}: rank {rank} published a CUDA identity but its device is {dev}")
        pg = _backend(store, where, deadline, rank, world_size, dev, backend, gloo_host, linger_s)
        warmed = _warm_pairs(pg, where, deadline, rank, world_size, dev if backend == "nccl" else torch.device("cpu"))
    except BaseException:
        if pg is not None:  # formed but a pair did not warm up: its peers see this member leave
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 — a broken group may refuse even that
                log.debug("data-plane shutdown after a failed warm-up raised", exc_info=True)
        client.close()  # its I/O thread; a plane that joined closes it in close()
        raise
    if note is not None and rank == 0:  # the engine warns once (PlaneStatus.announcement); a member notes it
        log.info("%s: %s", where, note)
    log.info("joined %s as rank %d/%d (%s)", where, rank, world_size, backend)
    return pg, client, backend, note, warmed


def _claim(store: Any, where: str, deadline: float, timeout_s: float, rank: int, world_size: int, identity: DeviceIdentity) -> None:
    """Claim ``rank`` in this generation and publish its device identity, then
    wait until every member has (so every identity is there once all joined)."""
    if store.add(f"rank{rank}", 1) != 1:
        raise DataPlaneError(f"{where}: rank {rank} has already joined; every rebuild needs a new generation number")
    store.set(f"dev{rank}", identity.encode())
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
        torch.cuda.set_device(dev)  # indexed (devices.indexed_device): "cuda" alone raises
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = _td(linger_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, nccl)
    except Exception as e:  # noqa: BLE001 — gloo connect failures are plain RuntimeErrors
        raise JoinTimeout(f"{where}: rank {rank} could not connect to its peers: {e}") from None


def _warm_pairs(pg: Any, where: str, deadline: float, rank: int, world_size: int, dev: torch.device) -> list[int]:
    """Exchange one message both ways with every peer; the peers reached.

    On NCCL a pair's communicator is created by its first operation and that
    blocks until both sides post, so the pairs are visited in one global
    order — ``(i, j)``, ``i < j``, lexicographically — each member taking
    only its own: the earliest pair not yet done always has both its members
    ready for it, so nothing deadlocks. In a pair the lower rank sends first
    while the higher receives, then the other way round. Tag
    :data:`WARM_TAG` comes before every transfer's tag (NCCL matches in
    issue order: this exchange is each direction's first operation)."""
    warmed: list[int] = []
    for i in range(world_size):
        for j in range(i + 1, world_size):
            if rank not in (i, j):
                continue
            peer = j if rank == i else i
            token = torch.full((1,), float(rank), device=dev)
            got = torch.empty(1, device=dev)
            steps = [("send", token), ("recv", got)] if rank == i else [("recv", got), ("send", token)]
            for op, t in steps:
                try:
                    work = pg.send([t], peer, WARM_TAG) if op == "send" else pg.recv([t], peer, WARM_TAG)
                    _finish(work, dev, deadline)
                except Exception as e:  # noqa: BLE001 — a peer gone or unreachable while forming
                    raise JoinTimeout(f"{where}: rank {rank} could not exchange with rank {peer} while forming: {first_line(e)}") from None
            if int(got.item()) != peer:
                raise DataPlaneError(f"{where}: rank {rank}'s warm-up with rank {peer} received {got.item()!r}")
            warmed.append(peer)
    return warmed


def _finish(work: Any, dev: torch.device, deadline: float) -> None:
    """Wait for one warm-up operation (at most until ``deadline``)."""
    if dev.type != "cuda":  # gloo: wait is its only completion signal; a timeout here fails the join anyway
        work.wait(_td(max(1.0, deadline - time.monotonic())))
        return
    while not work.is_completed():  # NCCL: CUDA events
        if time.monotonic() >= deadline:
            raise TimeoutError("the NCCL warm-up did not complete in time")
        time.sleep(0.001)
    work.wait()
    torch.cuda.current_stream(dev).synchronize()


def first_line(e: BaseException) -> str:
    """The first line of an error's text, bounded (backend errors are long)."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
