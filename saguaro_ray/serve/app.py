"""The OpenAI-compatible Ray Serve application.

``build_app(config)`` returns a Serve application: one deployment
(:class:`SaguaroDeployment`, ``serve.ingress`` of a FastAPI app each replica
builds over its own state, :func:`build_api`) whose replica
launches ONE engine for the model — or attaches to a named, already running
one — that runs every strategy the config allows, each request's sequences
with their own, in one batch; and serves

* ``POST /v1/completions``       (``prompt``: string, strings, token ids)
* ``POST /v1/chat/completions``  (the tokenizer's chat template, else a plain fallback)
* ``GET  /v1/models``             (the model, its default and allowed strategies, max K)
* ``GET  /health``               (no API key needed; 503 when the engine is down)
* ``GET  /v1/saguaro/metrics``   (this replica's metric snapshot and its threads, KV and queues now, JSON)

``stream: true`` answers Server-Sent Events (``data: {...}`` chunks, then
``data: [DONE]``). Extensions: ``speculation`` (``{"mode", "k"}`` or a mode
name: the request's strategy; a mode the deployment does not allow, a K past
its ``max_k``, an unknown field are 400s naming ``speculation.mode``,
``speculation.k``, ``speculation``), ``top_k`` and ``ignore_eos`` sampling
fields, and every response carries a ``saguaro`` object (the request's
``mode`` and ``k``, the engine's ``default_mode``, rounds, rounds per mode
run (``strategy``), ``mean_k``, mean accepted length, cache hit rate, lossy
flag; a stream carries each choice's on its last chunk and the summary on
the ``include_usage`` chunk). Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
requests, 401 for a missing/invalid API key, 413 for a body over
``max_body_bytes`` (refused unparsed), 429 (with ``Retry-After``) past the
replica's ``max_ongoing_requests``, 500 for internal errors, 503 when the engine
cannot serve (a worker gone for good, the coordinator dead — ``/health`` says
503 too, so Serve replaces the replica) or the replica is draining, 504 past
``request_timeout_s`` (or the request's ``timeout`` extension).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route
# parameters' real types (``Request``, the body models) from the signatures.

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from saguaro_ray.serve.config import ServeAppConfig, parse_config
from saguaro_ray.serve.limits import BodyLimit
from saguaro_ray.serve.openai_routes import OpenAIRoutes
from saguaro_ray.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from saguaro_ray.serve.replica import ReplicaCore


def build_api(core: ReplicaCore) -> FastAPI:
    """The HTTP app of one replica, built once ``core`` has started: its
    routes, error handlers and body limit are bound to that replica's state
    (no module-level app, so nothing is shared between replicas or looked up
    through a global)."""
    api = FastAPI(title="saguaro-ray", description="OpenAI-compatible API over the saguaro-ray engine")
    routes = OpenAIRoutes(core)
    api.add_middleware(BodyLimit, limit=core.cfg.max_body_bytes)

    def error_response(err: APIError, request: Request) -> JSONResponse:
        core.metrics.request(_route_of(request), "-", err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @api.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_invalid_body(exc), request)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=str(exc.status_code)), request)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await routes.completions(body, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await routes.chat_completions(body, request)

    @api.get("/v1/models")
    async def models(request: Request) -> Any:
        return await routes.models(request)

    @api.get("/health")
    async def health() -> Any:
        return await core.health()

    @api.get("/v1/saguaro/metrics")
    async def metrics_snapshot(request: Request) -> Any:
        return await core.metrics_snapshot(request)

    return api


def _route_of(request: Request) -> str:
    path = request.url.path
    return "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") else "other"


def _invalid_body(exc: RequestValidationError) -> APIError:
    """FastAPI's body validation failure as an OpenAI 400 naming the first bad
    field as OpenAI does (``messages[0].role``); a union's alternatives are
    named in the message, not in the parameter."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    path = _field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        msg, param = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    elif not path:  # the body is missing, or not a JSON object
        msg, param = "request body must be a JSON object (sent with Content-Type: application/json)", None
    else:
        param = _param_name(path)
        same = [e for e in errors if _field_path(e.get("loc", ())) == path]
        tags = [str(e["loc"][len(path) + 1]) for e in same if len(e.get("loc", ())) > len(path) + 1]
        if len(same) > 1 and len(tags) == len(same):  # every alternative of a union refused it
            msg = f"{param}: invalid type; expected one of: {', '.join(tags)}"
        else:
            msg = f"{param}: {first['msg']}"
        if len(errors) > len(same):
            msg += f" (and {len(errors) - len(same)} more error(s))"
    return APIError(400, msg, param=param, code="invalid_request")


# pydantic names a union's alternative in an error's location ("stop", "list[str]"):
# a type, not a field of the body
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _field_path(loc: Any) -> tuple[Any, ...]:
    """An error location's fields and indices, without "body" and union tags."""
    path: list[Any] = []
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            break
        path.append(part)
    return tuple(path)


def _param_name(path: tuple[Any, ...]) -> str:
    """``("messages", 0, "role")`` -> ``"messages[0].role"`` (OpenAI's spelling)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@serve.ingress()
class SaguaroDeployment:
    """One replica: starts a :class:`ReplicaCore`, then Serve asks it for its
    HTTP app (:func:`build_api`)."""

    async def __init__(self, config: dict) -> None:
        self.core = ReplicaCore()
        await self.core.start(config)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.core)

    async def check_health(self) -> None:
        await self.core.check_health()

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.close()


def build_app(config: dict | ServeAppConfig) -> Any:
    """The Serve application for ``config`` (a dict — a Serve YAML's ``args`` —
    or a :class:`ServeAppConfig`). Validates everything that can be checked
    without starting engines (a :class:`~saguaro_ray.errors.ConfigError` names
    the field), then binds the deployment."""
    cfg = parse_config(config)
    deployment = serve.deployment(
        SaguaroDeployment,
        name="saguaro",
        num_replicas=cfg.num_replicas,
        # twice the replica's own bound: the requests past it must reach the
        # replica to get a quick 429 (and /health, /v1/models must get through)
        # instead of waiting in Serve's queue
        max_ongoing_requests=2 * cfg.max_ongoing_requests,
        ray_actor_options=dict(cfg.ray_actor_options),
        health_check_period_s=10,
        health_check_timeout_s=cfg.health_check_timeout_s + 10,
        # a stopping replica waits this long for its requests in flight
        graceful_shutdown_timeout_s=cfg.request_timeout_s + 10,
    )
    return deployment.bind(cfg.model_dump())


__all__ = ["ReplicaCore", "SaguaroDeployment", "ServeAppConfig", "build_app", "parse_config"]
