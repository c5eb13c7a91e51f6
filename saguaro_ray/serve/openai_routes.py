"""The OpenAI routes of one replica: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

A request is checked in the order that keeps a bad or surplus one cheap: the
API key, the model, the fields the engine cannot honour, ``n``, the stop
strings, the strategy its ``speculation`` names (against what the engine
allows, by the engine's own ``StrategyMenu``), the sampling values (as
:class:`~saguaro_ray.config.SamplingParams` checks them for the CLI and the
Python API too), the prompt's bytes — all before it takes an admission slot;
then, holding one, the prompt is tokenised and checked against the context
off the event loop, and the replica's one engine runs it — its sequences
with their own strategy, next to every other request's (or streams it, see
:mod:`saguaro_ray.serve.streaming`). The request bodies and response helpers
are :mod:`saguaro_ray.serve.protocol`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

from saguaro_ray.config import ResponseFormat, SamplingParams, Strategy
from saguaro_ray.errors import ConfigError, SaguaroError
from saguaro_ray.serve.chat import chat_prompt_ids
from saguaro_ray.serve.limits import check_prompt_bytes
from saguaro_ray.serve.logprobs import chat_logprobs, completion_logprobs
from saguaro_ray.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
    api_error_from,
    choice_stats,
    deadline_passed,
    new_id,
    now,
    prompt_field,
    saguaro_summary,
    usage,
)
from saguaro_ray.serve.replica import ReplicaCore, ServedEngine
from saguaro_ray.serve.streaming import stream_response

log = logging.getLogger(__name__)

# a request's prompts and sampling parameters, made once it holds an admission slot
PromptsAndParams = Callable[[], Awaitable[tuple[list[Any], SamplingParams]]]


class OpenAIRoutes:
    """The OpenAI routes over one replica's engine, tokenizer, admission and metrics."""

    def __init__(self, replica: ReplicaCore) -> None:
        self.replica = replica

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        cfg = self.replica.cfg
        prompts = body.prompts()
        stops, requested, strategy = self._prepare(body, request, len(prompts))
        deadline = time.monotonic() + body.timeout_s(cfg.request_timeout_s)
        max_tokens = cfg.completion_default_max_tokens if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, stops, requested)
        for p in prompts:
            if isinstance(p, str):
                check_prompt_bytes([p], self.replica.engine.prompt_bytes, "prompt")

        async def ready() -> tuple[list[Any], SamplingParams]:
            return prompts, params

        return await self._answer("completions", body, strategy, ready, t0, deadline)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        cfg = self.replica.cfg
        engine = self.replica.engine
        stops, requested, strategy = self._prepare(body, request)
        body.check_messages()
        deadline = time.monotonic() + body.timeout_s(cfg.request_timeout_s)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_prompt_bytes([m["content"] for m in messages], engine.prompt_bytes, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # refuse bad values before any work (without max_tokens, they wait for the prompt's length)
        params = None if max_tokens is None else sampling_params(body, max_tokens, stops, requested)

        async def ready() -> tuple[list[Any], SamplingParams]:
            try:  # rendering and tokenising: off the event loop
                ids = await asyncio.to_thread(chat_prompt_ids, self.replica.tokenizer, messages, cfg.chat_template)
            except APIError:
                raise
            except Exception as exc:  # a template that rejects these messages (e.g. role order)
                raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
            if params is not None:
                return [ids], params
            fill = max(1, min(cfg.default_max_tokens, engine.frontend.max_context - len(ids)))
            return [ids], sampling_params(body, fill, stops, requested)

        return await self._answer("chat", body, strategy, ready, t0, deadline)

    async def models(self, request: Request) -> Any:
        replica = self.replica
        replica.keys.check(request)
        cfg, engine = replica.cfg, replica.engine
        menu = engine.menu
        info = {
            "target": cfg.target,
            "default_mode": menu.default,
            "allowed_modes": list(menu.allowed),
            "k": menu.k,
            "max_k": menu.max_k,
            "max_context": engine.frontend.max_context,
            "attached": not engine.owned,
        }
        data = [{"id": mid, "object": "model", "created": now(), "owned_by": "saguaro-ray", "saguaro": info} for mid in cfg.model_ids()]
        replica.metrics.request("models", "-", 200)
        return {"object": "list", "data": data}

    # ------------------------------------------------------------ helpers
    def _prepare(self, body: _Common, request: Request, prompts: int = 1) -> tuple[list[str], Strategy | None, Strategy]:
        """Checks shared by both generation routes; returns the stop strings,
        the strategy the request named (None: the default) and that strategy
        as the engine runs it (its K filled in)."""
        replica = self.replica
        cfg = replica.cfg
        replica.keys.check(request)
        if body.model not in cfg.model_ids():
            raise APIError(
                400,
                f"model {body.model!r} is not served here; available: {', '.join(cfg.model_ids())}",
                param="model",
                code="model_not_found",
            )
        body.refuse_unsupported()
        max_n = cfg.max_n
        if not isinstance(body.n, int) or not 1 <= body.n <= max_n:
            raise APIError(400, f"n must be an integer in [1, {max_n}], got {body.n!r}", param="n")
        if prompts * body.n > max_n:
            raise APIError(400, f"a request may ask for at most {max_n} samples (prompts x n), got {prompts} x {body.n}", param="prompt")
        stops = body.stop_list(cfg.max_stop_sequences, cfg.max_stop_length)
        requested = body.strategy()
        try:  # before an admission slot is taken; the engine's make_sequences checks it again, by the same menu
            strategy = replica.engine.menu.resolve(requested)
        except ConfigError as exc:
            raise api_error_from(exc) from None
        return stops, requested, strategy

    async def _answer(self, route: str, body: _Common, strategy: Strategy, ready: PromptsAndParams, t0: float, deadline: float) -> Any:
        """Run a checked request under an admission slot: held from before its
        prompt is tokenised until its response is complete (a stream's: until
        the stream ends, see :mod:`saguaro_ray.serve.streaming`)."""
        param = prompt_field(route)
        engine = self.replica.engine
        release = self.replica.admission.enter()
        streaming = False
        try:
            prompts, params = await ready()
            prompt_lens = await validate_prompts(engine, prompts, params, param)
            if body.stream:
                response = await stream_response(self.replica.metrics, route, body, engine, strategy, prompts, prompt_lens, params, t0, deadline, release)
                streaming = True
                return response
            results = await generate(engine, prompts, params, body.n, param, deadline)
        finally:
            if not streaming:
                release()
        return self._respond(route, body, strategy, results, sum(prompt_lens), t0)

    def _respond(self, route: str, body: _Common, strategy: Strategy, results: list[Any], prompt_tokens: int, t0: float) -> dict[str, Any]:
        """The response body of a finished request (recorded in the metrics)."""
        chat = route == "chat"
        tokenizer = self.replica.engine.frontend.tokenizer
        choices, completion_tokens, stats = [], 0, []
        for i, r in enumerate(results):
            completion_tokens += len(r.token_ids)
            stats.append(r.stats)
            content = {"message": {"role": "assistant", "content": r.text}} if chat else {"text": r.text}
            logprobs = None if r.logprobs is None else (chat_logprobs if chat else completion_logprobs)(tokenizer, r.logprobs)
            choices.append({"index": i, **content, "logprobs": logprobs, "finish_reason": r.finish_reason, "saguaro": choice_stats(r.stats)})
        metrics, tag = self.replica.metrics, strategy.mode
        metrics.request(route, tag, 200, time.perf_counter() - t0)
        metrics.tokens(route, tag, prompt_tokens, completion_tokens)
        for r in results:
            metrics.sample_stats(tag, r.stats)
        return {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": body.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
            "saguaro": saguaro_summary(strategy, self.replica.engine.menu.default, stats),
        }


def sampling_params(body: _Common, max_tokens: int, stops: list[str], speculation: Strategy | None) -> SamplingParams:
    """The engine's sampling parameters of a request, checked as the engine
    checks them (a 400 naming the field); the engine cuts at the stop strings
    itself (and stops decoding there). ``speculation``: the strategy the
    request named (None: the engine's default)."""
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_tokens=max_tokens,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            stop=tuple(stops),
            speculation=speculation,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias or (),
            logprobs=body.logprobs_count(),
            **({} if body.logprobs_mode is None else {"logprobs_mode": body.logprobs_mode}),
            response_format=ResponseFormat.of(body.response_format),
        )
        params.check_samples(body.n)
    except ConfigError as exc:
        err = api_error_from(exc)
        if err.param == "logprobs":  # chat names the count top_logprobs
            err.param = body.LOGPROBS_PARAM
        raise err from None
    return params


async def validate_prompts(engine: ServedEngine, prompts: list[Any], params: SamplingParams, param: str) -> list[int]:
    """Validate like the engine does (empty prompts, token ids, context) and
    return each prompt's token count — before any model work, and off the
    event loop (tokenising a long prompt would stall every other request)."""
    try:
        seqs = await asyncio.to_thread(engine.frontend.make_sequences, prompts, params, 1)
    except SaguaroError as exc:
        raise api_error_from(exc, param) from None
    return [len(s.prompt_ids) for s in seqs]


async def generate(engine: ServedEngine, prompts: list[Any], params: SamplingParams, n: int, param: str, deadline: float) -> list[Any]:
    """The engine's results; 504 once ``deadline`` passes — the engine call
    is cancelled then (cancelling the awaiting task is the engine's abort hook)."""
    try:
        return await asyncio.wait_for(engine.handle.agenerate(prompts, params, n), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise deadline_passed() from None
    except Exception as exc:
        err = api_error_from(exc, param)
        if err.status == 500:  # not a known engine state: keep the traceback for the operator
            log.exception("generation failed")
        elif err.status > 500:
            log.error("generation failed: %s", err.message)
        raise err from None
