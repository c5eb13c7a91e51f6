"""What every control-plane socket owner shares: the socket factory, the
poll bound, the drop counter (and :class:`SocketOwner`, which reports it)
and the protocol's fixed names.

The server, the client, the forwarder and the broadcast each own sockets
they make the same way (no linger, a frame size cap), poll with a timeout so
their loops notice ``close()``, and count the frames they refuse by reason;
those three things, and the names of the built-in calls and broadcast
prefixes both ends must agree on, live here once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, TypeVar

import zmq

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 1 << 30
METHOD_NOT_ALLOWED = "MethodNotAllowed"
# built-in calls every CommandServer answers
_PING = "__ping__"
_HELLO_CALL = "__hello__"
_STATS = "__stats__"
_SUBSCRIBE = "__subscribe__"
# broadcast frame prefixes
_DATA = b"D"  # broadcast topic prefix
_HELLO = b"H"  # subscription-handshake prefix



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


_Owner = TypeVar("_Owner", bound="SocketOwner")


class SocketOwner:
    """What every socket owner (server, client, broadcaster, subscriber) shows
    alike: the frames it dropped, by reason, and ``with`` closing it."""

    _drops: _Drops

    @property
    def dropped_frames(self) -> int:
        return self._drops.total

    @property
    def drop_reasons(self) -> dict[str, int]:
        return self._drops.reasons()

    def close(self) -> None:
        """Release the owner's sockets (each owner says how)."""
        raise NotImplementedError

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _poll_ms(poll_ms: int, deadline: float) -> int:
    """How long a loop may poll: ``poll_ms``, or less to wake by ``deadline`` (monotonic)."""
    return max(0, min(poll_ms, int((deadline - time.monotonic()) * 1000) + 1))


def _sock(kind: int, max_frame_bytes: int | None) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if max_frame_bytes:
        s.setsockopt(zmq.MAXMSGSIZE, int(max_frame_bytes))
    return s

