"""The data plane: tensors between workers over a torch.distributed group.

Control frames (ZeroMQ + msgpack) carry small things; the per-round tensors —
a proposal's q rows at T > 0, a draft's KV delta for its peers — travel
worker-to-worker over point-to-point sends in a process group, and the
control frames carry only small, wire-safe descriptors of them
(:class:`TensorRef`, :class:`KVDeltaRef`).

Group objects, not the global group. A member may also run a tensor-parallel
model that owns ``init_process_group``'s default group, and the data-plane
group must be rebuilt whenever a worker restarts (a dead member breaks a
group for good). So each :class:`DataPlane` builds its own backend object —
``ProcessGroupGloo`` on the CPU, ``ProcessGroupNCCL`` on CUDA — over a
``PrefixStore("gen{generation}/", store)``, the store hosted by the
coordinator (:class:`DataPlaneStore`). A rebuild is every member closing its
plane and joining the next generation number; generations are never reused.

A closed rendezvous. torch's ``TCPStore`` cannot be the store: its server
listens on every interface whatever host it is given, and it has no
authentication — any peer that reaches the port may list every key
(``list_keys``), read the members' addresses, or write its own. So the store
is a key-value table served over the control plane (:class:`DataPlaneStore`:
a :class:`~saguaro_ray.runtime.control.CommandServer` bound to the node
address, or an IPC socket in a private directory on one node) and each
member reaches it through :class:`StoreClient`, a ``torch.distributed.Store``
whose every operation is an authenticated, replay-protected call with the
engine's key. What that guarantees: a peer without the key can neither read
nor write a rendezvous key, and nothing listens on an interface other than
the one given. What it does not: the gloo (or NCCL) connections the members
then open to each other carry tensors without authentication — torch offers
none — so they are bound to the node address Ray reports (``gloo_host``), and
an attacker on that network who can connect to those ports could still
disturb transfers.

What gloo really does (torch 2.13, measured, see tests/test_data_plane.py):

* p2p matching is by ``(peer, tag)``: a send completes only once the
  receiver posts the matching recv, in any order, so tags received out of
  order are fine and an unmatched send never blocks later ones.
* ``Work.is_completed()`` stays False until someone calls ``wait()``, and
  ``get_future()`` is not implemented for send/recv — completion is only
  observable by blocking in ``wait``. So every pending operation gets a
  daemon waiter thread that blocks in ``wait`` for it.
* A ``wait(timeout)`` that expires closes *every* pair of the process's
  gloo context ("Application timeout caused pair closure"): one timed-out
  wait would break the whole group. So no caller ever waits on a Work with
  a short timeout: callers wait on the waiter's :class:`threading.Event`
  instead, and a caller's timeout leaves the receive posted and parked, so
  a retried call picks it up. Waiter threads wait with ``linger_s`` (long).
* Dropping a posted-but-unfinished recv corrupts its pair (a later message
  for it lands nowhere and the next recv on that pair hangs); dropping an
  unfinished send is harmless. So posted recvs are kept until they finish
  or the plane is closed.
* ``shutdown()``/``abort()``/``del`` do not wake local waiters; they wake
  with an error when the peer closes its side or dies (detected at once: a
  dead peer's sockets close). Closing is therefore cheap and never blocks.

Using it. Any thread may call a plane. A reference is resolved by the
rank it was sent to, or by its sender (from a bounded outbox); each send is
received once, so a reference for another worker needs its own offload. A
send nobody receives stays pending on the sender until the group closes:
receive (or :meth:`DataPlane.discard`) what you reference. ``close()``
abandons unfinished sends — call :meth:`DataPlane.flush` first to let them
be taken. Resolved tensors are fresh copies; tensors from
:meth:`DataPlane.recv` are shared with the memo (read-only).

NCCL (CUDA, untested here: no multi-GPU machine) ignores tags and matches
p2p operations in issue order per pair. So on NCCL tags are consecutive per
(sender, receiver) and a receiver must consume a sender's transfers in
exactly that order; asking for any other tag raises :class:`TransferLost`
instead of silently receiving the wrong tensor. Completion there is polled
with ``is_completed()`` (CUDA events), no threads.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from saguaro_ray.engine.transport import TransferLost as _TransferLostBase
from saguaro_ray.errors import SaguaroError
from saguaro_ray.runtime import wire
from saguaro_ray.runtime.control import CommandClient, CommandServer, ControlError
from saguaro_ray.runtime.wire import DTYPE_NAMES, DTYPES
from saguaro_ray.workers.messages import Extension, Proposal

log = logging.getLogger(__name__)

__all__ = [
    "DataPlane",
    "DataPlaneError",
    "DataPlaneStore",
    "JoinTimeout",
    "KVDeltaRef",
    "TensorRef",
    "TransferLost",
    "discard_refs",
    "offload_kv",
    "offload_q",
    "pack_kv",
    "recv_kv",
    "resolve",
    "resolve_q",
    "send_kv",
    "StoreClient",
    "unpack_kv",
]

DEFAULT_JOIN_TIMEOUT_S = 60.0
DEFAULT_LINGER_S = 7 * 24 * 3600.0  # how long a waiter thread waits for a peer
DEFAULT_MEMO_SIZE = 64  # transfers kept after receipt (and sends kept by their sender) …
DEFAULT_MEMO_BYTES = 512 << 20  # … within this many bytes each (q rows at a real vocab are big)
PENDING_WARN = 1024  # unmatched operations worth a warning (a leak upstream)
_MAX_TAG = (1 << 31) - 1  # gloo tags are 32-bit, non-negative



def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a tensor dtype (what descriptors carry)."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} cannot travel over the data plane; allowed: {', '.join(DTYPES)}")
    return name


def _dtype(name: str) -> torch.dtype:
    dt = DTYPES.get(name)
    if dt is None:
        raise ValueError(f"unknown data-plane dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return dt


# ---------------------------------------------------------------- errors


class DataPlaneError(SaguaroError, RuntimeError):
    """The data plane cannot be built or used as asked (the message says why)."""


class JoinTimeout(DataPlaneError, TimeoutError):
    """Not every member joined a data-plane generation in time."""


class TransferLost(_TransferLostBase):
    """A tensor never arrived: its sender is gone, the group was rebuilt (the
    reference is from an older generation), or it did not come in time.

    A subclass of the round loop's :class:`saguaro_ray.engine.transport.TransferLost`,
    so a call that raises it is retried self-contained. ``src``/``tag`` name
    the transfer. A timed-out receive stays posted: retrying the same
    transfer later still gets it if it arrives.
    """

    def __init__(self, src: int, tag: int, reason: str) -> None:
        self.src, self.tag, self.reason = src, tag, reason
        super().__init__(f"data-plane transfer from rank {src} (tag {tag}) lost: {reason}")

    def __reduce__(self) -> tuple:
        return (TransferLost, (self.src, self.tag, self.reason))


# ---------------------------------------------------------------- rendezvous


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class _Table:
    """The rendezvous key-value table; its methods run on the store's server
    thread one at a time, so they need no lock. Values are bytes; a counter
    (``add``) is kept as its decimal digits, as torch's stores keep it."""

    def __init__(self) -> None:
        self._kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self._kv[key] = bytes(value)

    def get(self, key: str) -> bytes | None:
        return self._kv.get(key)

    def add(self, key: str, amount: int) -> int:
        value = int(self._kv.get(key, b"0")) + int(amount)
        self._kv[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self._kv for k in keys)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self._kv.get(key)
        if (current is None and not expected) or current == expected:
            self._kv[key] = bytes(desired)
            return bytes(desired)
        return expected if current is None else current

    def delete_key(self, key: str) -> bool:
        return self._kv.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._kv)


_TABLE_METHODS = ["set", "get", "add", "check", "compare_set", "delete_key", "num_keys"]


class DataPlaneStore:
    """The rendezvous store, hosted by the coordinator: a key-value table
    behind a :class:`~saguaro_ray.runtime.control.CommandServer` (see "A
    closed rendezvous" in the module doc). ``host``: the node address to
    bind (``tcp://host:*``), or ``None`` for an IPC socket (one node).
    Workers join with its :attr:`address` and the engine's key; every
    generation lives under its own key prefix, so one store serves every
    rebuild. Keeps no tensors — only a few keys per member and generation."""

    def __init__(self, key: bytes, host: str | None) -> None:
        self._server = CommandServer(_Table(), _TABLE_METHODS, key, host=host, name="data-plane-store")
        self.address: str = self._server.endpoint

    @property
    def drop_reasons(self) -> dict[str, int]:
        """Frames the store dropped (unauthenticated, replayed, malformed), by reason."""
        return self._server.drop_reasons

    def close(self) -> None:
        self._server.close()

    def __enter__(self) -> DataPlaneStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` over a :class:`DataPlaneStore`: each
    operation is one authenticated call. Blocking reads (``get``, ``wait``)
    poll ``check`` (the server runs one call at a time and must never block
    in one), giving up after ``timeout_s`` with :class:`JoinTimeout`."""

    POLL_S = 0.005

    def __init__(self, address: str, key: bytes, timeout_s: float) -> None:
        super().__init__()
        self.address = address
        self._timeout_s = timeout_s
        self._client = CommandClient("data-plane-store", address, key, timeout_s=timeout_s)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return self._client.submit(method, *args).result().value
        except ControlError as e:
            raise JoinTimeout(f"the rendezvous store at {self.address} did not answer {method}(): {e}") from None

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise JoinTimeout(f"keys {list(keys)} did not appear in the rendezvous store within {limit:g}s")
            time.sleep(self.POLL_S)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._call("compare_set", key, as_bytes(expected), as_bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def close(self) -> None:
        self._client.close()


# ---------------------------------------------------------------- the plane


class _Op:
    """One posted send or recv: keeps its tensor and Work alive until done."""

    __slots__ = ("discarded", "done", "error", "nccl", "peer", "tag", "tensor", "work")

    def __init__(self, work: Any, tensor: torch.Tensor, peer: int, tag: int, nccl: bool) -> None:
        self.work, self.tensor, self.peer, self.tag, self.nccl = work, tensor, peer, tag, nccl
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.discarded = False  # a recv nobody collects: it settles into the memo by itself

    def poll(self) -> bool:
        """Done yet? (NCCL: polls CUDA events; gloo: the waiter thread's flag.)"""
        if self.nccl and not self.done.is_set() and self.work.is_completed():
            try:
                self.work.wait()  # orders the current stream after the transfer
            except Exception as e:  # noqa: BLE001 — the transfer failed
                self.error = e
            self.done.set()
        return self.done.is_set()

    def wait(self, deadline: float) -> bool:
        """Block until done or ``deadline`` (``time.monotonic``); True if done."""
        if not self.nccl:
            return self.done.wait(max(0.0, deadline - time.monotonic()))
        while not self.poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True


class DataPlane:
    """One worker's membership in one generation of the data-plane group.

    Any thread may call any method (internal state is under a lock; the
    backend's p2p calls are thread-safe). Tensors the plane returns are
    shared with its memo: treat them as read-only.
    """

    def __init__(
        self,
        pg: Any,
        store: Any,
        rank: int,
        world_size: int,
        generation: int,
        device: torch.device,
        backend: str,
        memo_size: int = DEFAULT_MEMO_SIZE,
        linger_s: float = DEFAULT_LINGER_S,
        memo_bytes: int = DEFAULT_MEMO_BYTES,
    ) -> None:
        """Use :meth:`join`; this only wraps an already-built backend."""
        self._pg = pg
        self._store = store  # keeps the client connection alive with the group
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.device, self.backend = device, backend
        self._nccl = backend == "nccl"
        self._memo_size = max(1, memo_size)
        self._memo_bytes = memo_bytes
        self._linger = _td(linger_s)
        self._lock = threading.Lock()
        self._closed = False
        self._tags = itertools.count(1)  # gloo: one counter, unique per sender
        self._tags_to: dict[int, itertools.count] = {}  # nccl: consecutive per receiver
        self._next_from: dict[int, int] = {}  # nccl: the tag each sender must send next
        self._sends: dict[tuple[int, int], _Op] = {}  # (dst, tag) → unfinished send
        self._recvs: dict[tuple[int, int], _Op] = {}  # (src, tag) → posted recv
        self._memo: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()  # (src, tag) → received
        self._outbox: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()  # (dst, tag) → sent
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def join(
        cls,
        address: str,
        key: bytes,
        rank: int,
        world_size: int,
        generation: int,
        device: str | torch.device = "cpu",
        timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        *,
        backend: str | None = None,
        gloo_host: str | None = None,
        memo_size: int = DEFAULT_MEMO_SIZE,
        memo_bytes: int = DEFAULT_MEMO_BYTES,
        linger_s: float = DEFAULT_LINGER_S,
    ) -> DataPlane:
        """Join generation ``generation`` as ``rank`` of ``world_size`` at the
        :class:`DataPlaneStore` at ``address`` (the engine's ``key``); blocks
        until every member has joined, or raises :class:`JoinTimeout` after
        ``timeout_s`` naming the missing ranks.

        ``backend`` defaults to ``"gloo"`` on the CPU and ``"nccl"`` on CUDA
        (``"gloo"`` on CUDA also works: tensors are staged through host
        memory, and tags may then be received in any order). ``gloo_host``:
        the address this member's gloo sockets bind to (the node IP Ray
        reports); by default gloo resolves the machine's hostname, which on
        some hosts maps to a loopback address unusable across nodes.
        Each rebuild must use a new ``generation``: a rank that is already
        taken in a generation is refused. ``memo_size``/``memo_bytes`` bound
        the received transfers kept for retries and the sent ones kept for
        references that come back to their sender (the newest always stays).
        """
        if not (0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        dev = torch.device(device)
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"data-plane backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and (dev.type != "cuda" or not dist.is_nccl_available()):
            raise DataPlaneError(f"the nccl data plane needs a CUDA device and an NCCL build of torch (device {dev})")
        where = f"data plane generation {generation} at {address}"
        deadline = time.monotonic() + timeout_s
        client = StoreClient(address, key, timeout_s)
        try:
            client.num_keys()  # the handshake: a store that never answers (or a wrong key) ends here
        except JoinTimeout as e:
            client.close()
            raise JoinTimeout(f"{where}: cannot reach the rendezvous store within {timeout_s:g}s ({e})") from None
        try:
            return cls._rendezvous(client, where, deadline, timeout_s, rank, world_size, generation, dev, backend, gloo_host, memo_size, memo_bytes, linger_s)
        except BaseException:
            client.close()  # its I/O thread; a plane that joined closes it in close()
            raise

    @classmethod
    def _rendezvous(
        cls,
        client: StoreClient,
        where: str,
        deadline: float,
        timeout_s: float,
        rank: int,
        world_size: int,
        generation: int,
        dev: torch.device,
        backend: str,
        gloo_host: str | None,
        memo_size: int,
        memo_bytes: int,
        linger_s: float,
    ) -> DataPlane:
        """:meth:`join` once the store answers: claim the rank, wait for the others, build the backend."""
        store = dist.PrefixStore(f"gen{generation}/", client)
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
            time.sleep(0.005)
        left = max(1.0, deadline - time.monotonic())
        try:
            if backend == "gloo":
                if gloo_host is None:
                    pg = dist.ProcessGroupGloo(store, rank, world_size, _td(left))
                else:
                    opts = dist.ProcessGroupGloo._Options()
                    opts._timeout = _td(left)
                    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)]
                    pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
            else:
                torch.cuda.set_device(dev)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _td(linger_s)
                pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        except Exception as e:  # noqa: BLE001 — gloo connect failures are plain RuntimeErrors
            raise JoinTimeout(f"{where}: rank {rank} could not connect to its peers: {e}") from None
        plane = cls(pg, client, rank, world_size, generation, dev, backend, memo_size, linger_s, memo_bytes)
        log.info("joined %s as rank %d/%d (%s)", where, rank, world_size, backend)
        return plane

    def close(self) -> None:
        """Leave the group; never blocks. Peers' operations with this member
        fail at once (their sockets close). Unfinished sends are abandoned.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pg, self._pg = self._pg, None
            self._memo.clear()
            self._outbox.clear()
        try:
            pg.shutdown()
        except Exception:
            log.debug("data-plane shutdown raised", exc_info=True)
        del pg
        store, self._store = self._store, None
        store.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every send has been taken by its receiver (e.g. before
        :meth:`close`, which abandons unfinished sends); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                ops = list(self._sends.values())
            if not ops:
                return True
            for op in ops:
                if not op.wait(deadline):
                    return False
            with self._lock:
                self._reap_locked()

    def stats(self) -> dict[str, int]:
        """Counts of unfinished sends, posted recvs and memoised transfers."""
        with self._lock:
            return {
                "pending_sends": len(self._sends),
                "pending_recvs": len(self._recvs),
                "memo": len(self._memo),
                "sent": self._sent,
                "received": self._received,
                "bytes_sent": self._bytes_sent,
                "bytes_received": self._bytes_received,
            }

    # ------------------------------------------------------------ send

    def send(self, tensor: torch.Tensor, dst: int) -> int:
        """Start sending ``tensor`` to ``dst``; never blocks. Returns the tag.
        :class:`TransferLost` if ``dst`` is already known to be gone (then
        send the tensor another way, e.g. inline in the control frame).

        The tensor is kept alive until the receiver has taken it; do not
        modify it afterwards (pass a fresh tensor: the walkers below do). On
        gloo it is sent from host memory (copied there if needed)."""
        self._check_peer(dst)
        t = tensor.detach()
        t = t.to(self.device) if self._nccl else t.to("cpu")
        t = t.contiguous()
        with self._lock:
            self._check_open()
            if self._nccl:
                self._reap_locked()
                tag = next(self._tags_to.setdefault(dst, itertools.count(1)))
            else:
                tag = next(self._tags)
            if tag > _MAX_TAG:
                raise DataPlaneError("data-plane tags exhausted; rebuild the group (join a new generation)")
            try:
                work = self._pg.send([t], dst, tag)
            except Exception as e:  # noqa: BLE001 — the pair is closed: peer dead, group broken
                raise TransferLost(self.rank, tag, f"cannot send to rank {dst}: {_first_line(e)}") from None
            op = _Op(work, t, dst, tag, self._nccl)
            self._sent += 1
            self._bytes_sent += t.numel() * t.element_size()
            self._sends[(dst, tag)] = op
            self._outbox[(dst, tag)] = t
            self._trim(self._outbox)
            if len(self._sends) == PENDING_WARN:
                log.warning("%d data-plane sends were never received; a receiver is not consuming its references", PENDING_WARN)
        if not self._nccl:
            self._start_waiter(op, self._sends, (dst, tag))
        return tag

    def _reap_locked(self) -> None:
        for key in [k for k, op in self._sends.items() if op.poll()]:
            del self._sends[key]
        for key in [k for k, op in self._recvs.items() if op.discarded and op.poll()]:
            self._settle_locked(key, self._recvs[key])

    def _settle_locked(self, key: tuple[int, int], op: _Op) -> None:
        """A discarded recv that finished leaves the posted table for the memo
        (a later call referring to the same transfer is served from there)."""
        if self._recvs.get(key) is op:
            del self._recvs[key]
        if op.error is None:
            self._memo[key] = op.tensor
            self._trim(self._memo)

    def _start_waiter(self, op: _Op, table: dict, key: tuple[int, int]) -> None:
        """A daemon thread blocks in ``wait`` (gloo's only completion signal)."""
        linger = self._linger

        def run() -> None:
            try:
                op.work.wait(linger)
            except Exception as e:  # noqa: BLE001 — peer gone / group broken
                op.error = e
            op.done.set()
            with self._lock:
                if table is self._sends:  # a finished send needs nothing more
                    if table.get(key) is op:
                        del table[key]
                elif op.discarded:
                    self._settle_locked(key, op)

        threading.Thread(target=run, name=f"data-plane-g{self.generation}-{key}", daemon=True).start()

    # ------------------------------------------------------------ recv

    def recv(self, src: int, tag: int, shape: Sequence[int], dtype: torch.dtype | str, timeout_s: float) -> torch.Tensor:
        """Receive transfer ``tag`` from ``src`` (blocking, at most ``timeout_s``).

        Memoised by ``(src, tag)``: asking again for a transfer already
        received returns it without touching the network (a retried call).
        Raises :class:`TransferLost` if the peer is gone or the time runs out
        (the receive then stays posted for a retry)."""
        deadline = time.monotonic() + timeout_s
        self.prefetch(src, tag, shape, dtype)
        return self._collect(src, tag, tuple(int(d) for d in shape), _as_dtype(dtype), deadline)

    def prefetch(self, src: int, tag: int, shape: Sequence[int], dtype: torch.dtype | str) -> None:
        """Post the receive for a transfer without waiting (so several can be
        in flight at once); :meth:`recv` then collects it. No-op if already
        posted or received."""
        self._check_peer(src)
        shape = tuple(int(d) for d in shape)
        dt = _as_dtype(dtype)
        key = (src, tag)
        with self._lock:
            self._check_open()
            have = self._memo.get(key)
            if have is None and key in self._recvs:
                have = self._recvs[key].tensor
            if have is not None:
                if tuple(have.shape) != shape or have.dtype != dt:
                    raise ValueError(
                        f"transfer ({src}, {tag}) was requested as {list(have.shape)} {have.dtype}, now as {list(shape)} {dt}"
                    )
                return
            if self._nccl:
                expected = self._next_from.get(src, 1)
                if tag != expected:
                    raise TransferLost(
                        src, tag, f"NCCL matches transfers in order and tag {expected} from rank {src} comes first; rebuild the group"
                    )
                self._next_from[src] = expected + 1
            buf = torch.empty(shape, dtype=dt, device=self.device if self._nccl else "cpu")
            try:
                work = self._pg.recv([buf], src, tag)
            except Exception as e:  # noqa: BLE001 — the pair is closed: peer dead, group broken
                raise TransferLost(src, tag, f"the peer is gone or the group is broken ({_first_line(e)})") from None
            op = _Op(work, buf, src, tag, self._nccl)
            self._recvs[key] = op
            if len(self._recvs) == PENDING_WARN:
                log.warning("%d data-plane receives are waiting for senders", PENDING_WARN)
        if not self._nccl:
            self._start_waiter(op, self._recvs, key)

    def discard(self, src: int, tag: int, shape: Sequence[int], dtype: torch.dtype | str) -> None:
        """Take a transfer that will never be used, so the sender can release
        it (an unreceived send stays pending on the sender until the group
        closes). Non-blocking; the result lands in the memo."""
        self.prefetch(src, tag, shape, dtype)
        with self._lock:
            op = self._recvs.get((src, tag))
            if op is not None:
                op.discarded = True
                self._reap_locked()  # it may be done already

    def _collect(self, src: int, tag: int, shape: tuple[int, ...], dt: torch.dtype, deadline: float) -> torch.Tensor:
        key = (src, tag)
        with self._lock:
            self._check_open()
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return hit
            op = self._recvs.get(key)
        if op is None:  # evicted between prefetch and now: post again
            self.prefetch(src, tag, shape, dt)
            return self._collect(src, tag, shape, dt, deadline)
        while not op.wait(min(deadline, time.monotonic() + 0.25)):
            if self._closed:  # closing does not wake gloo waits: notice it here
                raise TransferLost(src, tag, f"data plane generation {self.generation} was closed")
            if time.monotonic() >= deadline:
                raise TransferLost(src, tag, "timed out (the receive stays posted; a retry can still get it)")
        if op.error is not None:
            raise TransferLost(src, tag, f"the peer is gone or the group is broken ({_first_line(op.error)})")
        out = op.tensor if self._nccl or self.device.type == "cpu" else op.tensor.to(self.device)
        with self._lock:
            if self._recvs.get(key) is op:
                del self._recvs[key]
            if key not in self._memo:
                self._received += 1
                self._bytes_received += out.numel() * out.element_size()
            self._memo[key] = out
            self._memo.move_to_end(key)
            self._trim(self._memo)
        return out

    def _trim(self, cache: OrderedDict) -> None:
        """Evict least recently used entries beyond the count or byte bound."""
        size = sum(t.numel() * t.element_size() for t in cache.values())
        while len(cache) > 1 and (len(cache) > self._memo_size or size > self._memo_bytes):
            _, t = cache.popitem(last=False)
            size -= t.numel() * t.element_size()

    def _own(self, dst: int, tag: int) -> torch.Tensor:
        """A transfer this member sent (a reference handed back to its sender)."""
        with self._lock:
            t = self._outbox.get((dst, tag))
        if t is None:
            raise TransferLost(self.rank, tag, f"this member's own send to rank {dst} is no longer kept (see memo_size/memo_bytes)")
        return t

    # ------------------------------------------------------------ helpers

    def _check_peer(self, peer: int) -> None:
        if not (0 <= peer < self.world_size) or peer == self.rank:
            raise ValueError(f"peer rank must be another member in [0, {self.world_size}), got {peer} (this is rank {self.rank})")

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError(f"data plane generation {self.generation} (rank {self.rank}) is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"DataPlane(rank={self.rank}/{self.world_size}, generation={self.generation}, {self.backend}, {state})"


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return _dtype(dtype) if isinstance(dtype, str) else dtype


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


# ---------------------------------------------------------------- descriptors

Segment = tuple[int, int, int, int, int, int]  # (src, dst, tag, transfer_rows, start, rows)


@dataclass(frozen=True)
class TensorRef:
    """Rows of a 2-D tensor that travel over the data plane, not in a frame.

    ``segments``: ``(src, dst, tag, transfer_rows, start, rows)`` each — rows
    ``[start, start + rows)`` of transfer ``tag`` sent by rank ``src`` to rank
    ``dst`` (a ``[transfer_rows, width]`` tensor); the referenced tensor is
    the segments' rows in order. Slicing and :meth:`cat` only edit segments
    (the row limit lives in them), so a reference to several proposals'
    rows packed in one transfer stays one transfer. ``generation``: the
    group the tags belong to (tags restart with each generation; a stale
    reference is refused, never mis-resolved).
    """

    segments: tuple[Segment, ...]
    width: int
    dtype: str
    generation: int

    def __post_init__(self) -> None:
        segs = tuple(tuple(s) for s in self.segments)
        for s in segs:
            if len(s) != 6 or any(type(x) is not int for x in s):
                raise ValueError(f"a TensorRef segment is six ints (src, dst, tag, transfer_rows, start, rows), got {s!r}")
            _src, _dst, _tag, total, start, rows = s
            if min(s) < 0 or start + rows > total:
                raise ValueError(f"TensorRef segment {s!r} is out of range")
        if type(self.width) is not int or self.width < 0 or type(self.generation) is not int:
            raise ValueError(f"invalid TensorRef width/generation: {self.width!r}, {self.generation!r}")
        _dtype(self.dtype)
        object.__setattr__(self, "segments", segs)

    def __len__(self) -> int:
        return sum(s[5] for s in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.width)

    def __getitem__(self, index: slice) -> TensorRef:
        """Rows ``index`` (a slice with step 1), as a new reference."""
        if not isinstance(index, slice):
            raise TypeError("a TensorRef can only be sliced by rows (ref[a:b])")
        lo, hi, step = index.indices(len(self))
        if step != 1:
            raise ValueError("TensorRef slices must have step 1")
        out: list[Segment] = []
        pos = 0
        for src, dst, tag, total, start, rows in self.segments:
            a, b = max(lo, pos), min(hi, pos + rows)
            if a < b:
                out.append((src, dst, tag, total, start + a - pos, b - a))
            pos += rows
        return dataclasses.replace(self, segments=tuple(out))

    @staticmethod
    def cat(parts: Sequence[TensorRef]) -> TensorRef:
        """Concatenate references along rows (same width, dtype, generation)."""
        if not parts:
            raise ValueError("TensorRef.cat needs at least one part")
        first = parts[0]
        segs: list[Segment] = []
        for p in parts:
            if not isinstance(p, TensorRef):
                raise TypeError(f"TensorRef.cat takes references only, got {type(p).__name__}")
            if (p.width, p.dtype, p.generation) != (first.width, first.dtype, first.generation):
                raise ValueError("TensorRef.cat parts differ in width, dtype or generation")
            for s in p.segments:
                last = segs[-1] if segs else None
                if last is not None and last[:4] == s[:4] and last[4] + last[5] == s[4]:
                    segs[-1] = (*last[:5], last[5] + s[5])  # adjacent rows of one transfer
                else:
                    segs.append(s)
        return TensorRef(tuple(segs), first.width, first.dtype, first.generation)

    def resolve(self, plane: DataPlane, timeout_s: float) -> torch.Tensor:
        """The referenced rows, as a fresh tensor on ``plane.device``."""
        return _Resolver(plane, timeout_s).tensor(self)


@dataclass(frozen=True)
class KVDeltaRef:
    """A draft's KV delta on the data plane: per-layer (K, V) rows packed as
    one ``shape = (layers, 2, n, Hkv, D)`` tensor sent by ``src`` to several
    peers; ``tags`` holds ``(dst, tag)`` per receiver, so one reference can be
    handed to every peer. ``n == 0`` sends nothing (``tags`` is empty)."""

    src: int
    tags: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    dtype: str
    generation: int

    def __post_init__(self) -> None:
        tags = tuple(tuple(t) for t in self.tags)
        shape = tuple(self.shape)
        if any(len(t) != 2 or any(type(x) is not int or x < 0 for x in t) for t in tags):
            raise ValueError(f"KVDeltaRef tags are (dst, tag) int pairs, got {self.tags!r}")
        if len(shape) != 5 or shape[1] != 2 or any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"KVDeltaRef shape is (layers, 2, n, Hkv, D), got {self.shape!r}")
        if type(self.src) is not int or type(self.generation) is not int:
            raise ValueError("KVDeltaRef src and generation are ints")
        _dtype(self.dtype)
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "shape", shape)

    def tag_for(self, dst: int) -> int:
        for d, tag in self.tags:
            if d == dst:
                return tag
        raise DataPlaneError(f"KV delta from rank {self.src} was not sent to rank {dst} (sent to {[d for d, _ in self.tags]})")


wire.register(TensorRef)
wire.register(KVDeltaRef)


# ---------------------------------------------------------------- resolving


class _Resolver:
    """Fetches the transfers a set of references needs: posts every receive
    first (they run in parallel), then collects, against one deadline; each
    transfer is fetched once per call, whatever the memo evicts meanwhile."""

    def __init__(self, plane: DataPlane, timeout_s: float) -> None:
        self.plane = plane
        self.deadline = time.monotonic() + timeout_s
        self.got: dict[tuple[int, int, int], torch.Tensor] = {}
        self.wanted: list[tuple[int, int, tuple[int, ...], str]] = []

    def _check(self, generation: int, src: int, dst: int, tag: int) -> None:
        p = self.plane
        if generation != p.generation:
            raise TransferLost(src, tag, f"the reference is from data-plane generation {generation}, this member is in {p.generation}")
        if p.rank not in (src, dst):
            raise DataPlaneError(f"transfer (tag {tag}) from rank {src} was sent to rank {dst}, not to this member (rank {p.rank})")

    def prefetch(self, src: int, dst: int, tag: int, shape: tuple[int, ...], dtype: str, generation: int) -> None:
        self._check(generation, src, dst, tag)
        if src != self.plane.rank:
            self.wanted.append((src, tag, shape, dtype))

    def post(self) -> None:
        """Post every wanted receive, in tag order per sender (NCCL needs it)."""
        for src, tag, shape, dtype in sorted(set(self.wanted), key=lambda w: (w[0], w[1])):
            self.plane.prefetch(src, tag, shape, dtype)
        self.wanted.clear()

    def fetch(self, src: int, dst: int, tag: int, shape: tuple[int, ...], dtype: str, generation: int) -> torch.Tensor:
        key = (src, dst, tag)
        t = self.got.get(key)
        if t is None:
            self._check(generation, src, dst, tag)
            p = self.plane
            if src == p.rank:
                t = p._own(dst, tag)
            else:
                p.prefetch(src, tag, shape, dtype)
                t = p._collect(src, tag, shape, _dtype(dtype), self.deadline)
            if tuple(t.shape) != shape:
                raise TransferLost(src, tag, f"holds {list(t.shape)}, the reference says {list(shape)}")
            self.got[key] = t
        return t

    def prefetch_ref(self, ref: TensorRef | KVDeltaRef) -> None:
        if isinstance(ref, TensorRef):
            for src, dst, tag, total, _, rows in ref.segments:
                if rows:
                    self.prefetch(src, dst, tag, (total, ref.width), ref.dtype, ref.generation)
        elif math.prod(ref.shape) and ref.src != self.plane.rank:
            self.prefetch(ref.src, self.plane.rank, ref.tag_for(self.plane.rank), ref.shape, ref.dtype, ref.generation)

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        rows = [
            self.fetch(src, dst, tag, (total, ref.width), ref.dtype, ref.generation)[start : start + n]
            for src, dst, tag, total, start, n in ref.segments
            if n
        ]
        dev = self.plane.device
        if not rows:
            return torch.empty((0, ref.width), dtype=_dtype(ref.dtype), device=dev)
        out = torch.cat(rows) if len(rows) > 1 else rows[0].clone()  # fresh: never alias the memo
        return out.to(dev)

    def kv(self, ref: KVDeltaRef) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if math.prod(ref.shape) == 0:  # nothing was sent
            packed = torch.empty(ref.shape, dtype=_dtype(ref.dtype), device=self.plane.device)
        elif ref.src == self.plane.rank:
            if not ref.tags:
                raise TransferLost(ref.src, -1, "this KV delta was sent to no one, so not even its sender kept it")
            dst, tag = ref.tags[0]
            packed = self.fetch(ref.src, dst, tag, ref.shape, ref.dtype, ref.generation)
        else:
            me = self.plane.rank
            packed = self.fetch(ref.src, me, ref.tag_for(me), ref.shape, ref.dtype, ref.generation)
        return unpack_kv(packed.to(self.plane.device).clone())


# ---------------------------------------------------------------- KV deltas


def pack_kv(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per-layer ``(K, V)``, each ``[n, Hkv, D]``, as one fresh contiguous
    ``[layers, 2, n, Hkv, D]`` tensor (one transfer instead of 2·layers)."""
    if not kv:
        raise ValueError("a KV delta needs at least one layer")
    flat = [t for pair in kv for t in pair]
    if len(flat) != 2 * len(kv) or len({(tuple(t.shape), t.dtype, t.device) for t in flat}) != 1 or flat[0].dim() != 3:
        raise ValueError("every layer's K and V must be [n, Hkv, D] tensors of one shape, dtype and device")
    return torch.stack([torch.stack((k.detach(), v.detach())) for k, v in kv])


def unpack_kv(packed: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`pack_kv` (views into ``packed``)."""
    return [(layer[0], layer[1]) for layer in packed.unbind(0)]


def send_kv(plane: DataPlane, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], dsts: Iterable[int]) -> KVDeltaRef:
    """Send a KV delta to every rank in ``dsts``; returns its descriptor (one
    for all receivers). Never blocks."""
    packed = pack_kv(kv)
    dsts = list(dict.fromkeys(dsts))
    tags = tuple((d, plane.send(packed, d)) for d in dsts) if packed.numel() else ()
    return KVDeltaRef(plane.rank, tags, tuple(packed.shape), dtype_name(packed.dtype), plane.generation)


def recv_kv(plane: DataPlane, ref: KVDeltaRef, timeout_s: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer ``(K, V)`` a :class:`KVDeltaRef` describes, on
    ``plane.device``; :class:`TransferLost` if it does not arrive."""
    return _Resolver(plane, timeout_s).kv(ref)


# ---------------------------------------------------------------- walkers


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild ``value`` with ``leaf`` applied to every Proposal / Extension
    inside lists, tuples, dicts and dataclasses. Copies only what changes:
    the caller's objects are never mutated (a retry passes them again)."""
    if isinstance(value, (Proposal, Extension)):
        return leaf(value)
    t = type(value)
    if t is list or t is tuple:
        new = [_walk(x, leaf) for x in value]
        if all(a is b for a, b in zip(new, value)):
            return value
        return new if t is list else tuple(new)
    if t is dict:
        new_d = {k: _walk(v, leaf) for k, v in value.items()}
        return value if all(new_d[k] is value[k] for k in value) else new_d
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if f.init:
                old = getattr(value, f.name)
                new_v = _walk(old, leaf)
                if new_v is not old:
                    changes[f.name] = new_v
        return dataclasses.replace(value, **changes) if changes else value
    return value


def _collect(value: Any, kind: type) -> list[Any]:
    found: list[Any] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, kind):
            found.append(x)
        return x

    _walk(value, leaf)
    return found


def offload_q(value: Any, plane: DataPlane, dst: int) -> Any:
    """``value`` with every ``Proposal.q`` tensor replaced by a
    :class:`TensorRef`, the rows sent to ``dst``. All q rows of one dtype and
    width go as one packed transfer. ``value`` itself is not modified."""
    props = {id(p): p for p in _collect(value, Proposal) if isinstance(p.q, torch.Tensor)}
    if not props:
        return value
    groups: dict[tuple[str, int], list[Proposal]] = {}
    for p in props.values():
        if p.q.dim() != 2:
            raise ValueError(f"Proposal.q must be [len(tokens), V], got shape {list(p.q.shape)}")
        groups.setdefault((dtype_name(p.q.dtype), int(p.q.shape[1])), []).append(p)
    refs: dict[int, TensorRef] = {}
    for (dt, width), members in groups.items():
        total = sum(int(p.q.shape[0]) for p in members)
        tag = plane.send(torch.cat([p.q.detach() for p in members]), dst) if total else 0
        start = 0
        for p in members:
            n = int(p.q.shape[0])
            segs = ((plane.rank, dst, tag, total, start, n),) if n else ()
            refs[id(p)] = TensorRef(segs, width, dt, plane.generation)
            start += n
    return _walk(value, lambda x: dataclasses.replace(x, q=refs[id(x)]) if id(x) in refs else x)


def offload_kv(value: Any, plane: DataPlane, dsts: Iterable[int]) -> Any:
    """``value`` with every ``Extension.kv`` (per-layer (K, V) list) replaced
    by a :class:`KVDeltaRef` sent to each rank in ``dsts``. With no other
    rank to send to, ``value`` is returned as is (the tensors, if anyone
    needs them, ride the control frame)."""
    dsts = [d for d in dsts if d != plane.rank]
    exts = {id(e): e for e in _collect(value, Extension) if isinstance(e.kv, (list, tuple)) and e.kv}
    if not exts or not dsts:
        return value
    refs = {i: send_kv(plane, e.kv, dsts) for i, e in exts.items()}
    return _walk(value, lambda x: dataclasses.replace(x, kv=refs[id(x)]) if id(x) in refs else x)


def resolve(value: Any, plane: DataPlane, timeout_s: float) -> Any:
    """``value`` with every :class:`TensorRef` in a ``Proposal.q`` and every
    :class:`KVDeltaRef` in an ``Extension.kv`` replaced by the tensors they
    describe (fresh tensors on ``plane.device``). Every receive is posted
    before any is awaited; all must arrive within ``timeout_s`` in total, or
    :class:`TransferLost`. Resolving the same references again (a retried
    call) is served from the memo. ``value`` itself is not modified."""
    refs: list[Any] = []

    def gather(x: Any) -> Any:
        r = x.q if isinstance(x, Proposal) else x.kv
        if isinstance(r, (TensorRef, KVDeltaRef)):
            refs.append(r)
        return x

    _walk(value, gather)
    if not refs:
        return value
    res = _Resolver(plane, timeout_s)
    for r in refs:
        res.prefetch_ref(r)
    res.post()

    def leaf(x: Any) -> Any:
        if isinstance(x, Proposal) and isinstance(x.q, TensorRef):
            return dataclasses.replace(x, q=res.tensor(x.q))
        if isinstance(x, Extension) and isinstance(x.kv, KVDeltaRef):
            return dataclasses.replace(x, kv=res.kv(x.kv))
        return x

    return _walk(value, leaf)


resolve_q = resolve  # the name the worker adapters use for call arguments


def discard_refs(refs: Iterable[TensorRef | KVDeltaRef], plane: DataPlane) -> int:
    """Take, without waiting, every transfer in ``refs`` sent to this member
    that the caller will never resolve (a speculation nobody verifies): an
    unreceived send keeps its tensor and a waiter thread on the sender until
    the group closes. References of another generation are skipped (their
    group is gone, and its sends with it). Returns how many transfers."""
    wanted: dict[tuple[int, int], tuple[tuple[int, ...], str]] = {}  # (src, tag) → (shape, dtype)
    for ref in refs:
        if ref.generation != plane.generation:
            continue
        if isinstance(ref, TensorRef):
            for src, dst, tag, total, _, _ in ref.segments:
                if dst == plane.rank:
                    wanted[(src, tag)] = ((total, ref.width), ref.dtype)
        else:
            wanted.update({(ref.src, tag): (ref.shape, ref.dtype) for dst, tag in ref.tags if dst == plane.rank})
    for (src, tag), (shape, dtype) in wanted.items():
        plane.discard(src, tag, shape, dtype)
    return len(wanted)
