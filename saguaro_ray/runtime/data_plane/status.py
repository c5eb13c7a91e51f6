"""What an engine's data plane runs on, and why not on NCCL when it should.

The coordinator forms the group and keeps one :class:`PlaneStatus`; it is
what ``engine.metrics()`` reports (``data_plane_backend``,
``data_plane_error``, ``data_plane_generation``), what Serve's ``/health``
shows, and what a device check fails on (:func:`fallback_cause`). A plane
that falls back stays correct — gloo stages tensors through host memory,
the control plane carries them in frames — only slower, which is why it
must be said rather than found in a benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlaneStatus:
    """``backend``: ``"nccl"`` | ``"gloo"`` | ``"control"`` (tensors ride the
    control frames); ``error``: why it is not the backend the devices call
    for (None: nothing fell back); ``generation``: the group's, 0 without one."""

    backend: str = "control"
    error: str | None = None
    generation: int = 0

    @classmethod
    def formed(cls, generation: int, joins: Sequence[dict[str, Any]]) -> PlaneStatus:
        """A generation every member joined; ``joins``: their answers
        (``{"backend", "note"}``, the same backend everywhere by construction)."""
        backends = sorted({str(j["backend"]) for j in joins})
        if len(backends) != 1:
            return cls("control", f"the members disagree on the backend ({backends})", 0)
        notes = sorted({j["note"] for j in joins if j.get("note")})
        return cls(backends[0], "; ".join(notes) or None, generation)

    @classmethod
    def failed(cls, generation: int, cause: BaseException | str) -> PlaneStatus:
        """Generation ``generation`` did not form: tensors ride the control frames."""
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        return cls("control", f"data plane generation {generation} did not form ({text}); tensors ride the control frames", 0)

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> PlaneStatus:
        """Back from ``engine.metrics()`` (what :meth:`metrics` wrote)."""
        return cls(
            str(metrics.get("data_plane_backend") or "control"),
            metrics.get("data_plane_error"),
            int(metrics.get("data_plane_generation") or 0),
        )

    def announcement(self, before: PlaneStatus) -> str | None:
        """The warning to log on going from ``before`` to this status: the
        cause when it is new — so a fallback is said once at start-up, not
        again at every rebuild that falls back the same way."""
        if self.error is None or self.error == before.error:
            return None
        return f"data plane: {self.error} (see metrics()['data_plane_error'])"

    def metrics(self) -> dict[str, Any]:
        return {"data_plane_backend": self.backend, "data_plane_error": self.error, "data_plane_generation": self.generation}

    def describe(self) -> dict[str, Any]:
        """The ``/health`` details."""
        return {"backend": self.backend, "error": self.error}


def fallback_cause(metrics: dict[str, Any]) -> str | None:
    """From ``engine.metrics()``: why the data plane is not what the devices
    call for, or None when it is (a device check fails on a non-None answer;
    an engine run without a data plane on purpose is no fallback)."""
    return metrics.get("data_plane_error")
