"""Coordinator side of the command channel: :class:`CommandClient`.

A DEALER connects to a worker's ROUTER (:mod:`.server`); calls are
pipelined (a DEALER does not wait for a reply before the next request) and
replies are matched to futures by id. The client's calls are addressed to
the server's id, which it learns in a handshake (``__hello__``) sent before
any call, and numbered by the client; replies are addressed to the client's
routing id and numbered by the server.

Threads: ZeroMQ sockets are not thread-safe; a socket may only move between
threads across a full memory barrier. The I/O thread owns the reading
connection and reads every reply from it. ``submit`` may be called from any
thread: it encodes on the caller's thread and sends on a second connection of
its own, under a lock (the lock is the barrier), naming the reading
connection as the one to answer. Until a first reply has come back (so the
server surely knows the reading connection), calls are relayed instead
through an ``inproc://`` PAIR socket to the I/O thread, which polls that PAIR
and its connection together and sends them itself; the switch happens once
none of those is pending, so calls still reach the server in submission order.

Why two connections: relaying every call through the I/O thread costs a
thread hop (a wake-up and a GIL hand-over) per call — measured (issue 18,
interleaved, ipc and tcp) at 20–55 µs of a 130–200 µs call round trip, the
direct send faster in 56–59 of 60 blocks; the runs are in docs/performance.md
("The control plane, measured").

The module is a little over 400 lines because it is one thread's state: the
handshake, both send paths, expiry and reply matching all read and write the
same pending table under the same two locks, and splitting them would spread
that invariant over files. Mapping spans onto this clock is :mod:`.clock`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable

import zmq

from saguaro_ray.errors import ClientClosed, ControlError, RemoteError, WorkerTimeout, local_error
from saguaro_ray.runtime.control.clock import ClockMap
from saguaro_ray.runtime.control.endpoints import _connect
from saguaro_ray.runtime.control.sockets import _HELLO_CALL, _PING, _STATS, DEFAULT_MAX_FRAME_BYTES, SocketOwner, _Drops, _poll_ms, _sock
from saguaro_ray.runtime.replay import ReplayGuard, Sender
from saguaro_ray.runtime.wire import MALFORMED, MISADDRESSED, BadFrame, FrameCodec, Stamp, pack_payload, unpack_payload
from saguaro_ray.workers.messages import Timed

log = logging.getLogger(__name__)
_HELLO_RETRY_MS = 10  # how often an unsent hello is retried while no peer takes it


@dataclass
class _Pending:
    future: Future
    method: str
    deadline: float  # time.monotonic()
    timeout_s: float
    t_send: float  # time.perf_counter()
    relayed: bool = False  # sent through the I/O thread (before the direct path was known to work)


class CommandClient(SocketOwner):
    """Coordinator side: calls a :class:`CommandServer` (a worker handle).

    ``submit(method, *args)`` returns a ``Future[Timed]`` — the contract of
    ``InProcessWorker.submit``: the result is ``Timed(value, start, end)``, a
    remote exception raises :class:`RemoteError`, no answer within
    ``timeout_s`` raises :class:`WorkerTimeout` (the worker may still run the
    call; later replies to it are discarded), ``close()`` fails what is still
    pending with :class:`ClientClosed`. Encoding happens in ``submit``, so an
    argument that cannot be sent raises :class:`EncodeError` right there.

    Spans are reported on *this* process's ``perf_counter`` clock: with
    ``clock_sync`` (default: on for ``tcp://``, off for ``ipc://`` where both
    ends share the monotonic clock) worker spans are shifted by an offset
    estimated from the round trips (see ``ClockMap``; error ≤ half the best
    round-trip overhead). Future callbacks run on the client's I/O thread:
    keep them short.

    A remote exception of one of the project's types (say
    ``NeedsPrefillError``) is raised as that type, with the
    :class:`RemoteError` as ``__cause__`` (:func:`saguaro_ray.errors.local_error`),
    so a round loop catches what it catches in process. Unlike ``InProcessWorker``, an unknown method is reported through the
    future (``RemoteError`` of type ``"MethodNotAllowed"``), not at submit.

    Before any call the I/O thread shakes hands (``__hello__``): the reply
    names the server (:attr:`server_id`), and from then on calls are
    addressed to it and replies accepted only from it. Calls submitted before
    the answer wait in the I/O thread and leave, in order, when it comes.
    """

    def __init__(
        self,
        name: str,
        endpoint: str,
        key: bytes,
        *,
        timeout_s: float = 120.0,
        poll_interval_s: float = 0.05,
        clock_sync: bool | None = None,
        max_frame_bytes: int | None = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.name = name
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self._codec = FrameCodec(key)
        self._sender = Sender()
        self.server_id: bytes | None = None  # set by the I/O thread when the handshake is answered
        self._held: deque[tuple[int, bytes]] = deque()  # I/O thread only: calls waiting for the handshake
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._clock = ClockMap() if (clock_sync if clock_sync is not None else not endpoint.startswith("ipc://")) else None
        self._drops = _Drops(f"command client {name!r}")
        self._late = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _pending and _closed
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self._stop = threading.Event()

        ctx = zmq.Context.instance()
        addr = f"inproc://saguaro-client-{uuid.uuid4().hex}"
        self._inbox = ctx.socket(zmq.PAIR)  # I/O thread's end
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(addr)
        self._outbox = ctx.socket(zmq.PAIR)  # submitters' end, under _send_lock
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(addr)
        self._send_lock = threading.Lock()
        # Two connections to the server (see the module doc): the I/O thread
        # reads every reply from ``_dealer``; submitters send on ``_tx``
        # (under _send_lock) once a reply has arrived on ``_dealer``.
        uid = uuid.uuid4().hex
        self._rx_id = f"rx-{uid}".encode()
        self._guard = ReplayGuard(self._rx_id, open_door=False)  # the server is introduced by the handshake
        self._hello_id = next(self._ids)
        self._dealer = _sock(zmq.DEALER, max_frame_bytes)
        # the reply socket's routing id: a broadcast call names it as the one to answer
        self.identity = self._rx_id
        self._dealer.setsockopt(zmq.ROUTING_ID, self._rx_id)
        _connect(self._dealer, key, endpoint)
        self._tx = _sock(zmq.DEALER, max_frame_bytes)
        self._tx.setsockopt(zmq.ROUTING_ID, f"tx-{uid}".encode())
        _connect(self._tx, key, endpoint)
        self._direct = False  # sticky once chosen (under _send_lock)
        self._direct_ready = False  # set by the I/O thread when a reply arrived on _dealer
        self._relayed = 0  # relayed calls not yet answered (incremented under _send_lock)
        self._thread = threading.Thread(target=self._run, name=f"saguaro-client-{name}", daemon=True)
        self._thread.start()

    @property
    def late_replies(self) -> int:
        """Replies that arrived after their call had timed out."""
        return self._late

    def submit(self, method: str, *args: Any) -> "Future[Timed]":
        return self.submit_with(method, args)

    def submit_with(self, method: str, args: Iterable[Any] = (), *, timeout_s: float | None = None) -> "Future[Timed]":
        """``submit`` with an explicit per-call timeout."""
        if not isinstance(method, str):
            raise TypeError(f"method must be a string, got {method!r}")
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        cid = next(self._ids)
        payload = pack_payload({"id": cid, "method": method, "args": list(args), "reply_to": self._rx_id})
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # like an executor's running task: not cancellable
        pending = _Pending(fut, method, time.monotonic() + timeout, timeout, time.perf_counter())
        with self._lock:
            if self._closed:
                raise ClientClosed(f"command client {self.name!r} is closed")
            self._pending[cid] = pending
        full = False
        # seal (hash) outside the send lock once the server is known; if the call is
        # relayed after all, the I/O thread seals it again (a skipped number is harmless)
        frame = self._seal(payload) if self.server_id is not None else None
        try:
            with self._send_lock:
                if self._direct or (self._direct_ready and self._relayed == 0):
                    self._direct = True
                    pending.t_send = time.perf_counter()
                    try:
                        self._tx.send(frame if frame is not None else self._seal(payload), zmq.NOBLOCK)
                    except zmq.Again:
                        full = True
                else:
                    pending.relayed = True
                    self._relayed += 1
                    self._outbox.send_multipart([cid.to_bytes(8, "little"), payload])
        except zmq.ZMQError:  # closed concurrently: close() fails every pending future
            pass
        if full:
            with self._lock:
                p = self._pending.pop(cid, None)
            if p is not None:
                _fail(p.future, ControlError(f"the send queue to worker {self.name!r} is full ({self.endpoint}); is it alive?"))
        return fut

    def expect(self, method: str, *, timeout_s: float | None = None) -> tuple[int, "Future[Timed]"]:
        """Register a call that is sent some other way — a broadcast call
        naming ``(self.identity, id)`` — and return its id and future (same
        contract as :meth:`submit`: replies, errors, timeout)."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        cid = next(self._ids)
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise ClientClosed(f"command client {self.name!r} is closed")
            self._pending[cid] = _Pending(fut, method, time.monotonic() + timeout, timeout, time.perf_counter())
        return cid, fut

    def address_for(self, cid: int) -> list[Any]:
        """Where another worker sends a call on this client's behalf (see
        :class:`CallForwarder`): ``[endpoint, server id, reply routing id,
        call id]``; the server id is ``None`` until the handshake is answered."""
        return [self.endpoint, self.server_id, self.identity, cid]

    def forget(self, cid: int) -> None:
        """Withdraw an expected call: its future fails now, and an answer that
        still comes counts as a late reply."""
        with self._lock:
            p = self._pending.pop(cid, None)
        if p is not None:
            self._settled(p)
            _fail(p.future, ControlError(f"call {cid} ({p.method}) to worker {self.name!r} was withdrawn"))

    def call(self, method: str, *args: Any) -> Any:
        """Blocking convenience: the call's value."""
        return self.submit(method, *args).result().value

    def ping(self, timeout_s: float = 10.0) -> float:
        """Round-trip time in seconds; waits for the server to be reachable."""
        t0 = time.perf_counter()
        self.submit_with(_PING, (), timeout_s=timeout_s).result()
        return time.perf_counter() - t0

    def server_stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The server's counters (calls, errors, dropped frames by reason)."""
        return self.submit_with(_STATS, (), timeout_s=timeout_s).result().value

    def close(self) -> None:
        """Stop the I/O thread (within about one poll interval) and fail pending calls."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._send_lock:
            self._outbox.close(0)
            self._tx.close(0)


    # I/O thread ---------------------------------------------------------
    def _seal(self, payload: bytes) -> bytes:
        """A call's frame, addressed to the server and numbered (handshake done)."""
        return self._codec.seal(payload, self._sender.stamp(self.server_id or b""))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        failure: BaseException | None = None
        hello = {"id": self._hello_id, "method": _HELLO_CALL, "args": [], "reply_to": self._rx_id}
        try:
            # no peer to queue for yet (a connection torn down by a failed CURVE handshake, or
            # not up): the hello is retried each poll, and calls wait for it until their timeout
            hello_frame: bytes | None = self._codec.encode(hello, self._sender.stamp(b""))
            while not self._stop.is_set():
                if hello_frame is not None and self._sent(hello_frame):
                    hello_frame = None
                try:
                    wait = self._wait_ms()
                    events = dict(poller.poll(wait if hello_frame is None else min(wait, _HELLO_RETRY_MS)))
                except zmq.ZMQError as e:
                    if e.errno == zmq.ETERM:
                        break
                    raise
                if self._inbox in events:
                    self._forward()
                if self._dealer in events:
                    self._receive()
                self._expire()
        except Exception as e:  # a bug: do not leave callers hanging
            log.exception("command client %r: I/O thread failed", self.name)
            failure = e
        finally:
            with self._lock:
                self._closed = True
                pending, self._pending = self._pending, {}
            for p in pending.values():
                err = ClientClosed(f"command client {self.name!r} closed before {p.method}() was answered")
                if failure is not None:
                    err = ControlError(f"command client {self.name!r} failed: {failure!r}")
                _fail(p.future, err)
            self._dealer.close(0)
            self._inbox.close(0)

    def _sent(self, frame: bytes) -> bool:
        """Send ``frame`` if a peer can take it now (False: none can, try again)."""
        try:
            self._dealer.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _settled(self, p: _Pending) -> None:
        """A call left ``_pending``: a relayed one no longer holds back the direct path."""
        if p.relayed:
            with self._send_lock:
                self._relayed -= 1

    def _wait_ms(self) -> int:
        with self._lock:
            if not self._pending:
                return self._poll_ms
            soonest = min(p.deadline for p in self._pending.values())
        return _poll_ms(self._poll_ms, soonest)

    def _forward(self) -> None:
        while True:
            try:
                cid_b, frame = self._inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            cid = int.from_bytes(cid_b, "little")
            if self.server_id is None:
                self._held.append((cid, frame))
            else:
                self._send_relayed(cid, frame)

    def _send_relayed(self, cid: int, payload: bytes) -> None:
        with self._lock:
            p = self._pending.get(cid)
            if p is None:  # timed out while it waited for the handshake
                return
            p.t_send = time.perf_counter()
        if not self._sent(self._seal(payload)):
            with self._lock:
                p = self._pending.pop(cid, None)
            if p is not None:
                self._settled(p)
                _fail(p.future, ControlError(f"the send queue to worker {self.name!r} is full ({self.endpoint}); is it alive?"))

    def _handshake(self, stamp: Stamp, payload: memoryview) -> None:
        """Before the server is known, only the answer to our hello is accepted:
        it names the server and the number its replies continue from."""
        if stamp.to != self._rx_id:
            raise BadFrame(MISADDRESSED, "the frame is addressed to another recipient")
        msg = unpack_payload(payload)
        if type(msg) is not dict or msg.get("id") != self._hello_id or msg.get("ok") is not True:
            raise BadFrame(MISADDRESSED, "a reply before the handshake was answered")
        self._guard.introduce(stamp.sender, stamp.seq)
        self.server_id = stamp.sender
        self._direct_ready = True  # the server routes replies to this connection
        while self._held:
            self._send_relayed(*self._held.popleft())

    def _receive(self) -> None:
        while True:
            try:
                parts = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            t1 = time.perf_counter()
            if len(parts) != 1:
                self._drops.drop(MALFORMED, f"{len(parts)} message parts in a reply")
                continue
            try:
                stamp, payload = self._codec.unseal(parts[0])
                if self.server_id is None:
                    self._handshake(stamp, payload)
                    continue
                self._guard.admit(stamp)
                msg = unpack_payload(payload)
            except BadFrame as e:
                self._drops.drop(e.reason, e.detail)
                continue
            if type(msg) is not dict or type(msg.get("id")) is not int:
                self._drops.drop(MALFORMED, "reply without an id")
                continue
            if msg["id"] == self._hello_id:
                continue  # our hello answered again (someone replayed it to the server)
            with self._lock:
                p = self._pending.pop(msg["id"], None)
            if p is None:
                self._late += 1
                continue
            self._settled(p)
            self._resolve(p, msg, t1)

    def _resolve(self, p: _Pending, msg: dict, t1: float) -> None:
        if msg.get("ok") is True:
            timed = msg.get("result")
            if type(timed) is not Timed or not isinstance(timed.start, float) or not isinstance(timed.end, float):
                self._drops.drop(MALFORMED, "reply result is not a Timed")
                _fail(p.future, ControlError(f"worker {self.name!r} sent a malformed reply to {p.method}()"))
                return
            if self._clock is not None:
                self._clock.sample(p.t_send, t1, timed.start, timed.end)
                timed = self._clock.map(timed)
            _succeed(p.future, timed)
            return
        type_name, message = msg.get("type"), msg.get("message")
        if type(type_name) is not str or type(message) is not str:
            self._drops.drop(MALFORMED, "error reply without type and message")
            _fail(p.future, ControlError(f"worker {self.name!r} sent a malformed error reply to {p.method}()"))
            return
        tb = msg.get("traceback")
        _fail(p.future, local_error(RemoteError(type_name, message, self.name, tb if type(tb) is str else "")))

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [cid for cid, p in self._pending.items() if p.deadline <= now]
            gone = [self._pending.pop(cid) for cid in expired]
        for p in gone:
            self._settled(p)
            _fail(p.future, WorkerTimeout(f"worker {self.name!r} did not answer {p.method}() within {p.timeout_s:g}s ({self.endpoint})"))


def _succeed(fut: Future, value: Any) -> None:
    try:
        fut.set_result(value)
    except Exception:  # already resolved
        pass


def _fail(fut: Future, err: BaseException) -> None:
    try:
        fut.set_exception(err)
    except Exception:
        pass
