"""Swapping the tensors inside a call's arguments for data-plane references, and back.

A worker call's arguments are nested lists, tuples, dicts and message
dataclasses; the big tensors in them sit in two places only —
``Proposal.q`` and ``KVDelta.kv``. The sender's transport replaces those
by references before the frame goes out (:func:`offload_q`,
:func:`offload_kv`), and the receiver's transport replaces the references
by tensors before the call runs (:func:`resolve`), so neither the worker
logic nor the round loop ever sees a reference. Nothing here mutates the
caller's objects: a retried call passes the same objects again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from saguaro_ray.errors import TransferLost
from saguaro_ray.runtime.data_plane.dtypes import dtype_name
from saguaro_ray.runtime.data_plane.group import DataPlane
from saguaro_ray.runtime.data_plane.kv_pack import send_kv, unpack_kv
from saguaro_ray.runtime.data_plane.refs import KVDeltaRef, Resolver, TensorRef
from saguaro_ray.workers.messages import KVDelta, Proposal


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild ``value`` with ``leaf`` applied to every Proposal / KVDelta
    inside lists, tuples, dicts and dataclasses. Copies only what changes:
    the caller's objects are never mutated (a retry passes them again)."""
    if isinstance(value, (Proposal, KVDelta)):
        return leaf(value)
    t = type(value)
    if t is list or t is tuple:
        new = [_walk(x, leaf) for x in value]
        if all(a is b for a, b in zip(new, value)):
            return value
        return new if t is list else tuple(new)
    if t is dict:
        new_d = {k: _walk(v, leaf) for k, v in value.items()}
        return value if all(new_d[k] is value[k] for k in value) else new_d
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if f.init:
                old = getattr(value, f.name)
                new_v = _walk(old, leaf)
                if new_v is not old:
                    changes[f.name] = new_v
        return dataclasses.replace(value, **changes) if changes else value
    return value


def _collect(value: Any, kind: type) -> list[Any]:
    found: list[Any] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, kind):
            found.append(x)
        return x

    _walk(value, leaf)
    return found


def offload_q(value: Any, plane: DataPlane, dst: int) -> Any:
    """``value`` with every ``Proposal.q`` tensor replaced by a
    :class:`TensorRef`, the rows sent to ``dst``. All q rows of one dtype and
    width go as one packed transfer. ``value`` itself is not modified."""
    props = {id(p): p for p in _collect(value, Proposal) if isinstance(p.q, torch.Tensor)}
    if not props:
        return value
    groups: dict[tuple[str, int], list[Proposal]] = {}
    for p in props.values():
        if p.q.dim() != 2:
            raise ValueError(f"Proposal.q must be [len(tokens), V], got shape {list(p.q.shape)}")
        groups.setdefault((dtype_name(p.q.dtype), int(p.q.shape[1])), []).append(p)
    refs: dict[int, TensorRef] = {}
    for (dt, width), members in groups.items():
        total = sum(int(p.q.shape[0]) for p in members)
        try:
            tag = plane.send(torch.cat([p.q.detach() for p in members]), dst) if total else 0
        except TransferLost:  # ``dst`` is gone (restarting): the rows ride the frame, whoever verifies them next
            continue
        start = 0
        for p in members:
            n = int(p.q.shape[0])
            segs = ((plane.rank, dst, tag, total, start, n),) if n else ()
            refs[id(p)] = TensorRef(segs, width, dt, plane.generation)
            start += n
    return _walk(value, lambda x: dataclasses.replace(x, q=refs[id(x)]) if id(x) in refs else x)


def offload_kv(value: Any, plane: DataPlane, dsts: Iterable[int]) -> Any:
    """``value`` with every ``KVDelta.kv`` (per-layer (K, V) list) replaced
    by a :class:`KVDeltaRef` sent to each rank in ``dsts``. With no other
    rank to send to, ``value`` is returned as is (the tensors, if anyone
    needs them, ride the control frame)."""
    dsts = [d for d in dsts if d != plane.rank]
    exts = {id(e): e for e in _collect(value, KVDelta) if isinstance(e.kv, (list, tuple)) and e.kv}
    if not exts or not dsts:
        return value
    refs = {i: send_kv(plane, e.kv, dsts) for i, e in exts.items()}
    return _walk(value, lambda x: dataclasses.replace(x, kv=refs[id(x)]) if id(x) in refs else x)


def resolve(value: Any, plane: DataPlane, timeout_s: float) -> Any:
    """``value`` with every :class:`TensorRef` in a ``Proposal.q`` and every
    :class:`KVDeltaRef` in an ``KVDelta.kv`` replaced by the tensors they
    describe (fresh tensors on ``plane.device``). Every receive is posted
    before any is awaited; all must arrive within ``timeout_s`` in total, or
    :class:`TransferLost`. Resolving the same references again (a retried
    call) is served from the memo. ``value`` itself is not modified."""
    refs: list[Any] = []

    def gather(x: Any) -> Any:
        r = x.q if isinstance(x, Proposal) else x.kv
        if isinstance(r, (TensorRef, KVDeltaRef)):
            refs.append(r)
        return x

    _walk(value, gather)
    if not refs:
        return value
    res = Resolver(plane, timeout_s)
    for r in refs:
        res.prefetch_ref(r)
    res.post()

    def leaf(x: Any) -> Any:
        if isinstance(x, Proposal) and isinstance(x.q, TensorRef):
            return dataclasses.replace(x, q=res.tensor(x.q))
        if isinstance(x, KVDelta) and isinstance(x.kv, KVDeltaRef):
            return dataclasses.replace(x, kv=unpack_kv(res.kv(x.kv)))
        return x

    return _walk(value, leaf)



def discard_refs(refs: Iterable[TensorRef | KVDeltaRef], plane: DataPlane) -> int:
    """Take, without waiting, every transfer in ``refs`` sent to this member
    that the caller will never resolve (a speculation nobody verifies): an
    unreceived send keeps its tensor and a waiter thread on the sender until
    the group closes. References of another generation are skipped (their
    group is gone, and its sends with it). Returns how many transfers."""
    wanted: dict[tuple[int, int], tuple[tuple[int, ...], str]] = {}  # (src, tag) → (shape, dtype)
    for ref in refs:
        if ref.generation != plane.generation:
            continue
        if isinstance(ref, TensorRef):
            for src, dst, tag, total, _, _ in ref.segments:
                if dst == plane.rank:
                    wanted[(src, tag)] = ((total, ref.width), ref.dtype)
        else:
            wanted.update({(ref.src, tag): (ref.shape, ref.dtype) for dst, tag in ref.tags if dst == plane.rank})
    for (src, tag), (shape, dtype) in wanted.items():
        plane.discard(src, tag, shape, dtype)
    return len(wanted)
