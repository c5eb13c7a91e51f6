"""Replay protection for control frames: which stamped frames are fresh.

The HMAC (:mod:`saguaro_ray.runtime.wire`) proves a frame came from a key
holder, not that it is new: a frame captured on a worker's socket and sent
again would run again (a replayed verification rolls back the target's KV).
So every frame carries a :class:`~saguaro_ray.runtime.wire.Stamp` under the
MAC — sender id, sequence number, recipient — and every receiver keeps a
:class:`ReplayGuard`:

* **Recipient.** A frame names the receiver instance it is for: a command
  server's random id (a restarted worker has a new one, so nothing captured
  before the restart is accepted after it), a command client's reply routing
  id, or ``b""`` for a broadcast (whose senders are introduced instead, see
  below). Anything else is ``"misaddressed"``.
* **Sender epoch.** Each sending endpoint (a client, a server's replies, a
  forwarder, a broadcaster) draws a random 16-byte id when it is created and
  numbers its frames 1, 2, ...; a restarted process is a new sender, so its
  frames are accepted from 1 while the old epoch's are not (they were for
  the old recipient, or are below the introduced floor).
* **Window.** Per sender, the receiver remembers the highest number seen and
  which of the :data:`WINDOW` numbers below it have arrived: a number seen
  before, or older than the window, is ``"replayed"``. A window, not a strict
  "greater than the last": submitters on several threads number frames
  before they reach the socket, so one connection may deliver 7 before 6.
  ZeroMQ keeps each connection's order, so real reordering is a handful of
  frames; 4096 is far beyond it.

Who may be a sender. A command server accepts any sender that addresses it
by its id — only key holders who learnt the id after it was created can
(the id is no secret: its freshness is what matters). A client accepts
replies only from the server it shook hands with; a broadcast subscriber only
from the broadcaster it was introduced to, above the sequence number that
broadcaster had reached at the introduction (which itself arrived as a fresh
command). Per receiver at most :data:`MAX_SENDERS` senders are remembered,
least recently heard-from first out: legitimate senders are a handful per
worker lifetime (a coordinator's client, one forwarder per target restart),
and no one without the key can add one.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

from saguaro_ray.runtime.wire import MISADDRESSED, REPLAYED, SENDER_ID_BYTES, BadFrame, Stamp

__all__ = ["MAX_SENDERS", "WINDOW", "ReplayGuard", "Sender"]

WINDOW = 4096
MAX_SENDERS = 1024
_MASK = (1 << WINDOW) - 1


class Sender:
    """One sending endpoint: a fresh random id and a thread-safe frame counter."""

    def __init__(self) -> None:
        self.id = secrets.token_bytes(SENDER_ID_BYTES)
        self._lock = threading.Lock()
        self._last = 0

    def stamp(self, to: bytes = b"") -> Stamp:
        """The next stamp for a frame to ``to``."""
        with self._lock:
            self._last += 1
            return Stamp(self.id, self._last, to)

    @property
    def last(self) -> int:
        """The highest sequence number handed out so far (0: none)."""
        with self._lock:
            return self._last


class _Window:
    """Sequence numbers seen from one sender: the highest, and a bitmap of the
    :data:`WINDOW` below it (bit i: ``top - i`` has arrived)."""

    __slots__ = ("bits", "top")

    def __init__(self, top: int, bits: int) -> None:
        self.top, self.bits = top, bits

    def admit(self, seq: int) -> None:
        if seq > self.top:
            shift = seq - self.top
            self.bits = ((self.bits << shift) | 1) & _MASK if shift < WINDOW else 1
            self.top = seq
            return
        back = self.top - seq
        if back >= WINDOW:
            raise BadFrame(REPLAYED, f"sequence number {seq} is older than the window (latest {self.top})")
        if self.bits >> back & 1:
            raise BadFrame(REPLAYED, f"sequence number {seq} was already received")
        self.bits |= 1 << back


class ReplayGuard:
    """A receiver's freshness check (see the module doc).

    ``me``: the recipient id frames must name. ``open_door``: accept frames
    from senders never seen before (a command server); otherwise only from
    senders :meth:`introduce`\\ d. Thread-safe.
    """

    def __init__(self, me: bytes, *, open_door: bool) -> None:
        self.me = me
        self._open_door = open_door
        self._lock = threading.Lock()
        self._windows: OrderedDict[bytes, _Window] = OrderedDict()

    def introduce(self, sender: bytes, after: int) -> None:
        """Accept ``sender``'s frames numbered above ``after`` (and none at or below it)."""
        with self._lock:
            self._windows[sender] = _Window(after, _MASK)
            self._bound()

    def admit(self, stamp: Stamp) -> None:
        """Return if the frame is fresh (and remember it); raise :class:`BadFrame` if not."""
        if stamp.to != self.me:
            raise BadFrame(MISADDRESSED, "the frame is addressed to another recipient")
        with self._lock:
            w = self._windows.get(stamp.sender)
            if w is None:
                if not self._open_door:
                    raise BadFrame(MISADDRESSED, "the frame comes from a sender this receiver was not introduced to")
                self._windows[stamp.sender] = _Window(stamp.seq, 1)
                self._bound()
                return
            self._windows.move_to_end(stamp.sender)
            w.admit(stamp.seq)

    def _bound(self) -> None:
        while len(self._windows) > MAX_SENDERS:
            self._windows.popitem(last=False)
