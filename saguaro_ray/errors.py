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
