"""Descriptors of tensors on the data plane, and fetching what they describe.

A control frame never carries a data-plane tensor, only a small, wire-safe
descriptor of it: :class:`TensorRef` (rows of q) or :class:`KVDeltaRef` (a
packed KV delta). Both name the group generation their tags belong to, since
tags restart with every generation: a stale descriptor is refused
(:class:`TransferLost`), never resolved to another transfer's tensor.
:class:`Resolver` fetches what a set of descriptors needs, posting every
receive before awaiting any so that they travel in parallel.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from saguaro_ray.runtime import wire
from saguaro_ray.runtime.data_plane.dtypes import wire_dtype
from saguaro_ray.errors import DataPlaneError, TransferLost
from saguaro_ray.runtime.data_plane.group import DataPlane

Segment = tuple[int, int, int, int, int, int]  # (src, dst, tag, transfer_rows, start, rows)


@dataclass(frozen=True)
class TensorRef:
    """Rows of a 2-D tensor that travel over the data plane, not in a frame.

    ``segments``: ``(src, dst, tag, transfer_rows, start, rows)`` each — rows
    ``[start, start + rows)`` of transfer ``tag`` sent by rank ``src`` to rank
    ``dst`` (a ``[transfer_rows, width]`` tensor); the referenced tensor is
    the segments' rows in order. Slicing and :meth:`cat` only edit segments
    (the row limit lives in them), so a reference to several proposals'
    rows packed in one transfer stays one transfer. ``generation``: the
    group the tags belong to (tags restart with each generation; a stale
    reference is refused, never mis-resolved).
    """

    segments: tuple[Segment, ...]
    width: int
    dtype: str
    generation: int

    def __post_init__(self) -> None:
        segs = tuple(tuple(s) for s in self.segments)
        for s in segs:
            if len(s) != 6 or any(type(x) is not int for x in s):
                raise ValueError(f"a TensorRef segment is six ints (src, dst, tag, transfer_rows, start, rows), got {s!r}")
            _src, _dst, _tag, total, start, rows = s
            if min(s) < 0 or start + rows > total:
                raise ValueError(f"TensorRef segment {s!r} is out of range")
        if type(self.width) is not int or self.width < 0 or type(self.generation) is not int:
            raise ValueError(f"invalid TensorRef width/generation: {self.width!r}, {self.generation!r}")
        wire_dtype(self.dtype)
        object.__setattr__(self, "segments", segs)

    def __len__(self) -> int:
        return sum(s[5] for s in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.width)

    def __getitem__(self, index: slice) -> TensorRef:
        """Rows ``index`` (a slice with step 1), as a new reference."""
        if not isinstance(index, slice):
            raise TypeError("a TensorRef can only be sliced by rows (ref[a:b])")
        lo, hi, step = index.indices(len(self))
        if step != 1:
            raise ValueError("TensorRef slices must have step 1")
        out: list[Segment] = []
        pos = 0
        for src, dst, tag, total, start, rows in self.segments:
            a, b = max(lo, pos), min(hi, pos + rows)
            if a < b:
                out.append((src, dst, tag, total, start + a - pos, b - a))
            pos += rows
        return dataclasses.replace(self, segments=tuple(out))

    @staticmethod
    def cat(parts: Sequence[TensorRef]) -> TensorRef:
        """Concatenate references along rows (same width, dtype, generation)."""
        if not parts:
            raise ValueError("TensorRef.cat needs at least one part")
        first = parts[0]
        segs: list[Segment] = []
        for p in parts:
            if not isinstance(p, TensorRef):
                raise TypeError(f"TensorRef.cat takes references only, got {type(p).__name__}")
            if (p.width, p.dtype, p.generation) != (first.width, first.dtype, first.generation):
                raise ValueError("TensorRef.cat parts differ in width, dtype or generation")
            for s in p.segments:
                last = segs[-1] if segs else None
                if last is not None and last[:4] == s[:4] and last[4] + last[5] == s[4]:
                    segs[-1] = (*last[:5], last[5] + s[5])  # adjacent rows of one transfer
                else:
                    segs.append(s)
        return TensorRef(tuple(segs), first.width, first.dtype, first.generation)

    def resolve(self, plane: DataPlane, timeout_s: float) -> torch.Tensor:
        """The referenced rows, as a fresh tensor on ``plane.device``."""
        return Resolver(plane, timeout_s).tensor(self)


@dataclass(frozen=True)
class KVDeltaRef:
    """A draft's KV delta on the data plane: per-layer (K, V) rows packed as
    one ``shape = (layers, 2, n, Hkv, D)`` tensor sent by ``src`` to several
    peers; ``tags`` holds ``(dst, tag)`` per receiver, so one reference can be
    handed to every peer. ``n == 0`` sends nothing (``tags`` is empty)."""

    src: int
    tags: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    dtype: str
    generation: int

    def __post_init__(self) -> None:
        tags = tuple(tuple(t) for t in self.tags)
        shape = tuple(self.shape)
        if any(len(t) != 2 or any(type(x) is not int or x < 0 for x in t) for t in tags):
            raise ValueError(f"KVDeltaRef tags are (dst, tag) int pairs, got {self.tags!r}")
        if len(shape) != 5 or shape[1] != 2 or any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"KVDeltaRef shape is (layers, 2, n, Hkv, D), got {self.shape!r}")
        if type(self.src) is not int or type(self.generation) is not int:
            raise ValueError("KVDeltaRef src and generation are ints")
        wire_dtype(self.dtype)
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "shape", shape)

    def tag_for(self, dst: int) -> int:
        for d, tag in self.tags:
            if d == dst:
                return tag
        # its sender left this rank out: it was unreachable then (see send_kv)
        raise TransferLost.for_transfer(self.src, -1, f"this KV delta was not sent to rank {dst} (sent to {[d for d, _ in self.tags]})")


wire.register(TensorRef)
wire.register(KVDeltaRef)


class Resolver:
    """Fetches the transfers a set of references needs: posts every receive
    first (they run in parallel), then collects, against one deadline; each
    transfer is fetched once per call, whatever the memo evicts meanwhile."""

    def __init__(self, plane: DataPlane, timeout_s: float) -> None:
        self.plane = plane
        self.deadline = time.monotonic() + timeout_s
        self.got: dict[tuple[int, int, int], torch.Tensor] = {}
        self.wanted: list[tuple[int, int, tuple[int, ...], str]] = []

    def _check(self, generation: int, src: int, dst: int, tag: int) -> None:
        p = self.plane
        if generation != p.generation:
            raise TransferLost.for_transfer(src, tag, f"the reference is from data-plane generation {generation}, this member is in {p.generation}")
        if p.rank not in (src, dst):
            raise DataPlaneError(f"transfer (tag {tag}) from rank {src} was sent to rank {dst}, not to this member (rank {p.rank})")

    def prefetch(self, src: int, dst: int, tag: int, shape: tuple[int, ...], dtype: str, generation: int) -> None:
        self._check(generation, src, dst, tag)
        if src != self.plane.rank:
            self.wanted.append((src, tag, shape, dtype))

    def post(self) -> None:
        """Post every wanted receive, in tag order per sender (NCCL needs it)."""
        for src, tag, shape, dtype in sorted(set(self.wanted), key=lambda w: (w[0], w[1])):
            self.plane.prefetch(src, tag, shape, dtype)
        self.wanted.clear()

    def fetch(self, src: int, dst: int, tag: int, shape: tuple[int, ...], dtype: str, generation: int) -> torch.Tensor:
        key = (src, dst, tag)
        t = self.got.get(key)
        if t is None:
            self._check(generation, src, dst, tag)
            p = self.plane
            if src == p.rank:
                t = p._own(dst, tag)
            else:
                p.prefetch(src, tag, shape, dtype)
                t = p._collect(src, tag, shape, wire_dtype(dtype), self.deadline)
            if tuple(t.shape) != shape:
                raise TransferLost.for_transfer(src, tag, f"holds {list(t.shape)}, the reference says {list(shape)}")
            self.got[key] = t
        return t

    def prefetch_ref(self, ref: TensorRef | KVDeltaRef) -> None:
        if isinstance(ref, TensorRef):
            for src, dst, tag, total, _, rows in ref.segments:
                if rows:
                    self.prefetch(src, dst, tag, (total, ref.width), ref.dtype, ref.generation)
        elif math.prod(ref.shape) and ref.src != self.plane.rank:
            self.prefetch(ref.src, self.plane.rank, ref.tag_for(self.plane.rank), ref.shape, ref.dtype, ref.generation)

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        rows = [
            self.fetch(src, dst, tag, (total, ref.width), ref.dtype, ref.generation)[start : start + n]
            for src, dst, tag, total, start, n in ref.segments
            if n
        ]
        dev = self.plane.device
        if not rows:
            return torch.empty((0, ref.width), dtype=wire_dtype(ref.dtype), device=dev)
        out = torch.cat(rows) if len(rows) > 1 else rows[0].clone()  # fresh: never alias the memo
        return out.to(dev)

    def kv(self, ref: KVDeltaRef) -> torch.Tensor:
        """The packed ``[layers, 2, n, Hkv, D]`` delta, fresh, on the plane's
        device (:func:`~saguaro_ray.runtime.data_plane.kv_pack.unpack_kv` splits it)."""
        if math.prod(ref.shape) == 0:  # nothing was sent
            packed = torch.empty(ref.shape, dtype=wire_dtype(ref.dtype), device=self.plane.device)
        elif ref.src == self.plane.rank:
            if not ref.tags:
                raise TransferLost.for_transfer(ref.src, -1, "this KV delta was sent to no one, so not even its sender kept it")
            dst, tag = ref.tags[0]
            packed = self.fetch(ref.src, dst, tag, ref.shape, ref.dtype, ref.generation)
        else:
            me = self.plane.rank
            packed = self.fetch(ref.src, me, ref.tag_for(me), ref.shape, ref.dtype, ref.generation)
        return packed.to(self.plane.device).clone()

