"""Which tensors of a worker call travel over the data plane, and to whom.

:class:`ActorLogic` is what a worker actor's :class:`CommandServer` serves:
the worker logic's own methods, unchanged, with the tensors moved around
them. A proposal's q rows (only a lossy fuzzy PyramidSD stage reads them: the
drafter-invariant rule compares tokens) leave a draft or the qualifier over
the data plane straight for the worker that checks them — the qualifier, or
the target — and only a :class:`TensorRef` rides the control frame through the
coordinator; a hit's KV delta goes from the owning draft to its peers the
same way (:class:`KVDeltaRef`). On the receiving side, references in a call's
arguments are fetched before the logic runs.

A verification may carry a ``forward``: the SSD round's cache lookup, which
this worker places on each draft's command socket (:class:`CallForwarder`)
with the real outcomes as soon as verification ends, instead of the
coordinator doing it after the result has reached it — the drafts answer the
coordinator directly.

Until :meth:`ActorLogic.join_data_plane` succeeds (or when the engine runs
without a data plane) tensors simply ride the frames. A reference that cannot
be fetched raises :class:`TransferLost`; the round loop then re-sends the call
self-contained.
"""

from __future__ import annotations

import logging
from typing import Any

from saguaro_ray.runtime.control import CallForwarder, ControlError
from saguaro_ray.runtime.data_plane import DataPlane, discard_refs, offload_kv, offload_q, resolve

log = logging.getLogger(__name__)

RECV_TIMEOUT_S = 10.0  # a reference's tensor must arrive within this, or the call is re-sent without it


class ActorLogic:
    """A worker's logic object behind the data plane (see the module doc)."""

    def __init__(
        self, logic: Any, key: bytes, device: str = "cpu", host: str | None = None, forwarder: CallForwarder | None = None
    ) -> None:
        self.logic = logic
        self._key = key  # the engine's: the data-plane store only answers it
        self.forwarder = forwarder
        self.device = device
        self.host = host  # the node address this worker's gloo sockets bind to
        self.plane: DataPlane | None = None
        self.q_dst: int | None = None  # rank that verifies this worker's proposals
        self.qualifier_dst: int | None = None  # rank that qualifies its PyramidSD proposals
        self.peers: list[int] = []  # ranks of the other drafts (KV deltas)

    # ------------------------------------------------------------ membership
    def join_data_plane(
        self, address: str, rank: int, world_size: int, generation: int, q_dst: int | None, peers: list[int], qualifier_dst: int | None = None
    ) -> dict[str, Any]:
        """Leave the current group (if any) and join ``generation``; blocks
        until all members joined and every pair has exchanged. ``q_dst``: the
        rank that verifies this worker's proposals; ``qualifier_dst``: the one
        that qualifies a draft's PyramidSD proposals (:meth:`propose_for_qualifier`).
        Returns ``{"rank", "backend", "note"}`` (``note``: why a CUDA group is
        not on NCCL; see :class:`~saguaro_ray.runtime.data_plane.status.PlaneStatus`)."""
        self.leave_data_plane()
        self.plane = DataPlane.join(address, self._key, rank, world_size, generation, self.device, gloo_host=self.host)
        self.q_dst, self.peers, self.qualifier_dst = q_dst, list(peers), qualifier_dst
        return {"rank": rank, "backend": self.plane.backend, "note": self.plane.backend_note}

    def leave_data_plane(self) -> None:
        if self.plane is not None:
            self.plane.flush(1.0)  # let receivers take what is in flight
            self.plane.close()
            self.plane = None

    def discard(self, refs: list[Any]) -> int:
        """Take the transfers of ``refs`` (q rows, KV deltas) the round loop
        will not use, so their senders can let them go; see :func:`discard_refs`."""
        return 0 if self.plane is None else discard_refs(refs, self.plane)

    # -------------------------------------------------------------- routing
    def _in(self, args: Any) -> Any:
        return args if self.plane is None else resolve(args, self.plane, RECV_TIMEOUT_S)

    def _out_q(self, value: Any, dst: int | None = None) -> Any:
        dst = self.q_dst if dst is None else dst
        if self.plane is None or dst is None:
            return value
        return offload_q(value, self.plane, dst)

    def ready(self, method: str, args: list) -> bool:
        """Can this call run now? The logic decides, if it has a say (a call
        forwarded by a peer may overtake the one it depends on; see
        :class:`CommandServer`); this side knows no method's arguments."""
        ready = getattr(self.logic, "ready", None)
        return True if ready is None else ready(method, args)

    def after_reply(self) -> Any:
        """The work the logic has left to do after the call just answered (or None)."""
        after_reply = getattr(self.logic, "after_reply", None)
        return after_reply() if after_reply is not None else None

    # --------------------------------------------------------- the protocol
    def prefill(self, steps: Any) -> Any:
        return self.logic.prefill(steps)

    def release(self, seq_ids: Any) -> Any:
        return self.logic.release(seq_ids)

    def verify(self, items: Any, forward: dict[str, Any] | None = None) -> Any:
        """Verify; with ``forward`` = ``{"method", "args", "to": [address, ...]}``
        (each from :meth:`CommandClient.address_for`) also send
        ``method(keys, *args)`` to each listed worker, ``keys`` being the
        lookup keys of the first ``forward["items"]`` outcomes (default: all;
        the rest of the batch is not the forwarded call's business)."""
        outcomes = self.logic.verify(self._in(items))
        if forward is not None:
            if self.forwarder is None:
                raise ValueError("this worker cannot forward calls (it has no forwarder)")
            args = [[o.key for o in outcomes[: forward.get("items", len(outcomes))]], *forward["args"]]
            for address in forward["to"]:
                try:
                    self.forwarder.call(address, forward["method"], args)
                except ControlError as e:  # the verification stands; that draft's lookup is lost (degradable)
                    log.warning("could not place %s: %s", forward["method"], e)
        return outcomes

    def qualify(self, items: Any) -> Any:
        return self._out_q(self.logic.qualify(self._in(items)))

    def propose(self, *args: Any) -> Any:
        return self._out_q(self.logic.propose(*args))

    def propose_for_qualifier(self, *args: Any) -> Any:
        """A PyramidSD proposal: its q rows go to the qualifier, which checks it
        (one engine runs PyramidSD and SD sequences side by side: each
        proposal's rows go to the worker that reads them)."""
        return self._out_q(self.logic.propose_for_qualifier(*args), self.qualifier_dst)

    def build(self, items: Any, round_id: int | None = None, ahead: bool = False) -> Any:
        return self.logic.build(self._in(items), round_id, ahead)

    def lookup(self, keys: Any, share_kv: bool = False, round_id: int | None = None, plans: Any = None) -> Any:
        out = self._out_q(self.logic.lookup(keys, share_kv, round_id, plans))
        if self.plane is not None and share_kv:
            out = offload_kv(out, self.plane, self.peers)
        return out
