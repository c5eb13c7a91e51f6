"""Where control-plane sockets meet, and how they are secured.

Endpoints come from :func:`bind_endpoint`: ``tcp://HOST:PORT`` on an
ephemeral port, or an ``ipc://`` socket in a fresh private (0700) temp dir
when ``host`` is ``None`` (same node), released by the owner's ``close()``.
The dir's name carries the owner's pid, so a process that was killed before
it could close (a worker Ray restarted) leaves nothing for long: the next
process on the node to bind one removes the dirs of owners that are gone
(judged by pid, so this assumes that processes sharing a temp dir share a pid
namespace, as a Ray node's do).

:class:`EngineKey` is the engine's secret (HMAC key, and optionally a CURVE
keypair); :func:`_serve_on` and :func:`_connect` apply it to a binding or a
connecting socket.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import zmq

from saguaro_ray.errors import ControlError
from saguaro_ray.runtime.wire import new_key

log = logging.getLogger(__name__)

_IPC_PREFIX = "saguaro-zmq-"


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
