"""One worker's membership in a data-plane group: point-to-point sends and receives.

Control frames (ZeroMQ + msgpack) carry small things; the per-round tensors
— a proposal's q rows at T > 0, a draft's KV delta for its peers — travel
worker-to-worker over point-to-point operations of a :class:`DataPlane`,
and the frames carry descriptors of them (:mod:`.refs`).

Why the machinery below (what gloo really does, torch 2.13, measured — see
tests/test_data_plane.py):

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
with ``is_completed()`` (CUDA events), no threads. Every pair's
communicator already exists when :meth:`DataPlane.join` returns (the
warm-up in :mod:`.rendezvous`), so no send here ever creates one — which
would block, under the lock, until the receiver posted.

Why one transfer nobody receives should not block the later ones on NCCL:
the protocol receives every send, in issue order. Each send is referenced
by exactly one control frame to exactly one receiver; a worker runs its
calls on one thread in arrival order, resolving references in argument
order, which is the order they were offloaded; and a reference the round
loop drops is taken anyway (:meth:`DataPlane.discard`, ``discard_refs``).
What that does not guarantee: calls reaching a worker over two connections
(a discard, a forwarded call) keep their senders' order between them. If
the order ever breaks — a receiver asks for a later tag than the next one
due — the receive is refused with :class:`TransferLost` (the call is re-sent
self-contained: slower, never wrong), counted in ``stats()["out_of_order"]``
and logged once as an error: that pair's later transfers cannot arrive
until the group is rebuilt (tearing the pair down and re-forming it by
itself is not done yet).

One concept, one module, though it is over 400 lines: every method shares
the lock, the posted-operation tables and the memo, and the rules above
hold only as long as all of them are kept together.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from saguaro_ray.runtime.data_plane.dtypes import as_dtype
from saguaro_ray.errors import DataPlaneError, TransferLost
from saguaro_ray.runtime.data_plane.devices import DeviceIdentity, indexed_device
from saguaro_ray.runtime.data_plane.rendezvous import first_line, join_group

log = logging.getLogger(__name__)

DEFAULT_JOIN_TIMEOUT_S = 60.0
DEFAULT_LINGER_S = 7 * 24 * 3600.0  # how long a waiter thread waits for a peer
DEFAULT_MEMO_SIZE = 64  # transfers kept after receipt (and sends kept by their sender) …
DEFAULT_MEMO_BYTES = 512 << 20  # … within this many bytes each (q rows at a real vocab are big)
PENDING_WARN = 1024  # unmatched operations worth a warning (a leak upstream)
_MAX_TAG = (1 << 31) - 1  # gloo tags are 32-bit, non-negative


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
        self._linger = datetime.timedelta(seconds=linger_s)
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
        self.backend_note: str | None = None  # why a CUDA group is not on NCCL (None: nothing fell back)
        self.warmed: tuple[int, ...] = ()  # the peers the formation's warm-up exchanged with
        self._out_of_order: dict[int, int] = {}  # nccl: sender → receives refused for skipping its next tag

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
        identity: DeviceIdentity | None = None,
    ) -> DataPlane:
        """Join generation ``generation`` as ``rank`` of ``world_size`` at the
        :class:`DataPlaneStore` at ``address`` (the engine's ``key``); blocks
        until every member has joined, or raises :class:`JoinTimeout` after
        ``timeout_s`` naming the missing ranks.

        ``device``: ``"cuda"`` means the current CUDA device (made ``cuda:N``).
        ``backend`` defaults to ``"nccl"`` when every member is on a GPU of
        its own, else ``"gloo"`` (:func:`.devices.choose_backend`; the cause
        of a CUDA group's gloo is :attr:`backend_note`). ``"gloo"`` on CUDA
        also works: tensors are staged through host memory, and tags may
        then be received in any order. Every pair has exchanged a warm-up
        message when this returns (:attr:`warmed`). ``identity``: what this
        member publishes about its device (default: the real one). ``gloo_host``:
        the address this member's gloo sockets bind to (the node IP Ray
        reports); by default gloo resolves the machine's hostname, which on
        some hosts maps to a loopback address unusable across nodes.
        Each rebuild must use a new ``generation``: a rank that is already
        taken in a generation is refused. ``memo_size``/``memo_bytes`` bound
        the received transfers kept for retries and the sent ones kept for
        references that come back to their sender (the newest always stays).
        """
        dev = indexed_device(device)
        pg, client, backend, note, warmed = join_group(
            address, key, rank, world_size, generation, dev, timeout_s, backend, gloo_host, linger_s, identity
        )
        plane = cls(pg, client, rank, world_size, generation, dev, backend, memo_size, linger_s, memo_bytes)
        plane.backend_note, plane.warmed = note, tuple(warmed)
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
                "warmed_pairs": len(self.warmed),
                "out_of_order": sum(self._out_of_order.values()),
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
                raise TransferLost.for_transfer(self.rank, tag, f"cannot send to rank {dst}: {first_line(e)}") from None
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
        return self._collect(src, tag, tuple(int(d) for d in shape), as_dtype(dtype), deadline)

    def prefetch(self, src: int, tag: int, shape: Sequence[int], dtype: torch.dtype | str) -> None:
        """Post the receive for a transfer without waiting (so several can be
        in flight at once); :meth:`recv` then collects it. No-op if already
        posted or received."""
        self._check_peer(src)
        shape = tuple(int(d) for d in shape)
        dt = as_dtype(dtype)
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
                    self._out_of_order[src] = self._out_of_order.get(src, 0) + 1
                    if self._out_of_order[src] == 1:
                        log.error(
                            "data plane generation %d: rank %d asked rank %d for transfer %d before %d; NCCL matches in issue "
                            "order, so that pair's later transfers cannot arrive until the group is rebuilt",
                            self.generation, self.rank, src, tag, expected,
                        )
                    raise TransferLost.for_transfer(
                        src, tag, f"NCCL matches transfers in order and tag {expected} from rank {src} comes first; rebuild the group"
                    )
                self._next_from[src] = expected + 1
            buf = torch.empty(shape, dtype=dt, device=self.device if self._nccl else "cpu")
            try:
                work = self._pg.recv([buf], src, tag)
            except Exception as e:  # noqa: BLE001 — the pair is closed: peer dead, group broken
                raise TransferLost.for_transfer(src, tag, f"the peer is gone or the group is broken ({first_line(e)})") from None
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
                raise TransferLost.for_transfer(src, tag, f"data plane generation {self.generation} was closed")
            if time.monotonic() >= deadline:
                raise TransferLost.for_transfer(src, tag, "timed out (the receive stays posted; a retry can still get it)")
        if op.error is not None:
            raise TransferLost.for_transfer(src, tag, f"the peer is gone or the group is broken ({first_line(op.error)})")
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
            raise TransferLost.for_transfer(self.rank, tag, f"this member's own send to rank {dst} is no longer kept (see memo_size/memo_bytes)")
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
