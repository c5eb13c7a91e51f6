"""The data plane: tensors between workers over a torch.distributed group.

Control frames (ZeroMQ + msgpack) carry small things; the per-round tensors
— a proposal's q rows at T > 0, a draft's KV delta for its peers — travel
worker-to-worker over point-to-point sends in a process group, and the
control frames carry only small, wire-safe descriptors of them.

One module per concept:

* :mod:`.store` — the closed rendezvous: :class:`DataPlaneStore` (hosted by
  the coordinator) and :class:`StoreClient` (a ``torch.distributed.Store``
  whose every operation is an authenticated call with the engine's key);
* :mod:`.rendezvous` — forming one generation of the group over that store;
* :mod:`.group` — :class:`DataPlane`, one member's sends and receives, and
  the gloo behaviours they work around;
* :mod:`.refs` — :class:`TensorRef` / :class:`KVDeltaRef`, the descriptors,
  and fetching what they describe;
* :mod:`.kv_pack` — a KV delta as one transfer;
* :mod:`.walkers` — swapping tensors in a call's arguments for descriptors
  and back (what the worker transport uses);
* :mod:`.dtypes` — the dtype names descriptors carry.

The names below are re-exported so ``saguaro_ray.runtime.data_plane`` stays
the one import path for users of the data plane.
"""

from saguaro_ray.errors import DataPlaneError, JoinTimeout, TransferLost
from saguaro_ray.runtime.data_plane.group import DataPlane
from saguaro_ray.runtime.data_plane.kv_pack import pack_kv, recv_kv, send_kv, unpack_kv
from saguaro_ray.runtime.data_plane.refs import KVDeltaRef, TensorRef
from saguaro_ray.runtime.data_plane.store import DataPlaneStore, StoreClient
from saguaro_ray.runtime.data_plane.walkers import discard_refs, offload_kv, offload_q, resolve

__all__ = [
    "DataPlane",
    "DataPlaneError",
    "DataPlaneStore",
    "JoinTimeout",
    "KVDeltaRef",
    "TensorRef",
    "TransferLost",
    "discard_refs",
    "offload_kv",
    "offload_q",
    "pack_kv",
    "recv_kv",
    "resolve",
    "send_kv",
    "StoreClient",
    "unpack_kv",
]
