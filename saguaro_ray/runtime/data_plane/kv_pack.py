"""A draft's KV delta as one transfer.

A round's KV delta is a (K, V) pair per layer. Sent as is, that is
2 · layers transfers per peer, each with its own tag, waiter and memo entry;
packed into one ``[layers, 2, n, Hkv, D]`` tensor it is one transfer per
peer, described by one :class:`~saguaro_ray.runtime.data_plane.refs.KVDeltaRef`
that every receiver can be handed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from saguaro_ray.errors import TransferLost
from saguaro_ray.runtime.data_plane.dtypes import dtype_name
from saguaro_ray.runtime.data_plane.group import DataPlane
from saguaro_ray.runtime.data_plane.refs import KVDeltaRef, Resolver

log = logging.getLogger(__name__)


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
    for all receivers). Never blocks.

    A peer that is already gone (its socket closed: killed, restarting) is
    left out rather than failing the call that shares the delta — the
    delta is an optimisation for the peers, and one whose rank is not in the
    descriptor gets :class:`TransferLost` if it ever asks for it, so its
    call is re-sent self-contained."""
    packed = pack_kv(kv)
    tags: list[tuple[int, int]] = []
    if packed.numel():  # an empty delta is sent to no one: its receivers make it themselves
        for d in dict.fromkeys(dsts):
            try:
                tags.append((d, plane.send(packed, d)))
            except TransferLost as e:
                log.info("KV delta not shared with rank %d: %s", d, e)
    return KVDeltaRef(plane.rank, tuple(tags), tuple(packed.shape), dtype_name(packed.dtype), plane.generation)


def recv_kv(plane: DataPlane, ref: KVDeltaRef, timeout_s: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer ``(K, V)`` a :class:`KVDeltaRef` describes, on
    ``plane.device``; :class:`TransferLost` if it does not arrive."""
    return unpack_kv(Resolver(plane, timeout_s).kv(ref))

