"""Exception types raised for users.

Every error a user can cause (a bad path, an unsupported checkpoint, an
invalid sampling value, a prompt that does not fit) has its own type, so the
CLI can print a one-line message and exit 2 instead of a traceback, and
library callers can catch precisely what they expect.
"""

from __future__ import annotations


class SaguaroError(Exception):
    """Base class of every error raised for users of saguaro-ray."""


class ConfigError(SaguaroError, ValueError):
    """An invalid configuration or sampling value; the message names the field."""


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
