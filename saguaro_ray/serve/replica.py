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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from saguaro_ray.config import SamplingParams
from saguaro_ray.errors import ConfigError, SaguaroError
from saguaro_ray.runtime.threads import own_threads, thread_kinds
from saguaro_ray.serve.chat import chat_prompt_ids
from saguaro_ray.serve.config import (
    EngineEntry,
    ServeAppConfig,
    parse_config,
)
from saguaro_ray.serve.limits import Admission, check_prompt_bytes, max_token_bytes, prompt_byte_limit
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

ENGINE_PROBE_S = 10.0  # how long a metrics snapshot waits for one engine's coordinator or workers


@dataclass
class _Engine:
    entry: EngineEntry
    handle: Any  # EngineHandle
    owned: bool
    frontend: Any  # a Frontend without a scheduler: validates prompts against this engine's context
    mode: str
    k: int | None
    prompt_bytes: int  # text beyond this many bytes cannot fit the context (see limits.prompt_byte_limit)


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
        self.admission = Admission(self.cfg.max_ongoing_requests, self.metrics.ongoing_requests)
        self._health_probe: asyncio.Future | None = None
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
        token_bytes = max_token_bytes(tokenizer)

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
                    prompt_bytes=prompt_byte_limit(token_bytes, max_context),
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
        (attached engines keep running). Serve calls it once the requests in
        flight have finished (it waits up to ``request_timeout_s`` for them);
        anything arriving from now on gets 503."""
        admission = getattr(self, "admission", None)
        if admission is not None:
            admission.draining = True
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.cancel()
        self._shutdown_engines(getattr(self, "engines", {}))
        if ReplicaCore.current is self:
            ReplicaCore.current = None

    async def _engine_health(self) -> dict[str, tuple[bool, str]]:
        """Every engine's ``EngineHandle.ahealth()``, asked concurrently. Callers
        arriving while a probe is out share its answer: ``/health`` needs no
        key, and each probe costs every coordinator a thread."""
        if self._health_probe is None or self._health_probe.done():
            timeout = self.cfg.health_check_timeout_s

            async def probe() -> dict[str, tuple[bool, str]]:
                answers = await asyncio.gather(*(e.handle.ahealth(timeout) for e in self.engines.values()))
                return dict(zip(self.engines, answers))

            self._health_probe = asyncio.ensure_future(probe())
        return await asyncio.shield(self._health_probe)

    async def check_health(self) -> None:
        """Serve's replica health check: raising makes Serve replace this
        replica — so it raises when an engine cannot serve (a worker gone for
        good, a dead or unresponsive coordinator), not merely when it is slow."""
        down = {name: why for name, (ok, why) in (await self._engine_health()).items() if not ok}
        if down:
            raise RuntimeError("; ".join(f"engine {name!r} cannot serve: {why}" for name, why in down.items()))

    async def _poll_engine_metrics(self) -> None:
        while True:
            await self._refresh_engine_metrics()
            await asyncio.sleep(self.cfg.metrics_interval_s)

    async def _refresh_engine_metrics(self) -> dict[str, dict[str, Any]]:
        """Every engine's coordinator metrics into the gauges; returns those that answered."""
        fresh = {}
        for name, e in self.engines.items():
            try:
                m = await asyncio.wait_for(e.handle.coordinator.metrics.remote(), ENGINE_PROBE_S)
                self.metrics.engine_metrics(name, m)
                fresh[name] = m
            except Exception:
                log.debug("engine %s metrics unavailable", name, exc_info=True)
        return fresh

    # ------------------------------------------------------------ requests
    def _authorize(self, request: Request) -> None:
        if not self.keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compared as bytes: compare_digest refuses str with non-ASCII characters
        # (a TypeError, a 500); a header's str holds its raw bytes as latin-1
        token = token.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not token or not any(hmac.compare_digest(token, k.encode("utf-8")) for k in self.keys):
            raise APIError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    def _prepare(self, body: _Common, request: Request, prompts: int = 1) -> tuple[_Engine, list[str]]:
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
        max_n = self.cfg.max_n
        if not isinstance(body.n, int) or not 1 <= body.n <= max_n:
            raise APIError(400, f"n must be an integer in [1, {max_n}], got {body.n!r}", param="n")
        if prompts * body.n > max_n:
            raise APIError(400, f"a request may ask for at most {max_n} samples (prompts x n), got {prompts} x {body.n}", param="prompt")
        stops = body.stop_list(self.cfg.max_stop_sequences, self.cfg.max_stop_length)
        try:
            entry = self.cfg.match(body.speculation_dict())
        except ConfigError as exc:
            raise APIError(400, str(exc), param="speculation", code="invalid_value") from None
        return self.engines[entry.name], stops

    def _params(self, body: _Common, max_tokens: int, stops: list[str]) -> SamplingParams:
        """The engine's sampling parameters; it cuts at the stop strings itself
        (and stops decoding there)."""
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k or 0,
                top_p=1.0 if body.top_p is None else body.top_p,
                max_tokens=max_tokens,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
                stop=tuple(stops),
            )
            params.check_samples(body.n)
        except ConfigError as exc:
            raise api_error_from(exc) from None
        return params

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        prompts = body.prompts()
        engine, stops = self._prepare(body, request, len(prompts))
        deadline = time.monotonic() + body.timeout_s(self.cfg.request_timeout_s)
        params = self._params(body, self.cfg.completion_default_max_tokens if body.max_tokens is None else body.max_tokens, stops)
        for p in prompts:
            if isinstance(p, str):
                check_prompt_bytes([p], engine.prompt_bytes, "prompt")
        release = self.admission.enter()
        streaming = False
        try:
            prompt_lens = await self._validate_prompts(engine, prompts, params, "prompt")
            if body.stream:
                response = await self._stream_response("completions", body, engine, prompts, prompt_lens, params, t0, deadline, release)
                streaming = True
                return response
            results = await self._generate(engine, prompts, params, body.n, "prompt", deadline)
        finally:
            if not streaming:
                release()
        choices, completion_tokens, stats = [], 0, []
        for i, r in enumerate(results):
            completion_tokens += len(r.token_ids)
            stats.append(r.stats)
            choices.append(
                {"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason, "saguaro": choice_stats(r.stats)}
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
        deadline = time.monotonic() + body.timeout_s(self.cfg.request_timeout_s)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_prompt_bytes([m["content"] for m in messages], engine.prompt_bytes, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # refuse bad values before any work (without max_tokens, they wait for the prompt's length)
        params = None if requested is None else self._params(body, requested, stops)
        release = self.admission.enter()
        streaming = False
        try:
            try:  # rendering and tokenising: off the event loop
                ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, messages, self.cfg.chat_template)
            except APIError:
                raise
            except Exception as exc:  # a template that rejects these messages (e.g. role order)
                raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
            if params is None:
                fill = max(1, min(self.cfg.default_max_tokens, engine.frontend.max_context - len(ids)))
                params = self._params(body, fill, stops)
            prompt_lens = await self._validate_prompts(engine, [ids], params, "messages")
            if body.stream:
                response = await self._stream_response("chat", body, engine, [ids], prompt_lens, params, t0, deadline, release)
                streaming = True
                return response
            results = await self._generate(engine, [ids], params, body.n, "messages", deadline)
        finally:
            if not streaming:
                release()
        choices, completion_tokens, stats = [], 0, []
        for i, r in enumerate(results):
            completion_tokens += len(r.token_ids)
            stats.append(r.stats)
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
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
        """200 only when every engine can serve and the replica is not draining
        (load balancers and Serve read it; see :meth:`check_health`)."""
        status = {name: "ok" if ok else f"down: {why}" for name, (ok, why) in (await self._engine_health()).items()}
        ok = all(v == "ok" for v in status.values()) and not self.admission.draining
        overall = "ok" if ok else "draining" if self.admission.draining else "unhealthy"
        return JSONResponse({"status": overall, "engines": status}, status_code=200 if ok else 503)

    async def metrics_snapshot(self, request: Request) -> Any:
        self._authorize(request)
        fresh = await self._refresh_engine_metrics()
        snapshot = self.metrics.snapshot()
        snapshot["resources"] = await self._resources(fresh)
        return snapshot

    async def _resources(self, fresh: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """What a leak would grow, read now: this replica's Python threads and,
        per engine, its samples queued or running (``fresh``: the coordinators'
        metrics) and each worker's free KV blocks and Python threads (only for
        the engines this replica launched: an attached engine's workers belong
        to whoever launched it). An engine or its workers that do not answer
        within ``ENGINE_PROBE_S`` are None: the snapshot itself never hangs.
        A load test compares it before and after (``saguaro_ray.jobs.load_test``)."""
        engines: dict[str, Any] = {}
        for name, e in self.engines.items():
            m = fresh.get(name)
            try:  # the workers' info calls block: off the event loop
                infos = await asyncio.wait_for(asyncio.to_thread(e.handle.worker_info), ENGINE_PROBE_S)
            except Exception:
                log.debug("engine %s workers unavailable", name, exc_info=True)
                infos = None
            workers = None if infos is None else {
                role: {
                    "free_kv_blocks": i["free_kv_blocks"],
                    "kv_blocks": i["kv_tokens"] // i["block_size"],
                    "python_threads": i["python_threads"],
                    "thread_kinds": i["thread_kinds"],
                }
                for role, i in infos.items()
            }
            engines[name] = {"active": None if m is None else m["active"], "queued": None if m is None else m["queued"], "workers": workers}
        return {"python_threads": len(own_threads()), "thread_kinds": thread_kinds(), "ongoing_requests": self.admission.active, "engines": engines}

    # ------------------------------------------------------------ helpers
    async def _validate_prompts(self, engine: _Engine, prompts: list[Any], params: SamplingParams, param: str) -> list[int]:
        """Validate like the engine does (empty prompts, token ids, context) and
        return each prompt's token count — before any model work, and off the
        event loop (tokenising a long prompt would stall every other request)."""
        try:
            seqs = await asyncio.to_thread(engine.frontend.make_sequences, prompts, params, 1)
        except SaguaroError as exc:
            raise api_error_from(exc, param) from None
        return [len(s.prompt_ids) for s in seqs]

    async def _generate(self, engine: _Engine, prompts: list[Any], params: SamplingParams, n: int, param: str, deadline: float) -> list[Any]:
        """The engine's results; 504 once ``deadline`` passes — the engine call
        is cancelled then (cancelling the awaiting task is the engine's abort hook)."""
        try:
            return await asyncio.wait_for(engine.handle.agenerate(prompts, params, n), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise _deadline_passed() from None
        except Exception as exc:
            err = api_error_from(exc, param)
            if err.status == 500:  # not a known engine state: keep the traceback for the operator
                log.exception("generation failed")
            elif err.status > 500:
                log.error("generation failed: %s", err.message)
            raise err from None

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
        t0: float,
        deadline: float,
        release: Callable[[], None],
    ) -> Any:
        """The SSE response of one request's samples (each its own engine
        stream). A failure before any output is a plain HTTP error; from then
        on errors are events. However the response ends — finished, failed,
        past ``deadline``, or its client gone — every engine stream is
        cancelled (closing it is the engine's abort hook) and the request's
        admission slot is released."""
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

        def close() -> None:
            for t in tasks:
                t.cancel()
            release()

        try:
            first = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            first = (0, _deadline_passed())
        except BaseException:  # cancelled: the client went away before any output
            close()
            raise
        if isinstance(first[1], BaseException):  # failed before any output: a plain HTTP error
            close()
            raise api_error_from(first[1], param)
        events = self._sse_events(route, body, engine, queue, len(tasks), first, prompt_lens, t0, deadline)
        return _EventStream(events, close)

    async def _sse_events(
        self,
        route: str,
        body: _Common,
        engine: _Engine,
        queue: asyncio.Queue,
        total: int,
        first: tuple[int, Any],
        prompt_lens: list[int],
        t0: float,
        deadline: float,
    ) -> AsyncIterator[str]:
        chat = route == "chat"
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        obj = "chat.completion.chunk" if chat else "text_completion"
        name = engine.entry.name
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
                toks = len(payload["token_ids"])
                if toks:
                    if not first_token_seen:
                        first_token_seen = True
                        self.metrics.first_token(route, name, t - t0)
                    if last_token_t[index] is not None:
                        self.metrics.inter_token(route, name, t - last_token_t[index], toks)
                    last_token_t[index] = t
                    ntokens[index] += toks
                text = payload["text"]
                finish = payload.get("finish_reason")
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
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (while we waited, or while we sent)
            status = 499
            raise
        except Exception as exc:
            err = _deadline_passed() if isinstance(exc, asyncio.TimeoutError) else api_error_from(exc)
            status = err.status
            if status >= 500:  # the engine side failed: the operator needs to know (a 500's traceback too)
                log.error("stream failed: %s", err.message, exc_info=exc if status == 500 else None)
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.metrics.request(route, name, status, time.perf_counter() - t0)


class _EventStream(StreamingResponse):
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


def _deadline_passed() -> APIError:
    return APIError(504, "the request did not finish within its timeout", type="server_error", code="timeout")
