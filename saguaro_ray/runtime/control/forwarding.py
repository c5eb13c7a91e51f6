"""Forwarded calls — DEALER (a worker, connects) → ROUTER (another worker).

A :class:`CallForwarder` lets a worker place a call on another worker's
command socket on the coordinator's behalf: the coordinator registers the
call (:meth:`CommandClient.expect`) and hands the worker the peer's
endpoint, its own client's routing id and the call id; the request names
that routing id as ``reply_to``, so the peer answers the coordinator as if
it had sent the call itself. The SSD target uses it to start the drafts'
cache lookups the moment verification ends. A forwarded call is addressed to
the peer server's id, which the coordinator hands over with the rest of the
call's address, and numbered by this forwarder.
"""

from __future__ import annotations

from typing import Any, Sequence

import zmq

from saguaro_ray.errors import ControlError
from saguaro_ray.runtime.control.endpoints import _connect
from saguaro_ray.runtime.control.sockets import DEFAULT_MAX_FRAME_BYTES, _sock
from saguaro_ray.runtime.replay import Sender
from saguaro_ray.runtime.wire import FrameCodec


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
