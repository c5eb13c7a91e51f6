"""The control plane over ZeroMQ: worker commands and the outcome broadcast.

Every frame is a :class:`~saguaro_ray.runtime.wire.FrameCodec` frame
(HMAC-SHA256 ‖ stamp ‖ msgpack); a frame that fails authentication, is not
fresh (a replay, or for another recipient: :mod:`saguaro_ray.runtime.replay`)
or cannot be decoded is dropped and counted (``dropped_frames``,
``drop_reasons``), never acted on. Every receive polls with a timeout, so
every loop notices ``close()``.

Freshness, channel by channel. A client's calls are addressed to the
server's id, which the client learns in a handshake (``__hello__``, the one
call a server answers unaddressed: it does nothing but name the server) sent
before any call, and numbered by the client; the server's replies are
addressed to the client's reply routing id and numbered by the server. A
forwarded call is addressed to the peer server's id, which the coordinator
hands over with the rest of the call's address. A broadcast is numbered by
the broadcaster, and a subscriber accepts it only from the broadcaster it was
introduced to (in the ``__subscribe__`` call: endpoint, broadcaster id and the
number it had reached). Subscription hellos are idempotent and carry no
stamp: replaying one subscribes a connection that holds no key to messages it
cannot forge.

Commands — ROUTER (worker, binds) ⇄ DEALER (coordinator, connects).
    One endpoint per worker carries both directions; calls are pipelined (a
    DEALER does not wait for a reply before the next request, unlike REQ),
    and the ROUTER routes each reply back to the connection it came from, so
    a worker can also answer a second client (a restarted coordinator)
    without any handshake. A PUSH/PULL pair would need a second endpoint and
    the worker connecting back to the coordinator, for nothing gained. The
    :class:`CommandServer` runs calls on *one* thread in arrival order — the
    same guarantee a Ray actor (and ``InProcessWorker``) gives.

Forwarded calls — DEALER (a worker, connects) → ROUTER (another worker).
    A :class:`CallForwarder` lets a worker place a call on another worker's
    command socket on the coordinator's behalf: the coordinator registers the
    call (:meth:`CommandClient.expect`) and hands the worker the peer's
    endpoint, its own client's routing id and the call id; the request names
    that routing id as ``reply_to``, so the peer answers the coordinator as if
    it had sent the call itself. The SSD target uses it to start the drafts'
    cache lookups the moment verification ends.

Broadcast — XPUB (coordinator, binds) → SUB (workers, connect), in
    ``XPUB_MANUAL`` mode. A :class:`Subscriber` sends, as a subscription, an
    authenticated hello naming its topics; only on receiving it does the
    :class:`Broadcaster` subscribe that connection to those topics. So
    :meth:`Broadcaster.wait_for_subscribers` returning means every counted
    subscriber *is* subscribed — the first message published afterwards
    reaches it (no slow-joiner loss) — and a peer without the key receives
    nothing at all. ``XPUB_NODROP`` makes a full queue raise instead of
    silently dropping a message.

Threads. ZeroMQ sockets are not thread-safe; a socket may only move between
threads across a full memory barrier. :class:`CommandServer` and
:class:`CommandClient` each own their network socket on one private thread.
``CommandClient.submit`` may be called from any thread: it encodes on the
caller's thread, then hands the frame to the I/O thread through an
``inproc://`` PAIR socket whose sending end is guarded by a lock (the lock is
the barrier); the I/O thread polls that PAIR and the DEALER together, so a
submit is sent at once and replies are matched to futures by id.
:class:`Broadcaster` and :class:`Subscriber` have no thread: each serialises
calls on its one socket with a lock, so any thread may call them.

Endpoints come from :func:`bind_endpoint`: ``tcp://HOST:PORT`` on an
ephemeral port, or an ``ipc://`` socket in a fresh private (0700) temp dir
when ``host`` is ``None`` (same node), released by the owner's ``close()``.
The dir's name carries the owner's pid, so a process that was killed before
it could close (a worker Ray restarted) leaves nothing for long: the next
process on the node to bind one removes the dirs of owners that are gone
(judged by pid, so this assumes that processes sharing a temp dir share a pid
namespace, as a Ray node's do).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import zmq

from saguaro_ray.errors import SaguaroError
from saguaro_ray.runtime.replay import ReplayGuard, Sender
from saguaro_ray.runtime.wire import MALFORMED, MISADDRESSED, BadFrame, EncodeError, FrameCodec, Stamp, new_key, pack_payload, unpack_payload
from saguaro_ray.workers.messages import Timed

log = logging.getLogger(__name__)

__all__ = [
    "Broadcaster",
    "ClientClosed",
    "CommandClient",
    "CallForwarder",
    "CommandServer",
    "ControlError",
    "EngineKey",
    "RemoteError",
    "Subscriber",
    "SubscriberTimeout",
    "WorkerTimeout",
    "bind_endpoint",
    "release_endpoint",
]

METHOD_NOT_ALLOWED = "MethodNotAllowed"
DEFAULT_MAX_FRAME_BYTES = 1 << 30
_PING = "__ping__"
_HELLO_CALL = "__hello__"
_STATS = "__stats__"
_SUBSCRIBE = "__subscribe__"
_IPC_PREFIX = "saguaro-zmq-"
_DATA = b"D"  # broadcast topic prefix
_HELLO = b"H"  # subscription-handshake prefix


# ---------------------------------------------------------------- errors


class ControlError(SaguaroError, RuntimeError):
    """The control plane could not deliver a call or a message."""


class RemoteError(ControlError):
    """A worker method raised; ``type_name`` is the remote exception's class name."""

    def __init__(self, type_name: str, message: str, worker: str = "", remote_traceback: str = "") -> None:
        self.type_name = type_name
        self.message = message
        self.worker = worker
        self.remote_traceback = remote_traceback
        where = f"worker {worker!r} raised " if worker else ""
        super().__init__(f"{where}{type_name}: {message}")

    def __reduce__(self) -> tuple:
        return (RemoteError, (self.type_name, self.message, self.worker, self.remote_traceback))


class WorkerTimeout(ControlError, TimeoutError):
    """A worker did not answer a call within its timeout (the call may still run there)."""


class ClientClosed(ControlError):
    """The command client was closed before the call was answered."""


class SubscriberTimeout(ControlError, TimeoutError):
    """Fewer subscribers than required joined a broadcast in time."""


# ---------------------------------------------------------------- endpoints


def _ipc_dir_root() -> str:
    root = tempfile.gettempdir()
    # a unix socket path must fit in ~107 bytes
    return root if len(root) <= 60 else "/tmp"


def _owner_pid(name: str) -> int | None:
    """The pid in an IPC dir's name (``saguaro-zmq-<pid>-<random>``), if any."""
    pid, sep, _ = name[len(_IPC_PREFIX) :].partition("-")
    return int(pid) if sep and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


_swept = False


def _sweep_orphans(root: str) -> None:
    """Remove the IPC dirs (ours, by uid) whose owner process is gone; once per process."""
    global _swept
    if _swept:
        return
    _swept = True
    try:
        names = os.listdir(root)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        pid = _owner_pid(name) if name.startswith(_IPC_PREFIX) else None
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left behind by process %d", path, pid)


def bind_endpoint(sock: zmq.Socket, host: str | None, *, name: str = "control") -> str:
    """Bind ``sock`` and return the concrete endpoint to connect to.

    ``host`` given: ``tcp://host:*`` — an ephemeral port on that address
    (IPv6 literals allowed). ``None``: an ``ipc://`` socket in a new private
    temp dir (same-node peers only); :func:`release_endpoint` removes it.
    """
    if host is None:
        root = _ipc_dir_root()
        _sweep_orphans(root)
        d = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-", dir=root)
        sock.bind(f"ipc://{os.path.join(d, name)}.sock")
    else:
        if not host or any(c in host for c in "/*[]"):
            raise ValueError(f"host must be an IP address or host name, got {host!r}")
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            sock.bind(f"tcp://[{host}]:*")
        else:
            sock.bind(f"tcp://{host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def release_endpoint(endpoint: str) -> None:
    """Remove the temp dir of an ``ipc://`` endpoint made by :func:`bind_endpoint`
    (a no-op for anything else). Call after the bound socket is closed."""
    if not endpoint.startswith("ipc://"):
        return
    d = os.path.dirname(endpoint[len("ipc://") :])
    if os.path.basename(d).startswith(_IPC_PREFIX):
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- counters


class _Drops:
    """Dropped-frame counts by reason (thread-safe)."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def drop(self, reason: str, detail: str = "") -> None:
        with self._lock:
            self._counts[reason] += 1
        log.warning("%s: dropped a frame (%s%s)", self._owner, reason, f": {detail}" if detail else "")

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def reasons(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _poll_ms(poll_ms: int, deadline: float) -> int:
    """How long a loop may poll: ``poll_ms``, or less to wake by ``deadline`` (monotonic)."""
    return max(0, min(poll_ms, int((deadline - time.monotonic()) * 1000) + 1))


class EngineKey(bytes):
    """The engine's secret: the frame HMAC key (the bytes themselves), and
    with ``encrypt`` a CURVE keypair (z85, :attr:`curve`) for the sockets
    that bind TCP endpoints. One per engine, handed to every actor through
    Ray; anything that takes a frame key takes this.

    CURVE (multi-node TCP; IPC stays on one node in 0700 dirs and is not
    encrypted): every binding socket is a CURVE server with the engine's
    secret key, and every connecting socket checks that key (it knows the
    public one) under a keypair of its own, so nothing crossing the network
    can be read or altered. There is no ZAP handler: a peer that knows the
    public key may connect, but without the HMAC key everything it sends is
    still dropped.
    """

    curve: tuple[bytes, bytes] | None

    def __new__(cls, mac: bytes, curve: tuple[bytes, bytes] | None = None) -> "EngineKey":
        self = super().__new__(cls, mac)
        self.curve = curve
        return self

    def __reduce__(self) -> tuple:
        return (EngineKey, (bytes(self), self.curve))

    @classmethod
    def generate(cls, encrypt: bool = False) -> "EngineKey":
        if encrypt and not zmq.has("curve"):
            raise ControlError("this libzmq was built without CURVE; encryption is not available")
        return cls(new_key(), zmq.curve_keypair() if encrypt else None)


def _curve(key: bytes) -> tuple[bytes, bytes] | None:
    return getattr(key, "curve", None)


def _serve_on(sock: zmq.Socket, key: bytes, host: str | None, endpoint: str | None, name: str) -> str:
    """Bind ``sock`` to ``endpoint`` exactly, or via :func:`bind_endpoint` on
    ``host``; a TCP endpoint is a CURVE server when the key carries a keypair."""
    curve = _curve(key)
    if curve is not None and (endpoint.startswith("tcp://") if endpoint is not None else host is not None):
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve[1])
    if endpoint is not None:
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bind_endpoint(sock, host, name=name.replace("/", "_")[:40] or "control")


def _connect(sock: zmq.Socket, key: bytes, endpoint: str) -> None:
    """Connect ``sock``; to a TCP endpoint over CURVE when the key carries a
    keypair (checking the server's key, under a fresh keypair of its own)."""
    curve = _curve(key)
    if curve is not None and endpoint.startswith("tcp://"):
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve[0])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(endpoint)


def _sock(kind: int, max_frame_bytes: int | None) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if max_frame_bytes:
        s.setsockopt(zmq.MAXMSGSIZE, int(max_frame_bytes))
    return s


# ---------------------------------------------------------------- commands


class CommandServer:
    """Worker side: serves ``allowed`` methods of ``target`` on a ROUTER socket.

    Requests are ``{"id", "method", "args"}``; each is executed on the server
    thread, strictly in arrival order, and answered with ``{"id", "ok": True,
    "result": Timed(value, start, end)}`` (``time.perf_counter`` on this
    process; a method that returns a :class:`Timed` itself names the span its
    work really ran) or ``{"id", "ok": False, "type", "message", "traceback"}``. A
    method outside the allow-list is answered with error type
    ``"MethodNotAllowed"``. Built-ins always served: ``__hello__`` (the
    handshake: the reply's stamp names this server, :attr:`id`),
    ``__ping__``, ``__stats__`` (this server's counters) and
    ``__subscribe__(invitation)`` (join a :class:`Broadcaster`, see
    :meth:`Broadcaster.invitation`; returns the subscriber id). Frames that
    fail authentication, freshness or decoding — here or on the broadcast —
    are dropped and counted.

    Broadcast calls: once subscribed, the server also executes calls that
    arrive on the broadcast — ``{"method", "args", "calls": {server name:
    [client identity, call id]}}`` — one message for many workers, each
    answering its own entry through this ROUTER to the named client (see
    :meth:`CommandClient.expect`), in order with its other calls.

    After each answer the server runs the work ``follow_up()`` names, if any,
    before it reads the next call (a draft starts the next round's build as
    soon as its lookup is answered; see ``DraftLogic.follow_up``).

    A call that ``ready(method, args)`` says cannot run yet waits, up to
    ``max_defer_s``, while later calls run, and runs as soon as one of them
    has made it ready (or when its time is up): a forwarded SSD lookup (see
    :class:`CallForwarder`) may arrive before the build it looks into, which
    the coordinator sent first but over another connection.

    Bind to ``endpoint`` exactly, or (default) via :func:`bind_endpoint` on
    ``host`` (``None``: ipc). ``poll_interval_s`` bounds how long ``close()``
    waits for an idle loop; a call in progress is waited for up to
    ``close(timeout_s)``.
    """

    def __init__(
        self,
        target: Any,
        allowed: Iterable[str],
        key: bytes,
        *,
        host: str | None = None,
        endpoint: str | None = None,
        name: str = "worker",
        poll_interval_s: float = 0.1,
        max_frame_bytes: int | None = DEFAULT_MAX_FRAME_BYTES,
        ready: Callable[[str, list], bool] | None = None,
        max_defer_s: float = 0.5,
        follow_up: Callable[[], Callable[[], None] | None] | None = None,
    ) -> None:
        self.name = name
        self._target = target
        self._ready = ready
        self._follow_up = follow_up
        self._max_defer_s = max_defer_s
        self._deferred: deque[tuple[float, str, list, Callable[[], None]]] = deque()  # server thread only
        self._deferred_calls = 0
        self._allowed = frozenset(allowed)
        for m in sorted(self._allowed):
            if not isinstance(m, str) or not m or m.startswith("_"):
                raise ValueError(f"cannot expose method {m!r}: names starting with '_' are never served")
            if not callable(getattr(target, m, None)):
                raise ValueError(f"{type(target).__name__} has no method {m!r} to expose")
        self._codec = FrameCodec(key)
        self._sender = Sender()  # numbers the replies; its id is this server's recipient id
        self.id = self._sender.id
        self._guard = ReplayGuard(self.id, open_door=True)
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._drops = _Drops(f"command server {name!r}")
        self._calls = 0
        self._errors = 0
        self._unroutable = 0
        self._broadcast_calls = 0
        self._sock = _sock(zmq.ROUTER, max_frame_bytes)
        try:
            self.endpoint = _serve_on(self._sock, key, host, endpoint, name)
        except Exception:
            self._sock.close(0)
            raise
        self._key = key
        self._sub: Subscriber | None = None  # created and used on the server thread only
        self._stop = threading.Event()
        self._closed = False
        # the socket moves to the server thread here (Thread.start is a memory barrier)
        self._thread = threading.Thread(target=self._serve, name=f"saguaro-cmd-{name}", daemon=True)
        self._thread.start()

    # counters -----------------------------------------------------------
    @property
    def dropped_frames(self) -> int:
        return self._drops.total

    @property
    def drop_reasons(self) -> dict[str, int]:
        return self._drops.reasons()

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self._calls,
            "errors": self._errors,
            "dropped": self._drops.total,
            "drop_reasons": self._drops.reasons(),
            "unroutable_replies": self._unroutable,
            "broadcast_calls": self._broadcast_calls,
            "deferred_calls": self._deferred_calls,
        }

    # loop ---------------------------------------------------------------
    def _serve(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        polled_sub: Subscriber | None = None
        try:
            while not self._stop.is_set():
                if self._sub is not polled_sub:  # subscribed since the last turn
                    polled_sub = self._sub
                    poller.register(polled_sub._sock, zmq.POLLIN)
                try:
                    events = dict(poller.poll(self._wait_ms()))
                    # direct calls first: a broadcast (e.g. an SSD lookup) is sent after
                    # the direct calls it follows (that round's build), so run whatever
                    # of those has already arrived before it
                    if sock in events:
                        self._drain(sock)
                    if polled_sub is not None and polled_sub._sock in events:
                        self._drain(sock)
                        self._handle_broadcast(polled_sub)
                    self._run_deferred()
                except zmq.ZMQError as e:
                    if e.errno == zmq.ETERM:
                        break
                    log.exception("command server %r: receive failed", self.name)
                    time.sleep(self._poll_ms / 1000)
        finally:
            if self._sub is not None:
                self._sub.close()
            sock.close(0)

    def _drain(self, sock: zmq.Socket) -> None:
        """Run every direct call that has arrived, in order."""
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(parts)
            except Exception:  # never let one frame kill the loop
                log.exception("command server %r: unexpected error handling a frame", self.name)
            self._run_deferred()

    def _wait_ms(self) -> int:
        return _poll_ms(self._poll_ms, self._deferred[0][0]) if self._deferred else self._poll_ms

    def _is_ready(self, method: str, args: list) -> bool:
        if self._ready is None:
            return True
        try:
            return bool(self._ready(method, args))
        except Exception:  # the call itself will report what is wrong with it
            return True

    def _serve_call(self, ident: bytes, cid: int, method: str, args: list) -> None:
        """Execute a call and answer ``ident`` now, or hold it until it is ready;
        then run the work the answer left to do (``follow_up``)."""

        def run() -> None:
            self._reply(ident, cid, self._execute(cid, method, args), method)
            work = self._follow_up() if self._follow_up is not None else None
            if work is not None:
                try:
                    work()
                except Exception:
                    log.exception("command server %r: the work after call %d (%s) failed", self.name, cid, method)

        if self._is_ready(method, args):
            run()
        else:
            self._deferred_calls += 1
            self._deferred.append((time.monotonic() + self._max_defer_s, method, args, run))

    def _run_deferred(self) -> None:
        """Run the waiting calls that are ready now, or out of time, in arrival order."""
        if not self._deferred:
            return
        now, waiting = time.monotonic(), deque()
        while self._deferred:
            entry = self._deferred.popleft()
            if entry[0] <= now or self._is_ready(entry[1], entry[2]):
                try:
                    entry[3]()
                except Exception:
                    log.exception("command server %r: unexpected error running a deferred call", self.name)
            else:
                waiting.append(entry)
        self._deferred = waiting

    def _handle_broadcast(self, sub: "Subscriber") -> None:
        """Execute this server's entry of a broadcast call; reply to the named client."""
        msg = sub.recv(0)
        if msg is None:
            return
        if (
            type(msg) is not dict
            or type(msg.get("method")) is not str
            or type(msg.get("args")) is not list
            or type(msg.get("calls")) is not dict
        ):
            self._drops.drop(MALFORMED, "broadcast call is not {method: str, args: list, calls: dict}")
            return
        entry = msg["calls"].get(self.name)
        if entry is None:
            return  # addressed to other workers
        if type(entry) not in (list, tuple) or len(entry) != 2 or type(entry[0]) is not bytes or type(entry[1]) is not int:
            self._drops.drop(MALFORMED, "broadcast call entry is not [identity: bytes, id: int]")
            return
        ident, cid = entry
        self._broadcast_calls += 1
        method, args = msg["method"], msg["args"]
        self._serve_call(ident, cid, method, args)

    def _handle(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self._drops.drop(MALFORMED, f"{len(parts)} message parts, expected identity + frame")
            return
        ident, frame = parts
        try:
            stamp, payload = self._codec.unseal(frame)
            if stamp.to:  # a hello (unaddressed) is checked below, once it is parsed
                self._guard.admit(stamp)
            msg = unpack_payload(payload)
        except BadFrame as e:
            self._drops.drop(e.reason, e.detail)
            return
        if (
            type(msg) is not dict
            or type(msg.get("id")) is not int
            or type(msg.get("method")) is not str
            or type(msg.get("args")) is not list
        ):
            self._drops.drop(MALFORMED, "request is not {id: int, method: str, args: list}")
            return
        cid, method, args = msg["id"], msg["method"], msg["args"]
        if not stamp.to and method != _HELLO_CALL:
            self._drops.drop(MISADDRESSED, f"an unaddressed {method}() call (only {_HELLO_CALL} may be)")
            return
        # a client sends on one connection and reads replies on another (see
        # CommandClient); "reply_to" names the reading one's routing id
        reply_to = msg.get("reply_to")
        if type(reply_to) is bytes and 0 < len(reply_to) <= 255:
            ident = reply_to
        self._serve_call(ident, cid, method, args)

    def _reply(self, ident: bytes, cid: int, reply: dict[str, Any], method: str) -> None:
        try:
            payload = pack_payload(reply)
        except EncodeError as e:
            self._errors += 1
            payload = pack_payload(self._error(cid, e, with_traceback=False))
        out = self._codec.seal(payload, self._sender.stamp(ident))
        try:
            self._sock.send_multipart([ident, out], zmq.NOBLOCK)
        except zmq.Again:  # the client's queue is full or it is gone
            self._unroutable += 1
            log.warning("command server %r: could not send the reply to call %d (%s)", self.name, cid, method)
        except zmq.ZMQError as e:  # EHOSTUNREACH: no such client connected
            self._unroutable += 1
            log.warning("command server %r: reply to call %d (%s) is unroutable (%s)", self.name, cid, method, e)

    def _execute(self, cid: int, method: str, args: list) -> dict[str, Any]:
        start = time.perf_counter()
        if method == _PING or method == _HELLO_CALL:
            return {"id": cid, "ok": True, "result": Timed(None, start, time.perf_counter())}
        if method == _STATS:
            return {"id": cid, "ok": True, "result": Timed(self.stats(), start, time.perf_counter())}
        if method == _SUBSCRIBE:
            try:
                if type(args) is not list or len(args) != 1:
                    raise ValueError("__subscribe__ takes one invitation (Broadcaster.invitation())")
                if self._sub is not None:
                    self._sub.close()
                self._sub = Subscriber(args[0], self._key, name=f"{self.name}-broadcast", drops=self._drops)
            except Exception as e:
                self._errors += 1
                return self._error(cid, e, with_traceback=False)
            return {"id": cid, "ok": True, "result": Timed(self._sub.id, start, time.perf_counter())}
        if method not in self._allowed:
            self._errors += 1
            return {
                "id": cid,
                "ok": False,
                "type": METHOD_NOT_ALLOWED,
                "message": f"worker {self.name!r} does not serve {method!r}; it serves {sorted(self._allowed)}",
                "traceback": "",
            }
        self._calls += 1
        try:
            value = getattr(self._target, method)(*args)
        except Exception as e:
            self._errors += 1
            return self._error(cid, e)
        return {"id": cid, "ok": True, "result": Timed.since(value, start)}

    @staticmethod
    def _error(cid: int, e: BaseException, with_traceback: bool = True) -> dict[str, Any]:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-8000:] if with_traceback else ""
        return {"id": cid, "ok": False, "type": type(e).__name__, "message": str(e), "traceback": tb}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving (after the call in progress, waiting up to ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("command server %r: a call is still running after %.1fs; leaving it", self.name, timeout_s)
        release_endpoint(self.endpoint)

    def __enter__(self) -> "CommandServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CallForwarder:
    """Places calls on other workers' command sockets, to be answered to a
    third party (see "Forwarded calls" in the module doc).

    One DEALER per peer endpoint, opened on first use and kept (a restarted
    peer has a new endpoint, hence a new socket). Not thread-safe: a worker
    forwards from its :class:`CommandServer` thread only. Sends never block:
    a full queue raises :class:`ControlError`, and the coordinator's expected
    call then times out or is replaced by its own fallback.
    """

    def __init__(self, key: bytes, *, max_peers: int = 64, max_frame_bytes: int | None = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._codec = FrameCodec(key)
        self._key = key
        self._sender = Sender()
        self._max_peers = max_peers
        self._max_frame_bytes = max_frame_bytes
        self._socks: dict[str, zmq.Socket] = {}
        self.forwarded = 0

    def call(self, address: Sequence[Any], method: str, args: list) -> None:
        """Send ``method(*args)`` to the server at ``address`` — ``[endpoint,
        server id, reply routing id, call id]``, from
        :meth:`CommandClient.address_for` — so that it replies to that client
        under that call id. :class:`ControlError` if it cannot be sent."""
        if type(address) not in (list, tuple) or len(address) != 4:
            raise ControlError(f"a forwarded call's address is [endpoint, server id, reply routing id, call id], got {address!r}")
        endpoint, server_id, reply_to, cid = address
        if type(server_id) is not bytes or not server_id:
            raise ControlError(f"cannot forward a call to {endpoint}: its server has not been reached yet (no server id)")
        if type(endpoint) is not str or type(reply_to) is not bytes or not 0 < len(reply_to) <= 255 or type(cid) is not int:
            raise ControlError("a forwarded call needs an endpoint, the client's routing id (bytes) and an integer call id")
        frame = self._codec.encode({"id": cid, "method": method, "args": list(args), "reply_to": reply_to}, self._sender.stamp(server_id))
        try:
            sock = self._socks.get(endpoint)
            if sock is None:
                sock = _sock(zmq.DEALER, self._max_frame_bytes)
                try:
                    _connect(sock, self._key, endpoint)
                except zmq.ZMQError:
                    sock.close(0)  # a bad endpoint leaves nothing behind
                    raise
                if len(self._socks) >= self._max_peers:  # peers that restarted left their old endpoints here
                    self._socks.pop(next(iter(self._socks))).close(0)
                self._socks[endpoint] = sock
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise ControlError(f"the send queue to {endpoint} is full; is that worker alive?") from None
        except zmq.ZMQError as e:
            raise ControlError(f"cannot forward a call to {endpoint}: {e}") from None
        self.forwarded += 1

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()


class _ClockMap:
    """Maps a worker's ``perf_counter`` spans onto this process's clock.

    Each reply is an NTP-style sample: sent at ``t0`` (here), ran over
    ``[start, end]`` (there), received at ``t1`` (here); ``offset = ((start -
    t0) + (end - t1)) / 2`` with error at most ``(t1 - t0 - (end - start)) / 2``.
    The sample with the smallest error bound (aged by a generous drift rate)
    wins, so calls that waited in the worker's queue never spoil it.
    """

    DRIFT = 1e-4  # s/s

    def __init__(self) -> None:
        self.offset = 0.0
        self.bound = float("inf")
        self._at = 0.0

    def sample(self, t0: float, t1: float, start: float, end: float) -> None:
        bound = max(0.0, (t1 - t0) - (end - start)) / 2
        if bound <= self.bound + self.DRIFT * (t1 - self._at):
            self.offset = ((start - t0) + (end - t1)) / 2
            self.bound = bound
            self._at = t1

    def map(self, timed: Timed) -> Timed:
        return Timed(timed.value, timed.start - self.offset, timed.end - self.offset)


@dataclass
class _Pending:
    future: Future
    method: str
    deadline: float  # time.monotonic()
    timeout_s: float
    t_send: float  # time.perf_counter()
    relayed: bool = False  # sent through the I/O thread (before the direct path was known to work)


class CommandClient:
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
    estimated from the round trips (see ``_ClockMap``; error ≤ half the best
    round-trip overhead). Future callbacks run on the client's I/O thread:
    keep them short.

    ``known_errors`` maps remote exception type names to local classes to
    raise instead of :class:`RemoteError` (built as ``cls(message)``, with the
    ``RemoteError`` as ``__cause__``), e.g. ``{"NeedsPrefillError":
    NeedsPrefillError}`` so a round loop can catch what it catches in-process.
    Unlike ``InProcessWorker``, an unknown method is reported through the
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
        known_errors: Mapping[str, type[BaseException]] | None = None,
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
        self._clock = _ClockMap() if (clock_sync if clock_sync is not None else not endpoint.startswith("ipc://")) else None
        self._drops = _Drops(f"command client {name!r}")
        self._known_errors = dict(known_errors or {})
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
        # Two connections to the server: the I/O thread owns ``_dealer`` and
        # reads every reply from it; submitters send on ``_tx`` directly
        # (under _send_lock), asking the server to answer to ``_dealer``'s
        # routing id — one thread hop less per call. Until a first reply has
        # arrived on ``_dealer`` (so the server surely knows its id), calls
        # are relayed through the I/O thread and sent on ``_dealer`` itself;
        # the switch happens once none of those is pending, so calls still
        # reach the server in submission order.
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

    # public -------------------------------------------------------------
    @property
    def dropped_frames(self) -> int:
        return self._drops.total

    @property
    def drop_reasons(self) -> dict[str, int]:
        return self._drops.reasons()

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

    def __enter__(self) -> "CommandClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
            self._dealer.send(self._codec.encode(hello, self._sender.stamp(b"")), zmq.NOBLOCK)
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(self._wait_ms()))
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
        try:
            self._dealer.send(self._seal(payload), zmq.NOBLOCK)
        except zmq.Again:
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
        err: BaseException = RemoteError(type_name, message, self.name, tb if type(tb) is str else "")
        local = self._known_errors.get(type_name)
        if local is not None:
            try:
                mapped = local(message)
            except Exception:
                log.warning("command client %r: cannot build %s(%r); raising RemoteError", self.name, local.__name__, message)
            else:
                mapped.__cause__ = err
                err = mapped
        _fail(p.future, err)

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


# ---------------------------------------------------------------- broadcast


class Broadcaster:
    """Coordinator → many workers: an XPUB socket with an authenticated join.

    ``publish(obj, topic="")`` sends to every subscriber of ``topic`` (a
    subscriber of ``""`` receives all topics). ``wait_for_subscribers(n)``
    blocks until ``n`` authenticated subscribers are connected and
    subscribed. Hellos that fail authentication are dropped and counted; an
    unauthenticated peer is never subscribed to anything. A subscriber that
    stops reading makes ``publish`` raise :class:`ControlError` after
    ``send_timeout_s`` once its queue (``hwm`` messages) is full. Messages
    are numbered; a :class:`Subscriber` is built from :meth:`invitation`,
    which tells it whose messages, from which number on, to accept.
    """

    def __init__(
        self,
        key: bytes,
        *,
        host: str | None = None,
        endpoint: str | None = None,
        name: str = "broadcast",
        hwm: int = 10_000,
        send_timeout_s: float = 30.0,
    ) -> None:
        self.name = name
        self._codec = FrameCodec(key)
        self._sender = Sender()
        self._drops = _Drops(f"broadcaster {name!r}")
        self._lock = threading.Lock()
        self._subs: dict[str, list[str]] = {}
        self._closed = False
        sock = _sock(zmq.XPUB, None)
        sock.setsockopt(zmq.XPUB_MANUAL, 1)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.SNDTIMEO, max(0, int(send_timeout_s * 1000)))
        try:
            self.endpoint = _serve_on(sock, key, host, endpoint, name)
        except Exception:
            sock.close(0)
            raise
        self._sock = sock

    @property
    def dropped_frames(self) -> int:
        return self._drops.total

    @property
    def drop_reasons(self) -> dict[str, int]:
        return self._drops.reasons()

    def invitation(self) -> list[Any]:
        """What a :class:`Subscriber` needs to join: ``[endpoint, this
        broadcaster's sender id, the last number it used]`` — it accepts only
        this broadcaster's messages numbered above that (so none captured
        before it joined)."""
        return [self.endpoint, self._sender.id, self._sender.last]

    @property
    def subscribers(self) -> int:
        """Authenticated subscribers connected now."""
        with self._lock:
            self._drain(0)
            return len(self._subs)

    def wait_for_subscribers(self, n: int, timeout_s: float = 30.0) -> int:
        """Return the subscriber count once it is at least ``n``; raise
        :class:`SubscriberTimeout` after ``timeout_s``."""
        self._wait(lambda: len(self._subs) >= n, timeout_s, f"{n} subscribers")
        return self.subscribers

    def wait_for(self, ids: Iterable[str], timeout_s: float = 30.0) -> None:
        """Block until the subscribers with these ids (:attr:`Subscriber.id`)
        are subscribed — after that, nothing published reaches them late."""
        ids = set(ids)
        self._wait(lambda: ids <= set(self._subs), timeout_s, f"subscribers {sorted(ids)}")

    def _wait(self, done: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._drain(0)
                if done():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SubscriberTimeout(
                        f"only {len(self._subs)} subscribers joined broadcast {self.name!r} ({self.endpoint}) within "
                        f"{timeout_s:g}s, waiting for {what}"
                    )
                self._drain(min(left, 0.1))

    def publish(self, obj: Any, topic: str = "") -> None:
        frame = self._codec.encode({"topic": topic, "msg": obj}, self._sender.stamp(b""))
        with self._lock:
            self._drain(0)
            try:
                self._sock.send_multipart([_DATA + topic.encode("utf-8"), frame])
            except zmq.Again:
                raise ControlError(
                    f"broadcast {self.name!r}: a subscriber's queue is full and it has not read for a while; message not sent"
                ) from None

    def _drain(self, wait_s: float) -> None:
        """Process subscription messages; wait up to ``wait_s`` for the first."""
        # poll even for wait_s == 0: it makes libzmq process pending pipe events
        if not self._sock.poll(max(0, int(wait_s * 1000)), zmq.POLLIN):
            return
        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_subscription(msg)

    def _on_subscription(self, msg: bytes) -> None:
        if len(msg) < 2 or msg[0] not in (0, 1):
            self._drops.drop(MALFORMED, "not a subscription message")
            return
        subscribe, topic = msg[0] == 1, msg[1:]
        if topic[:1] == _DATA:
            return  # a SUB's own topic filter; in manual mode only the hello subscribes
        if topic[:1] != _HELLO:
            self._drops.drop(MALFORMED, "subscription outside the protocol")
            return
        try:
            hello = self._codec.decode(topic[1:])
        except BadFrame as e:
            self._drops.drop(e.reason, f"subscriber hello: {e.detail}")
            return
        if (
            type(hello) is not dict
            or type(hello.get("hello")) is not str
            or type(hello.get("topics")) is not list
            or any(type(t) is not str for t in hello["topics"])
        ):
            self._drops.drop(MALFORMED, "subscriber hello is not {hello: str, topics: [str]}")
            return
        sid = hello["hello"]
        if subscribe:
            for t in hello["topics"]:  # applies to the connection this hello came from
                self._sock.setsockopt(zmq.SUBSCRIBE, _DATA + t.encode("utf-8"))
            self._subs[sid] = hello["topics"]
        else:  # the subscriber left (its connection closed)
            self._subs.pop(sid, None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(0)
        release_endpoint(self.endpoint)

    def __enter__(self) -> "Broadcaster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Subscriber:
    """Worker side of a :class:`Broadcaster`: ``recv(timeout_s)`` → object or ``None``.

    Built from the broadcaster's :meth:`~Broadcaster.invitation`; joins with
    an authenticated hello naming ``topics`` (``""``: all). Frames that fail
    authentication, freshness (not that broadcaster's, or a number already
    seen or from before the invitation) or decoding are dropped and counted
    (in ``drops`` when given: a server counts its subscriber's drops as its own).
    """

    def __init__(
        self,
        invitation: Sequence[Any],
        key: bytes,
        *,
        topics: Iterable[str] = ("",),
        name: str = "subscriber",
        drops: _Drops | None = None,
    ) -> None:
        if type(invitation) not in (list, tuple) or len(invitation) != 3:
            raise ValueError(f"an invitation is [endpoint, broadcaster id, last number] (Broadcaster.invitation()), got {invitation!r}")
        endpoint, publisher, after = invitation
        if type(endpoint) is not str or type(publisher) is not bytes or type(after) is not int or after < 0:
            raise ValueError(f"an invitation is [endpoint: str, broadcaster id: bytes, last number: int], got {invitation!r}")
        self.name = name
        self.endpoint = endpoint
        self.id = uuid.uuid4().hex
        self.topics = list(topics)
        if not self.topics or any(not isinstance(t, str) for t in self.topics):
            raise ValueError(f"topics must be a non-empty list of strings, got {topics!r}")
        self._codec = FrameCodec(key)
        self._guard = ReplayGuard(b"", open_door=False)
        self._guard.introduce(publisher, after)
        self._drops = drops if drops is not None else _Drops(f"subscriber {name!r}")
        self._lock = threading.Lock()
        self._closed = False
        self._closing = False
        sock = _sock(zmq.SUB, None)
        for t in self.topics:  # local filter first, then the hello
            sock.setsockopt(zmq.SUBSCRIBE, _DATA + t.encode("utf-8"))
        sock.setsockopt(zmq.SUBSCRIBE, _HELLO + self._codec.encode({"hello": self.id, "topics": self.topics}))
        _connect(sock, key, endpoint)
        self._sock = sock

    @property
    def dropped_frames(self) -> int:
        return self._drops.total

    @property
    def drop_reasons(self) -> dict[str, int]:
        return self._drops.reasons()

    def recv(self, timeout_s: float = 1.0) -> Any:
        """The next authentic message, or ``None`` if none arrives within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._closing:
                    raise ControlError(f"subscriber {self.name!r} is closed")
                left = deadline - time.monotonic()
                # poll in short slices so a concurrent close() gets the lock promptly
                if not self._sock.poll(max(0, int(min(left, 0.1) * 1000)), zmq.POLLIN):
                    if left <= 0.1:
                        return None
                    continue
                try:
                    parts = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                obj = self._accept(parts)
                if obj is not _REJECTED:
                    return obj
                if time.monotonic() >= deadline:
                    return None

    def _accept(self, parts: list[bytes]) -> Any:
        if len(parts) != 2 or parts[0][:1] != _DATA:
            self._drops.drop(MALFORMED, "not a [topic, frame] broadcast")
            return _REJECTED
        try:
            stamp, payload = self._codec.unseal(parts[1])
            self._guard.admit(stamp)
            env = unpack_payload(payload)
        except BadFrame as e:
            self._drops.drop(e.reason, e.detail)
            return _REJECTED
        if type(env) is not dict or type(env.get("topic")) is not str or "msg" not in env:
            self._drops.drop(MALFORMED, "broadcast is not {topic, msg}")
            return _REJECTED
        if _DATA + env["topic"].encode("utf-8") != parts[0]:
            self._drops.drop(MALFORMED, "topic frame does not match the authenticated topic")
            return _REJECTED
        return env["msg"]

    def close(self) -> None:
        """Leave the broadcast; a ``recv`` in progress on another thread returns within ~0.1 s."""
        self._closing = True
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(0)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_REJECTED = object()
