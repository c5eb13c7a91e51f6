"""``stream: true``: one request's samples as Server-Sent Events.

Each sample is its own engine stream; their chunks meet in one queue and
leave as OpenAI ``data: {...}`` events, then ``data: [DONE]``. A failure
before any output is a plain HTTP error (the client has no stream yet); from
then on errors are events. However the response ends — finished, failed,
past its deadline, or its client gone — every engine stream is cancelled
(closing it is the engine's abort hook) and the request's admission slot is
released: a client that hangs up must cost the engines nothing more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from saguaro_ray.config import SamplingParams, Strategy
from saguaro_ray.engine.frontend import StreamChunk
from saguaro_ray.serve.metrics import ServeMetrics
from saguaro_ray.serve.logprobs import chat_logprobs, completion_logprobs
from saguaro_ray.serve.protocol import _Common, api_error_from, choice_stats, deadline_passed, new_id, now, prompt_field, saguaro_summary, usage
from saguaro_ray.serve.replica import ServedEngine

log = logging.getLogger(__name__)


async def stream_response(
    metrics: ServeMetrics,
    route: str,
    body: _Common,
    engine: ServedEngine,
    strategy: Strategy,
    prompts: list[Any],
    prompt_lens: list[int],
    params: SamplingParams,
    t0: float,
    deadline: float,
    release: Callable[[], None],
) -> EventStream:
    """The SSE response of one request's samples (see the module docstring);
    sample ``j`` of every prompt is seeded ``seed + j``, as without streaming."""
    n = body.n
    base = params.seed if params.seed is not None else secrets.randbelow(2**31)
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, prompt: Any, sample_params: SamplingParams) -> None:
        try:
            async for chunk in engine.handle.astream(prompt, sample_params):
                await queue.put((index, chunk))
            await queue.put((index, None))
        except BaseException as exc:  # cancelled, or an engine error
            await queue.put((index, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [
        asyncio.ensure_future(pump(i * n + j, p, params.with_seed(base + j)))
        for i, p in enumerate(prompts)
        for j in range(n)
    ]

    def close() -> None:
        for t in tasks:
            t.cancel()
        release()

    try:
        first = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        first = (0, deadline_passed())
    except BaseException:  # cancelled: the client went away before any output
        close()
        raise
    if isinstance(first[1], BaseException):  # failed before any output: a plain HTTP error
        close()
        raise api_error_from(first[1], prompt_field(route))
    events = sse_events(metrics, route, body, strategy, engine.menu.default, queue, len(tasks), first, prompt_lens, t0, deadline, engine.frontend.tokenizer)
    return EventStream(events, close)


async def sse_events(
    metrics: ServeMetrics,
    route: str,
    body: _Common,
    strategy: Strategy,
    default_mode: str,
    queue: asyncio.Queue,
    total: int,
    first: tuple[int, Any],
    prompt_lens: list[int],
    t0: float,
    deadline: float,
    tokenizer: Any,
) -> AsyncIterator[str]:
    """The events of ``total`` samples whose chunks arrive on ``queue`` as
    ``(sample index, chunk | None at its end | the exception that ended it)``,
    ``first`` already taken off it. The request's status is recorded once it
    ends: 499 when the client went away, whether while we waited or while we
    sent. ``strategy``: the request's, as the engine resolved it (its metrics
    tag; the ``include_usage`` chunk's ``saguaro`` summary names it, with the
    samples' round statistics, as a non-streamed response does). A chunk
    whose tokens have logprobs carries them (``tokenizer`` names the tokens),
    also while their text is still held back."""
    chat = route == "chat"
    rid = new_id("chatcmpl" if chat else "cmpl")
    created = now()
    obj = "chat.completion.chunk" if chat else "text_completion"
    tag = strategy.mode
    ntokens = [0] * total
    finals: list[dict[str, Any] | None] = [None] * total
    last_token_t: list[float | None] = [None] * total
    sent_ids: list[list[int]] = [[] for _ in range(total)]  # a completion's earlier tokens: its text offsets
    done = [False] * total
    first_token_seen = False

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {"id": rid, "object": obj, "created": created, "model": body.model, "choices": choices, **extra}
        return f"data: {json.dumps(payload)}\n\n"

    def choice(
        index: int, text: str | None, finish: str | None, role: bool = False, stats: dict | None = None, logprobs: dict | None = None
    ) -> dict[str, Any]:
        extra = {} if stats is None else {"saguaro": choice_stats(stats)}
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish, **extra}

    def logprobs_of(index: int, piece: StreamChunk) -> dict[str, Any] | None:
        if not piece.logprobs:
            return None
        if chat:
            return chat_logprobs(tokenizer, piece.logprobs)
        out = completion_logprobs(tokenizer, piece.logprobs, sent_ids[index])
        sent_ids[index].extend(piece.token_ids)
        return out

    status = 200
    try:
        if chat:  # the role first, as OpenAI does
            yield event([choice(i, "", None, role=True) for i in range(total)])
        item: tuple[int, Any] | None = first
        while not all(done):
            if item is None:
                item = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
            index, payload = item
            item = None
            if done[index]:
                continue
            if payload is None:  # the engine stream ended without a finish chunk
                done[index] = True
                continue
            if isinstance(payload, BaseException):
                raise payload
            t = time.perf_counter()
            piece: StreamChunk = payload
            tokens = len(piece.token_ids)
            if tokens:
                if not first_token_seen:
                    first_token_seen = True
                    metrics.first_token(route, tag, t - t0)
                if last_token_t[index] is not None:
                    metrics.inter_token(route, tag, t - last_token_t[index], tokens)
                last_token_t[index] = t
                ntokens[index] += tokens
            logprobs = logprobs_of(index, piece)
            if piece.text or logprobs is not None:
                yield event([choice(index, piece.text, None, logprobs=logprobs)])
            if piece.finish_reason is not None:
                done[index] = True
                finals[index] = piece.stats
                metrics.sample_stats(tag, piece.stats)
                yield event([choice(index, None if chat else "", piece.finish_reason, stats=piece.stats)])
        prompt_tokens = sum(prompt_lens)
        completion_tokens = sum(ntokens)
        metrics.tokens(route, tag, prompt_tokens, completion_tokens)
        if body.include_usage():
            summary = saguaro_summary(strategy, default_mode, finals)
            yield event([], usage=usage(prompt_tokens, completion_tokens), saguaro=summary)
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client went away (while we waited, or while we sent)
        status = 499
        raise
    except Exception as exc:
        err = deadline_passed() if isinstance(exc, asyncio.TimeoutError) else api_error_from(exc)
        status = err.status
        if status >= 500:  # the engine side failed: the operator needs to know (a 500's traceback too)
            log.error("stream failed: %s", err.message, exc_info=exc if status == 500 else None)
        yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        metrics.request(route, tag, status, time.perf_counter() - t0)


class EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends — also when the
    client goes away before the first byte, where the event generator's own
    ``finally`` would never run."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
