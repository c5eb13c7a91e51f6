"""The data plane's exceptions."""

from __future__ import annotations

from saguaro_ray.engine.transport import TransferLost as _TransferLostBase
from saguaro_ray.errors import SaguaroError


class DataPlaneError(SaguaroError, RuntimeError):
    """The data plane cannot be built or used as asked (the message says why)."""


class JoinTimeout(DataPlaneError, TimeoutError):
    """Not every member joined a data-plane generation in time."""


class TransferLost(_TransferLostBase):
    """A tensor never arrived: its sender is gone, the group was rebuilt (the
    reference is from an older generation), or it did not come in time.

    A subclass of the round loop's :class:`saguaro_ray.engine.transport.TransferLost`,
    so a call that raises it is retried self-contained. ``src``/``tag`` name
    the transfer. A timed-out receive stays posted: retrying the same
    transfer later still gets it if it arrives.
    """

    def __init__(self, src: int, tag: int, reason: str) -> None:
        self.src, self.tag, self.reason = src, tag, reason
        super().__init__(f"data-plane transfer from rank {src} (tag {tag}) lost: {reason}")

    def __reduce__(self) -> tuple:
        return (TransferLost, (self.src, self.tag, self.reason))
