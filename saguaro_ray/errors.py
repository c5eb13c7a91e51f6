"""Every exception type saguaro-ray raises, in one module.

Every error a user can cause (a bad path, an unsupported checkpoint, an
invalid sampling value, a prompt that does not fit) has its own type, so the
CLI can print a one-line message and exit 2 instead of a traceback, and
library callers can catch precisely what they expect. The runtime's own
failures (a worker lost, a frame refused, a call not delivered) are here too,
so a worker's exception can cross the control plane and be raised again as
itself: :func:`local_error` turns a :class:`RemoteError` naming one of these
types back into that type — the one place that mapping is made.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)


class SaguaroError(Exception):
    """Base class of every error raised for users of saguaro-ray."""


class ConfigError(SaguaroError, ValueError):
    """An invalid configuration or sampling value; the message names the field."""


class ServeAlreadyElsewhere(ConfigError):
    """Serve runs on the cluster with other HTTP options than the config's."""


class CheckpointError(SaguaroError):
    """A model directory is missing, incomplete or unreadable."""


class UnsupportedArchitectureError(CheckpointError):
    """A checkpoint's ``model_type`` (or one of its options) is not supported."""


class PromptTooLongError(SaguaroError, ValueError):
    """A prompt (plus the requested generation) does not fit the context window."""


class OutOfKVBlocksError(SaguaroError, RuntimeError):
    """The paged KV cache has no free block left for a sequence."""


class IncompatibleModelsError(SaguaroError):
    """A draft/qualifier does not share the target's vocabulary or tokenizer."""


class RequestAbortedError(SaguaroError, RuntimeError):
    """A request was aborted before it finished (its client went away, or
    ``abort(request_id)`` was called); its KV was freed on every worker."""


class EngineOverloadedError(SaguaroError, RuntimeError):
    """The engine's admission queue is full (``max_queued``); nothing of the
    request was queued — retry later (the HTTP server answers 429)."""


class DeadlineExceededError(SaguaroError, TimeoutError):
    """A request ran past its ``deadline_s`` (queueing included) and was
    aborted; its KV was freed on every worker."""


# ---------------------------------------------------------------- workers and the round loop


class NeedsPrefillError(SaguaroError, RuntimeError):
    """A worker was asked to continue a sequence it does not hold (e.g. after a
    restart); the caller re-sends the whole history from position 0."""


class WorkerLost(SaguaroError, RuntimeError):
    """A worker's process died or was restarted mid-call: its KV state is gone.
    The caller recovers the worker and re-sends full histories."""


class WorkerGone(SaguaroError, RuntimeError):
    """A worker cannot be brought back (restarts exhausted); requests that need
    it fail with this error."""


# ---------------------------------------------------------------- the data plane


class DataPlaneError(SaguaroError, RuntimeError):
    """The data plane cannot be built or used as asked (the message says why)."""


class JoinTimeout(DataPlaneError, TimeoutError):
    """Not every member joined a data-plane generation in time, or its
    rendezvous store did not answer."""


class TransferLost(SaguaroError, RuntimeError):
    """A tensor a call refers to (q rows, a KV delta) never arrived over the
    data plane: its sender is gone, the group was rebuilt (the reference is
    from an older generation), or it did not come in time. The round loop
    then re-sends the call self-contained (without data-plane references).

    One class for both ends: the data plane raises it naming the transfer
    (``src``, ``tag``; see :meth:`for_transfer`); a worker's TransferLost
    reaches the coordinator over the control plane as its message alone, so
    there ``src`` and ``tag`` are None. A timed-out receive stays posted:
    retrying the same transfer later still gets it if it arrives.
    """

    def __init__(self, message: str, *, src: int | None = None, tag: int | None = None) -> None:
        super().__init__(message)
        self.src, self.tag = src, tag

    @classmethod
    def for_transfer(cls, src: int, tag: int, reason: str) -> TransferLost:
        """Transfer ``tag`` from rank ``src`` is lost, because ``reason``."""
        return cls(f"data-plane transfer from rank {src} (tag {tag}) lost: {reason}", src=src, tag=tag)


# ---------------------------------------------------------------- the wire

BAD_MAC = "bad mac"
MALFORMED = "malformed"
UNKNOWN_TYPE = "unknown type"
BAD_TENSOR = "bad tensor"
REPLAYED = "replayed"  # a sequence number already accepted, or older than the receiver's window
MISADDRESSED = "misaddressed"  # for another recipient, or from a sender the receiver does not accept
REASONS = (BAD_MAC, MALFORMED, UNKNOWN_TYPE, BAD_TENSOR, REPLAYED, MISADDRESSED)


class BadFrame(SaguaroError, ValueError):
    """A received frame is unauthenticated or cannot be decoded; never act on it.

    ``reason`` is one of ``"bad mac"``, ``"malformed"``, ``"unknown type"``,
    ``"bad tensor"``, ``"replayed"``, ``"misaddressed"`` (what the drop
    counters are keyed by); ``detail`` says more.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"BadFrame reason must be one of {REASONS}, got {reason!r}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)

    def __reduce__(self) -> tuple:
        return (BadFrame, (self.reason, self.detail))


class EncodeError(SaguaroError, TypeError):
    """An object cannot be sent: its type is not wire-safe (register the
    dataclass with :func:`saguaro_ray.runtime.wire.register`, or convert it)."""


# ---------------------------------------------------------------- the control plane


class ControlError(SaguaroError, RuntimeError):
    """The control plane could not deliver a call or a message."""


class RemoteError(ControlError):
    """A worker method raised; ``type_name`` is the remote exception's class name."""

    def __init__(self, type_name: str, message: str, worker: str = "", remote_traceback: str = "") -> None:
        self.type_name = type_name
        self.message = message
        self.worker = worker
        self.remote_traceback = remote_traceback
        where = f"worker {worker!r} raised " if worker else ""
        super().__init__(f"{where}{type_name}: {message}")

    def __reduce__(self) -> tuple:
        return (RemoteError, (self.type_name, self.message, self.worker, self.remote_traceback))


class WorkerTimeout(ControlError, TimeoutError):
    """A worker did not answer a call within its timeout (the call may still run there)."""


class ClientClosed(ControlError):
    """The command client was closed before the call was answered."""


class SubscriberTimeout(ControlError, TimeoutError):
    """Fewer subscribers than required joined a broadcast in time."""


# ---------------------------------------------------------------- a worker's errors, raised here

# Errors about delivering the call itself: raised by a worker they describe the
# worker's side of the wire (e.g. a reply it could not encode), not anything
# the caller did, so they stay RemoteError instead of posing as local ones.
_DELIVERY_ERRORS = (ControlError, BadFrame, EncodeError)


@functools.cache
def _by_name() -> dict[str, type[SaguaroError]]:
    """This module's exception types by class name (built on first use, so
    every section of the module is in it)."""
    return {
        obj.__name__: obj
        for obj in globals().values()
        if isinstance(obj, type) and issubclass(obj, SaguaroError) and not issubclass(obj, _DELIVERY_ERRORS)
    }


def local_error(remote: RemoteError) -> BaseException:
    """The exception to raise for a worker's error: the project type it names,
    built from its message with ``remote`` as its ``__cause__`` (so a round
    loop catches over the wire what it catches in process), or ``remote``
    itself for any other type (a ``KeyError``, a ``MethodNotAllowed``, a
    delivery error).

    A type whose constructor needs more than a message (a transfer's source
    and tag) is raised as its nearest base that takes one, below
    :class:`SaguaroError` — still what the caller catches — or, if none
    does, as ``remote``."""
    cls = _by_name().get(remote.type_name)
    if cls is None:
        return remote
    for base in cls.__mro__:
        if base is SaguaroError and cls is not SaguaroError:
            break
        if not issubclass(base, SaguaroError) or issubclass(base, _DELIVERY_ERRORS):
            continue
        try:
            err = base(remote.message)
        except Exception:
            continue
        err.__cause__ = remote
        return err
    log.warning("cannot build %s(%r) from %s's error; raising RemoteError", cls.__name__, remote.message, remote.worker or "a worker")
    return remote
