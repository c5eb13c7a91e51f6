"""The closed rendezvous: an authenticated key-value store for torch.distributed.

Members of a process group meet through a store: each writes its address
and reads its peers'. torch's ``TCPStore`` cannot be that store: its server
listens on every interface whatever host it is given, and it has no
authentication — any peer that reaches the port may list every key
(``list_keys``), read the members' addresses, or write its own. So the store
is a key-value table served over the control plane (:class:`DataPlaneStore`:
a :class:`~saguaro_ray.runtime.control.CommandServer` bound to the node
address, or an IPC socket in a private directory on one node) and each
member reaches it through :class:`StoreClient`, a ``torch.distributed.Store``
whose every operation is an authenticated, replay-protected call with the
engine's key.

What that guarantees: a peer without the key can neither read nor write a
rendezvous key, and nothing listens on an interface other than the one
given. What it does not: the gloo (or NCCL) connections the members then
open to each other carry tensors without authentication — torch offers
none — so they are bound to the node address Ray reports (see
:func:`~saguaro_ray.runtime.data_plane.rendezvous.join_group`), and an
attacker on that network who can connect to those ports could still disturb
transfers.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch.distributed as dist

from saguaro_ray.runtime.control import CommandClient, CommandServer, ControlError
from saguaro_ray.errors import JoinTimeout


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
    behind a :class:`~saguaro_ray.runtime.control.CommandServer` (see the
    module doc). ``host``: the node address to
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

    @classmethod
    def connect(cls, address: str, key: bytes, timeout_s: float, where: str) -> StoreClient:
        """A client whose first call has been answered: a store that never
        answers (or refuses ``key``) fails here with :class:`JoinTimeout`
        naming ``where``, not half-way through forming a group."""
        client = cls(address, key, timeout_s)
        try:
            client.num_keys()
        except JoinTimeout as e:
            client.close()
            raise JoinTimeout(f"{where}: cannot reach the rendezvous store within {timeout_s:g}s ({e})") from None
        return client

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

