"""Worker side of the command channel: :class:`CommandServer`.

Commands — ROUTER (worker, binds) ⇄ DEALER (coordinator, connects). One
endpoint per worker carries both directions; calls are pipelined, and the
ROUTER routes each reply back to the connection it came from, so a worker can
also answer a second client (a restarted coordinator) without any handshake.
A PUSH/PULL pair would need a second endpoint and the worker connecting back
to the coordinator, for nothing gained. The server runs calls on *one*
thread in arrival order — the same guarantee a Ray actor (and
``InProcessWorker``) gives — and owns its socket on that thread.

Freshness: a client's calls are addressed to this server's id, which the
client learns in a handshake (``__hello__``, the one call a server answers
unaddressed: it does nothing but name the server); replies are addressed to
the client's reply routing id and numbered here.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Iterable

import zmq

from saguaro_ray.runtime.control.endpoints import _serve_on, release_endpoint
from saguaro_ray.runtime.control.pubsub import Subscriber
from saguaro_ray.runtime.control.sockets import (
    _HELLO_CALL,
    _PING,
    _STATS,
    _SUBSCRIBE,
    DEFAULT_MAX_FRAME_BYTES,
    METHOD_NOT_ALLOWED,
    SocketOwner,
    _Drops,
    _poll_ms,
    _sock,
)
from saguaro_ray.runtime.replay import ReplayGuard, Sender
from saguaro_ray.runtime.wire import MALFORMED, MISADDRESSED, BadFrame, EncodeError, FrameCodec, pack_payload, unpack_payload
from saguaro_ray.workers.messages import Timed

log = logging.getLogger(__name__)


class CommandServer(SocketOwner):
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

    After each answer the server runs the work ``after_reply()`` names, if any,
    before it reads the next call (a draft starts the next round's build as
    soon as its lookup is answered; see ``DraftLogic.after_reply``).

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
        after_reply: Callable[[], Callable[[], None] | None] | None = None,
    ) -> None:
        self.name = name
        self._target = target
        self._ready = ready
        self._after_reply = after_reply
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
        then run the work the answer left to do (``after_reply``)."""

        def run() -> None:
            self._reply(ident, cid, self._execute(cid, method, args), method)
            work = self._after_reply() if self._after_reply is not None else None
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
        if not _shaped(msg, method=str, args=list, calls=dict):
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
        if not _shaped(msg, id=int, method=str, args=list):
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


def _shaped(msg: Any, **fields: type) -> bool:
    """Whether a decoded request is a dict whose ``fields`` have exactly these
    types (``type() is``: a bool is not an int, a tuple not a list)."""
    return type(msg) is dict and all(type(msg.get(name)) is t for name, t in fields.items())
