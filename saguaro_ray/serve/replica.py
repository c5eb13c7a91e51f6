"""The request handling behind the Serve application (see :mod:`saguaro_ray.serve.app`).

:class:`ReplicaCore` is a plain class: the Serve ingress class in ``app.py``
delegates every route to it. Keeping the logic out of the decorated class
matters: ``serve.ingress`` pickles the decorated class's methods *by value*
while the module is still importing, so they run with a frozen copy of that
module's globals; code here is always imported by reference.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from saguaro_ray.config import SamplingParams
from saguaro_ray.errors import ConfigError, SaguaroError
from saguaro_ray.serve.chat import (
    StopMatcher,
    chat_prompt_ids,
    first_stop,
    tokens_for_text,
)
from saguaro_ray.serve.config import (
    EngineEntry,
    ServeAppConfig,
    parse_config,
)
from saguaro_ray.serve.metrics import ServeMetrics
from saguaro_ray.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
    api_error_from,
    choice_stats,
    new_id,
    now,
    saguaro_summary,
    usage,
)

log = logging.getLogger(__name__)

# how long one engine call / one stream chunk may take before the request fails
REQUEST_TIMEOUT_S = 600.0


async def _aref(ref: Any) -> Any:
    return await ref


@dataclass
class _Engine:
    entry: EngineEntry
    handle: Any  # EngineHandle
    owned: bool
    frontend: Any  # a Frontend without a scheduler: validates prompts against this engine's context
    mode: str
    k: int | None


class ReplicaCore:
    """One replica's state and request handling: the engines, the tokenizer, the metrics."""

    current: ReplicaCore | None = None  # the replica in this process (one per Serve replica actor)

    async def start(self, config: dict[str, Any] | ServeAppConfig) -> None:
        self.cfg = parse_config(config)
        self.keys = self.cfg.resolved_api_keys()
        if self.cfg.api_keys_env and not self.keys:
            raise ConfigError(
                f"api_keys_env={self.cfg.api_keys_env!r} is set but the variable is empty in the replica; "
                "set it through the Serve config's runtime_env.env_vars"
            )
        self.metrics = ServeMetrics(self.cfg.model_name)
        ReplicaCore.current = self
        loop = asyncio.get_running_loop()
        self.tokenizer, self.engines = await loop.run_in_executor(None, self._start_engines)
        self.default = self.cfg.engines[0].name
        self._poller = asyncio.ensure_future(self._poll_engine_metrics())
        log.info("saguaro serve replica ready: engines %s", [e.entry.describe() for e in self.engines.values()])

    # ------------------------------------------------------------ lifecycle
    def _start_engines(self) -> tuple[Any, dict[str, _Engine]]:
        from saguaro_ray.engine.frontend import Frontend, open_models
        from saguaro_ray.models.resolve import resolve_models
        from saguaro_ray.runtime.engine import Engine, connect

        cfg = self.cfg
        specs = {"target": cfg.target}
        for role in ("draft", "qualifier"):
            if getattr(cfg, role) and any(
                (e.spec().needs_draft if role == "draft" else e.spec().mode == "pyramid") for e in cfg.engines
            ):
                specs[role] = getattr(cfg, role)
        paths = resolve_models(specs)  # once here, not once per engine
        ckpts, tokenizer = open_models(paths)
        vocab = ckpts["target"].config.vocab_size

        def start(entry: EngineEntry) -> tuple[Any, bool]:
            if entry.connect:
                return connect(entry.connect, namespace=entry.namespace), False
            return Engine.launch(cfg.launch_config(entry, paths)), True

        engines: dict[str, _Engine] = {}
        with ThreadPoolExecutor(len(cfg.engines)) as pool:
            futures = {e.name: (e, pool.submit(start, e)) for e in cfg.engines}
            errors = []
            for name, (entry, fut) in futures.items():
                try:
                    handle, owned = fut.result()
                except Exception as exc:  # keep going: shut down what did start
                    errors.append(exc)
                    continue
                spec = entry.spec()
                roles = ["target"] + (["draft"] if spec.needs_draft else []) + (["qualifier"] if spec.mode == "pyramid" else [])
                max_context = min(ckpts[r].config.max_position_embeddings for r in roles)
                engines[name] = _Engine(
                    entry=entry,
                    handle=handle,
                    owned=owned,
                    frontend=Frontend(tokenizer, vocab, max_context, spec.mode, None),
                    mode=spec.mode,
                    k=spec.k if spec.mode in ("sd", "ssd") else None,
                )
        if errors:
            self._shutdown_engines(engines)
            raise errors[0]
        return tokenizer, engines

    def _shutdown_engines(self, engines: dict[str, _Engine]) -> None:
        for e in engines.values():
            if e.owned:
                try:
                    e.handle.shutdown()
                except Exception:
                    log.warning("engine %s shutdown failed", e.entry.name, exc_info=True)

    def close(self) -> None:
        """Stop the metrics poller and the engines this replica launched
        (attached engines keep running)."""
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.cancel()
        self._shutdown_engines(getattr(self, "engines", {}))
        if ReplicaCore.current is self:
            ReplicaCore.current = None

    async def check_health(self) -> None:
        """Serve's replica health check: every engine's coordinator must answer."""
        for name, e in self.engines.items():
            try:
                await asyncio.wait_for(_aref(e.handle.coordinator.ready.remote()), self.cfg.health_check_timeout_s)
            except Exception as exc:
                raise RuntimeError(f"engine {name!r} is not responding: {type(exc).__name__}: {exc}") from None

    async def _poll_engine_metrics(self) -> None:
        while True:
            await self._refresh_engine_metrics()
            await asyncio.sleep(self.cfg.metrics_interval_s)

    async def _refresh_engine_metrics(self) -> None:
        for name, e in self.engines.items():
            try:
                m = await asyncio.wait_for(_aref(e.handle.coordinator.metrics.remote()), 10.0)
                self.metrics.engine_metrics(name, m)
            except Exception:
                log.debug("engine %s metrics unavailable", name, exc_info=True)

    # ------------------------------------------------------------ requests
    def _authorize(self, request: Request) -> None:
        if not self.keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or not any(hmac.compare_digest(token, k) for k in self.keys):
            raise APIError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    def _prepare(self, body: _Common, request: Request) -> tuple[_Engine, list[str]]:
        """Checks shared by both routes; returns the selected engine and the stop strings."""
        self._authorize(request)
        if body.model not in self.cfg.model_ids():
            raise APIError(
                400,
                f"model {body.model!r} is not served here; available: {', '.join(self.cfg.model_ids())}",
                param="model",
                code="model_not_found",
            )
        body.refuse_unsupported()
        if not isinstance(body.n, int) or not 1 <= body.n <= self.cfg.max_n:
            raise APIError(400, f"n must be an integer in [1, {self.cfg.max_n}], got {body.n!r}", param="n")
        stops = body.stop_list(self.cfg.max_stop_sequences)
        try:
            entry = self.cfg.match(body.speculation_dict())
        except ConfigError as exc:
            raise APIError(400, str(exc), param="speculation", code="invalid_value") from None
        return self.engines[entry.name], stops

    def _params(self, body: _Common, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k or 0,
                top_p=1.0 if body.top_p is None else body.top_p,
                max_tokens=max_tokens,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
            )
        except ConfigError as exc:
            raise api_error_from(exc) from None

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        engine, stops = self._prepare(body, request)
        params = self._params(body, self.cfg.completion_default_max_tokens if body.max_tokens is None else body.max_tokens)
        prompts = body.prompts()
        prompt_lens = self._validate_prompts(engine, prompts, params, body.n, "prompt")
        if body.stream:
            return await self._stream_response("completions", body, engine, prompts, prompt_lens, params, stops, t0)
        results = await self._generate("completions", engine, prompts, params, body.n, "prompt")
        choices, completion_tokens, stats = [], 0, []
        for i, r in enumerate(results):
            text, finish, ntok = self._apply_stop(r, stops)
            completion_tokens += ntok
            stats.append(r.stats)
            choices.append(
                {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "saguaro": choice_stats(r.stats)}
            )
        prompt_tokens = sum(prompt_lens)
        self._record("completions", engine, results, prompt_tokens, completion_tokens, t0)
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": body.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
            "saguaro": saguaro_summary(engine.entry.name, engine.mode, engine.k, stats),
        }

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        engine, stops = self._prepare(body, request)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = chat_prompt_ids(self.tokenizer, messages, self.cfg.chat_template)
        except APIError:
            raise
        except Exception as exc:  # a template that rejects these messages (e.g. role order)
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if requested is None:
            requested = max(1, min(self.cfg.default_max_tokens, engine.frontend.max_context - len(ids)))
        params = self._params(body, requested)
        prompt_lens = self._validate_prompts(engine, [ids], params, body.n, "messages")
        if body.stream:
            return await self._stream_response("chat", body, engine, [ids], prompt_lens, params, stops, t0)
        results = await self._generate("chat", engine, [ids], params, body.n, "messages")
        choices, completion_tokens, stats = [], 0, []
        for i, r in enumerate(results):
            text, finish, ntok = self._apply_stop(r, stops)
            completion_tokens += ntok
            stats.append(r.stats)
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                    "saguaro": choice_stats(r.stats),
                }
            )
        self._record("chat", engine, results, prompt_lens[0], completion_tokens, t0)
        return {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": body.model,
            "choices": choices,
            "usage": usage(prompt_lens[0], completion_tokens),
            "saguaro": saguaro_summary(engine.entry.name, engine.mode, engine.k, stats),
        }

    async def models(self, request: Request) -> Any:
        self._authorize(request)
        engines = [
            {"name": e.entry.name, "mode": e.mode, "k": e.k, "max_context": e.frontend.max_context, "attached": not e.owned}
            for e in self.engines.values()
        ]
        data = [
            {
                "id": mid,
                "object": "model",
                "created": now(),
                "owned_by": "saguaro-ray",
                "saguaro": {"target": self.cfg.target, "engines": engines, "default_engine": self.default},
            }
            for mid in self.cfg.model_ids()
        ]
        self.metrics.request("models", "-", 200)
        return {"object": "list", "data": data}

    async def health(self) -> Any:
        status: dict[str, str] = {}
        for name, e in self.engines.items():
            try:
                await asyncio.wait_for(_aref(e.handle.coordinator.ready.remote()), 10.0)
                status[name] = "ok"
            except Exception as exc:
                status[name] = f"down: {type(exc).__name__}"
        ok = all(v == "ok" for v in status.values())
        return JSONResponse({"status": "ok" if ok else "unhealthy", "engines": status}, status_code=200 if ok else 503)

    async def metrics_snapshot(self, request: Request) -> Any:
        self._authorize(request)
        await self._refresh_engine_metrics()
        return self.metrics.snapshot()

    # ------------------------------------------------------------ helpers
    def _validate_prompts(self, engine: _Engine, prompts: list[Any], params: SamplingParams, n: int, param: str) -> list[int]:
        """Validate like the engine does (empty prompts, token ids, context) and
        return each prompt's token count — before any model work."""
        try:
            seqs = engine.frontend.make_sequences(prompts, params, 1)
        except SaguaroError as exc:
            raise api_error_from(exc, param) from None
        return [len(s.prompt_ids) for s in seqs]

    async def _generate(self, route: str, engine: _Engine, prompts: list[Any], params: SamplingParams, n: int, param: str) -> list[Any]:
        try:
            return await asyncio.wait_for(engine.handle.agenerate(prompts, params, n), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(504, f"generation did not finish within {REQUEST_TIMEOUT_S:.0f} s", type="server_error", code="timeout") from None
        except Exception as exc:
            err = api_error_from(exc, param)
            if err.status >= 500:
                log.exception("generation failed")
            raise err from None

    def _apply_stop(self, result: Any, stops: list[str]) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens) after cutting at a stop string."""
        text, ntok = result.text, len(result.token_ids)
        cut = first_stop(text, stops) if stops else None
        if cut is None:
            return text, result.finish_reason, ntok
        stop_len = max(len(s) for s in stops if text.startswith(s, cut))
        used = tokens_for_text(self.tokenizer, result.token_ids, cut + stop_len)
        return text[:cut], "stop", used

    def _record(self, route: str, engine: _Engine, results: list[Any], prompt_tokens: int, completion_tokens: int, t0: float) -> None:
        name = engine.entry.name
        self.metrics.request(route, name, 200, time.perf_counter() - t0)
        self.metrics.tokens(route, name, prompt_tokens, completion_tokens)
        for r in results:
            self.metrics.sample_stats(name, r.stats)

    # ------------------------------------------------------------ streaming
    async def _stream_response(
        self,
        route: str,
        body: _Common,
        engine: _Engine,
        prompts: list[Any],
        prompt_lens: list[int],
        params: SamplingParams,
        stops: list[str],
        t0: float,
    ) -> Any:
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
        param = "messages" if route == "chat" else "prompt"
        try:
            first = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            first = (0, APIError(504, "no output within the timeout", type="server_error", code="timeout"))
        if isinstance(first[1], BaseException):  # failed before any output: a plain HTTP error
            for t in tasks:
                t.cancel()
            raise api_error_from(first[1], param)
        events = self._sse_events(route, body, engine, tasks, queue, first, prompts, prompt_lens, stops, t0)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _sse_events(
        self,
        route: str,
        body: _Common,
        engine: _Engine,
        tasks: list[asyncio.Future],
        queue: asyncio.Queue,
        first: tuple[int, Any],
        prompts: list[Any],
        prompt_lens: list[int],
        stops: list[str],
        t0: float,
    ) -> AsyncIterator[str]:
        chat = route == "chat"
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        obj = "chat.completion.chunk" if chat else "text_completion"
        name = engine.entry.name
        total = len(tasks)
        matchers = [StopMatcher(stops) for _ in range(total)]
        ntokens = [0] * total
        last_token_t: list[float | None] = [None] * total
        done = [False] * total
        first_token_seen = False

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": body.model, "choices": choices, **extra}
            return f"data: {json.dumps(payload)}\n\n"

        def choice(index: int, text: str | None, finish: str | None, role: bool = False, stats: dict | None = None) -> dict[str, Any]:
            extra = {} if stats is None else {"saguaro": choice_stats(stats)}
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish, **extra}

        status = 200
        try:
            if chat:  # the role first, as OpenAI does
                yield chunk([choice(i, "", None, role=True) for i in range(total)])
            item: tuple[int, Any] | None = first
            while not all(done):
                if item is None:
                    item = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
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
                toks = len(payload["token_ids"])
                if toks:
                    if not first_token_seen:
                        first_token_seen = True
                        self.metrics.first_token(route, name, t - t0)
                    if last_token_t[index] is not None:
                        self.metrics.inter_token(route, name, t - last_token_t[index], toks)
                    last_token_t[index] = t
                    ntokens[index] += toks
                m = matchers[index]
                text = m.push(payload["text"])
                finish = payload.get("finish_reason")
                if m.stopped:
                    finish = "stop"
                elif finish is not None:
                    text += m.flush()
                if text:
                    yield chunk([choice(index, text, None)])
                if finish is not None:
                    done[index] = True
                    yield chunk([choice(index, None if chat else "", finish, stats=payload.get("stats"))])
            prompt_tokens = sum(prompt_lens) if not chat else prompt_lens[0]
            completion_tokens = sum(ntokens)
            self.metrics.tokens(route, name, prompt_tokens, completion_tokens)
            summary = {"engine": name, "mode": engine.mode, "k": engine.k}
            if body.include_usage():
                yield chunk([], usage=usage(prompt_tokens, completion_tokens), saguaro=summary)
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:  # the client went away
            status = 499
            raise
        except Exception as exc:
            err = exc if isinstance(exc, APIError) else api_error_from(exc)
            if isinstance(exc, asyncio.TimeoutError):
                err = APIError(504, "stream stalled beyond the timeout", type="server_error", code="timeout")
            status = err.status
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            self.metrics.request(route, name, status, time.perf_counter() - t0)
