"""A draft's KV delta as one transfer.

A round's KV delta is a (K, V) pair per layer. Sent as is, that is
2 · layers transfers per peer, each with its own tag, waiter and memo entry;
packed into one ``[layers, 2, n, Hkv, D]`` tensor it is one transfer per
peer, described by one :class:`~saguaro_ray.runtime.data_plane.refs.KVDeltaRef`
that every receiver can be handed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from saguaro_ray.runtime.data_plane.dtypes import dtype_name
from saguaro_ray.runtime.data_plane.group import DataPlane
from saguaro_ray.runtime.data_plane.refs import KVDeltaRef, Resolver


def pack_kv(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per-layer ``(K, V)``, each ``[n, Hkv, D]``, as one fresh contiguous
    ``[layers, 2, n, Hkv, D]`` tensor (one transfer instead of 2·layers)."""
    if not kv:
        raise ValueError("a KV delta needs at least one layer")
    flat = [t for pair in kv for t in pair]
    if len(flat) != 2 * len(kv) or len({(tuple(t.shape), t.dtype, t.device) for t in flat}) != 1 or flat[0].dim() != 3:
        raise ValueError("every layer's K and V must be [n, Hkv, D] tensors of one shape, dtype and device")
    return torch.stack([torch.stack((k.detach(), v.detach())) for k, v in kv])


def unpack_kv(packed: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`pack_kv` (views into ``packed``)."""
    return [(layer[0], layer[1]) for layer in packed.unbind(0)]


def send_kv(plane: DataPlane, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], dsts: Iterable[int]) -> KVDeltaRef:
    """Send a KV delta to every rank in ``dsts``; returns its descriptor (one
    for all receivers). Never blocks."""
    packed = pack_kv(kv)
    dsts = list(dict.fromkeys(dsts))
    tags = tuple((d, plane.send(packed, d)) for d in dsts) if packed.numel() else ()
    return KVDeltaRef(plane.rank, tags, tuple(packed.shape), dtype_name(packed.dtype), plane.generation)


def recv_kv(plane: DataPlane, ref: KVDeltaRef, timeout_s: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer ``(K, V)`` a :class:`KVDeltaRef` describes, on
    ``plane.device``; :class:`TransferLost` if it does not arrive."""
    return unpack_kv(Resolver(plane, timeout_s).kv(ref))

