"""OpenAI-compatible request bodies, error bodies and response builders.

Request models check *types* and sizes (stop sequences, the ``timeout``
extension); values (temperature, top_p, max_tokens, seed ...) are validated by
:class:`~saguaro_ray.config.SamplingParams` — against what the engine and its
wire can carry — so the HTTP server rejects exactly what the CLI and the
Python API reject, with the same message. Types are strict, as OpenAI's
are (``n: true``, ``stream: "yes"``, ``temperature: "0.5"`` are 400s naming
the field; an integer is a number); a chat message's role is one of OpenAI's
and a null content is refused (OpenAI allows one only next to ``tool_calls``,
which are refused like ``tools``). Unknown fields are ignored (clients send ``user`` and the like);
fields that would change the output in ways the engine cannot honour
(``echo``, ``best_of > 1``, tools) are refused with a 400 rather than
silently dropped. The penalties and ``logit_bias`` are honoured exactly
(``repetition_penalty`` is an extension, vLLM's name); their values are
SamplingParams' to check, like every other sampling value. Logprobs:
completions' ``logprobs: N``, chat's ``logprobs: true`` with ``top_logprobs:
N``, and the ``logprobs_mode`` extension (``raw`` | ``processed``, see
:mod:`saguaro_ray.algorithms.logprobs`).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from saguaro_ray.config import Strategy
from saguaro_ray.engine.sequence import strategy_totals
from saguaro_ray.errors import (
    ConfigError,
    DeadlineExceededError,
    EngineOverloadedError,
    OutOfKVBlocksError,
    PromptTooLongError,
    RequestAbortedError,
)


class APIError(Exception):
    """An error answered with an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# fields a ConfigError message starts with -> the request parameter to blame
_PARAM_OF = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "max_tokens": "max_tokens",
    "seed": "seed",
    "logprobs_mode": "logprobs_mode",
    "logprobs": "logprobs",
    "n must": "n",
    "speculation.mode": "speculation.mode",
    "speculation.k": "speculation.k",
    "speculation": "speculation",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "prompt": "prompt",
    "response_format": "response_format",
}


def api_error_from(exc: BaseException, prompt_param: str = "prompt") -> APIError:
    """Map an engine/config exception to the HTTP error a client sees.

    Only errors the *request* caused are 4xx (a bad value, a prompt that does
    not fit, a request too large for the KV cache). Anything the engine side
    did is 5xx ``server_error``: a worker or coordinator that is gone is 503
    (retry elsewhere: Serve replaces the replica once ``/health`` says so),
    anything else 500 — a client must never be told to fix a request that
    was fine.
    """
    from ray.exceptions import RayActorError

    from saguaro_ray.engine.transport import WorkerGone, WorkerLost

    if isinstance(exc, APIError):
        return exc
    msg = str(exc)
    if isinstance(exc, PromptTooLongError):
        return APIError(400, msg, param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, ConfigError):
        param = next((p for key, p in _PARAM_OF.items() if msg.startswith(key)), None)
        if param == "prompt":
            param = prompt_param
        return APIError(400, msg, param=param, code="invalid_value")
    if isinstance(exc, OutOfKVBlocksError):  # the request can never fit this deployment
        return APIError(400, msg, code="request_too_large")
    if isinstance(exc, (WorkerGone, WorkerLost, RayActorError)):
        return engine_unavailable(f"the engine cannot serve: {type(exc).__name__}: {msg}")
    if isinstance(exc, EngineOverloadedError):  # the engine's admission queue is full
        return too_many_requests_message(msg, RETRY_AFTER_S)
    if isinstance(exc, DeadlineExceededError):
        return APIError(504, msg, type="server_error", code="timeout")
    if isinstance(exc, RequestAbortedError):  # aborted on the engine side, not by this client
        return APIError(503, msg, type="server_error", code="aborted")
    return APIError(500, f"internal error: {type(exc).__name__}: {msg}", type="server_error", code="internal_error")


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")


def deadline_passed() -> APIError:
    """A request still running at its deadline (``request_timeout_s`` or its ``timeout``)."""
    return APIError(504, "the request did not finish within its timeout", type="server_error", code="timeout")


RETRY_AFTER_S = 1  # what a refused client is told to wait


def too_many_requests(limit: int, retry_after_s: int) -> APIError:
    """The replica's own bound is reached (see :func:`too_many_requests_message`)."""
    return too_many_requests_message(f"this replica is running its limit of {limit} requests; retry after {retry_after_s} s", retry_after_s)


def too_many_requests_message(message: str, retry_after_s: int) -> APIError:
    """OpenAI's rate-limit shape (the official client raises ``RateLimitError``
    and honours ``Retry-After``)."""
    return APIError(429, message, type="requests", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


# ------------------------------------------------------------------ requests

StopT = str | list[str] | None


# strict: no coercion (``true`` is not 1, ``"yes"`` not true, ``"0.5"`` not a
# number), as the OpenAI API refuses them; JSON integers still fill float fields
STRICT_BODY = ConfigDict(extra="allow", strict=True)


class _Common(BaseModel):
    model_config = STRICT_BODY

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM-style)
    seed: int | None = None
    stop: StopT = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # extension
    # extension: the request's strategy ({"mode", "k"} or a mode name), checked by Strategy.of (its messages name the field)
    speculation: Any = None
    timeout: float | None = None  # extension: seconds before the request fails with 504 (capped by the deployment)
    logprobs: Any = None  # completions: N alternatives; chat: a boolean (N is top_logprobs)
    logprobs_mode: str | None = None  # extension: "raw" (the default) or "processed"
    # structured output: OpenAI's chat field, an extension on completions; checked by ResponseFormat.of and the Frontend
    response_format: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM's name): 1 = off
    logit_bias: dict[str, Any] | None = None  # OpenAI's {"token id": bias in [-100, 100]}, checked by SamplingParams
    user: str | None = None

    LOGPROBS_PARAM: ClassVar[str] = "logprobs"  # the field that says how many alternatives

    def refuse_unsupported(self) -> None:
        """Refuse (400) the fields the engine cannot honour: each route its own;
        every field both share is honoured."""

    def logprobs_count(self) -> Any:
        """Alternatives per token the request asks for (None: no logprobs);
        its value is checked by SamplingParams (``false`` means none, as before)."""
        return None if self.logprobs is False else self.logprobs

    def stop_list(self, limit: int, max_chars: int) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > limit:
            raise APIError(400, f"stop takes at most {limit} sequences, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop sequences must be non-empty strings", param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > max_chars:
            raise APIError(400, f"stop sequences may be at most {max_chars} characters, got {longest}", param="stop")
        return stops

    def timeout_s(self, limit: float) -> float:
        """Seconds this request may run: the ``timeout`` extension, at most the deployment's limit."""
        t = self.timeout
        if t is None:
            return limit
        if not math.isfinite(t) or t <= 0:
            raise APIError(400, f"timeout must be a finite number of seconds > 0, got {t!r}", param="timeout")
        return min(t, limit)

    def strategy(self) -> Strategy | None:
        """The ``speculation`` extension as the request's :class:`Strategy`
        (None: the deployment's default); a malformed one is a 400 naming the field."""
        try:
            return Strategy.of(self.speculation)
        except ConfigError as exc:
            raise api_error_from(exc) from None

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of", code="unsupported")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one prompt as token ids
        return list(p)  # several prompts (strings or token-id lists)


# the roles the OpenAI API accepts (it refuses any other with a 400 naming messages[i].role)
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = STRICT_BODY

    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def tool_field(self) -> str | None:
        """The tool-call field this message carries (None: none): OpenAI's
        reason a content may be null, and a history the engine cannot render."""
        extra = self.model_extra or {}
        return next((f for f in ("tool_calls", "function_call") if extra.get(f)), None)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"message content parts of type {part.get('type')!r} are not supported; send text", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    tools: list[Any] | None = None
    tool_choice: Any = None
    top_logprobs: Any = None

    LOGPROBS_PARAM: ClassVar[str] = "top_logprobs"

    def check_messages(self) -> None:
        """A message without content is a 400 naming it (OpenAI allows a null
        content only next to ``tool_calls``, which, like ``tools``, the engine
        cannot honour: refused naming them)."""
        for i, m in enumerate(self.messages):
            tool_field = m.tool_field()
            if tool_field is not None:
                raise APIError(400, f"{tool_field} in messages are not supported", param=f"messages[{i}].{tool_field}", code="unsupported")
            if m.content is None:
                raise APIError(
                    400,
                    f"messages[{i}].content: a {m.role} message needs content (a string or text parts), got null",
                    param=f"messages[{i}].content",
                    code="invalid_value",
                )

    def logprobs_count(self) -> Any:
        if self.logprobs is not None and type(self.logprobs) is not bool:
            raise APIError(400, f"logprobs must be a boolean, got {self.logprobs!r}", param="logprobs")
        if self.logprobs is not True:
            if self.top_logprobs not in (None, 0):
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools", code="unsupported")


# ------------------------------------------------------------------ responses


def prompt_field(route: str) -> str:
    """The request field an error about a route's prompt names."""
    return "messages" if route == "chat" else "prompt"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def saguaro_summary(strategy: Strategy, default: str, stats: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The ``saguaro`` extension of a response: the request's strategy as
    the engine resolved it (``mode``, ``k``: its K, the largest ``auto`` may
    pick), the engine's default (``default_mode``), and the round statistics
    aggregated over the choices (``None`` where unknown): ``strategy`` the
    rounds run in each mode, ``mean_k`` the mean K of the speculative rounds."""
    known = [s for s in stats if s]
    rounds = sum(int(s.get("rounds") or 0) for s in known) if known else None
    per_mode, k_total, k_rounds = strategy_totals(known)
    return {
        "mode": strategy.mode,
        "k": strategy.k,
        "default_mode": default,
        "rounds": rounds,
        "strategy": per_mode if any(s.get("strategy") is not None for s in known) else None,
        "mean_k": k_total / k_rounds if k_rounds else None,
        "mean_accepted": _mean(s.get("mean_accepted") for s in known),
        "cache_hit_rate": _mean(s.get("cache_hit_rate") for s in known),
        "lossy": any(bool(s.get("lossy")) for s in known),
        "seconds": max((s.get("seconds") or 0.0 for s in known), default=None),
    }


def _mean(values: Any) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


CHOICE_STATS = ("rounds", "strategy", "mean_k", "mean_accepted", "cache_hit_rate", "lossy")  # one choice's saguaro stats


def choice_stats(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    if not stats:
        return None
    return {k: stats.get(k) for k in CHOICE_STATS}
