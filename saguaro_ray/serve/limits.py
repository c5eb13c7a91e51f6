"""What one replica takes on: body size, prompt size, requests at once, draining.

Every limit here is checked before the work it protects: a body over
``max_body_bytes`` is refused before it is parsed, a prompt whose bytes
already prove it cannot fit the context is refused before it is tokenised,
and a request past ``max_ongoing_requests`` is refused (429) before either.
One oversized or surplus request then costs the replica a counter check, not
its event loop or its engines.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from saguaro_ray.serve.protocol import RETRY_AFTER_S, APIError, engine_unavailable, too_many_requests

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# A tokeniser's normaliser may shorten text before it is split (NFKC folds
# some 3-byte characters into 2 bytes, ligatures into letters); four times the
# longest token's bytes per token is a bound no real tokeniser gets near, so a
# prompt over it is too long for certain, and no prompt that fits is refused.
_NORMALISER_SLACK = 4


def max_token_bytes(tokenizer: Any) -> int:
    """UTF-8 bytes of the longest token string in the vocabulary (added tokens
    included). Token strings never cover fewer bytes than the text they stand
    for: byte-level tokens spell every byte as one character, SentencePiece
    spells a space as the 3-byte ``▁`` and a fallback byte as ``<0xNN>``."""
    return max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())


def prompt_byte_limit(tokenizer_token_bytes: int, max_context: int) -> int:
    """Bytes of text beyond which a prompt has more than ``max_context`` tokens for certain."""
    return _NORMALISER_SLACK * max_context * tokenizer_token_bytes


def check_prompt_bytes(texts: list[str], limit: int, param: str) -> None:
    """Refuse, without tokenising, text that cannot fit the context window."""
    size = sum(len(t.encode("utf-8")) for t in texts)
    if size > limit:
        raise APIError(
            400,
            f"{param} has {size} bytes of text: more tokens than the context window holds, whatever the tokenizer "
            f"makes of it (refused without tokenising; at most {limit} bytes)",
            param=param,
            code="context_length_exceeded",
        )


class Admission:
    """In-flight requests of one replica: at most ``limit`` at once (429 past
    it), none new once draining (503). ``enter()`` returns the release to call
    exactly once when the request's response is complete. ``on_change``
    hears every new count (the replica's ongoing-requests gauge)."""

    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda active: None) -> None:
        self.limit = limit
        self.active = 0
        self.draining = False
        self._on_change = on_change

    def enter(self) -> Callable[[], None]:
        if self.draining:
            raise engine_unavailable("this replica is shutting down; retry on another")
        if self.active >= self.limit:
            raise too_many_requests(self.limit, RETRY_AFTER_S)
        self.active += 1
        self._on_change(self.active)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
                self._on_change(self.active)

        return release


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 with an
    OpenAI body — by its Content-Length alone when it declares one, else as
    soon as the bytes read exceed it — and is never parsed."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse(send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


async def _refuse(send: Send, limit: int) -> None:
    err = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    payload = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
