"""Broadcast — XPUB (coordinator, binds) → SUB (workers, connect), in
``XPUB_MANUAL`` mode.

A :class:`Subscriber` sends, as a subscription, an authenticated hello
naming its topics; only on receiving it does the :class:`Broadcaster`
subscribe that connection to those topics. So
:meth:`Broadcaster.wait_for_subscribers` returning means every counted
subscriber *is* subscribed — the first message published afterwards reaches
it (no slow-joiner loss) — and a peer without the key receives nothing at
all. ``XPUB_NODROP`` makes a full queue raise instead of silently dropping a
message. A broadcast is numbered by the broadcaster, and a subscriber
accepts it only from the broadcaster it was introduced to (its
:meth:`Broadcaster.invitation`: endpoint, broadcaster id and the number it
had reached). Subscription hellos are idempotent and carry no stamp:
replaying one subscribes a connection that holds no key to messages it
cannot forge.

Neither class has a thread: each serialises calls on its one socket with a
lock, so any thread may call them.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Iterable, Sequence

import zmq

from saguaro_ray.errors import ControlError, SubscriberTimeout
from saguaro_ray.runtime.control.endpoints import _connect, _serve_on, release_endpoint
from saguaro_ray.runtime.control.sockets import _DATA, _HELLO, SocketOwner, _Drops, _sock
from saguaro_ray.runtime.replay import ReplayGuard, Sender
from saguaro_ray.runtime.wire import MALFORMED, BadFrame, FrameCodec, unpack_payload


class Broadcaster(SocketOwner):
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



class Subscriber(SocketOwner):
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



_REJECTED = object()
