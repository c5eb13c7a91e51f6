"""One Serve replica's engine: starting and stopping it, its health, its metrics.

:class:`ReplicaCore` is a plain class holding what one replica has — its
config, API keys, metrics, admission, tokenizer and its one engine (every
strategy a request may name runs on it). The Serve ingress class in
``app.py`` creates it, then builds the replica's HTTP app over it (the
OpenAI routes are :mod:`saguaro_ray.serve.openai_routes`').
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from saguaro_ray.runtime.data_plane.status import PlaneStatus
from saguaro_ray.runtime.process_memory import MEMORY_FIELDS, memory
from saguaro_ray.runtime.threads import own_threads, thread_kinds
from saguaro_ray.serve.auth import APIKeys
from saguaro_ray.serve.config import ServeAppConfig, parse_config
from saguaro_ray.serve.limits import Admission, max_token_bytes, prompt_byte_limit
from saguaro_ray.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

ENGINE_PROBE_S = 10.0  # how long a metrics snapshot waits for the engine's coordinator or workers


@dataclass
class ServedEngine:
    """The replica's engine, with what requests to it are checked against."""

    handle: Any  # EngineHandle
    owned: bool  # launched by this replica (else attached by name: someone else stops it)
    frontend: Any  # a Frontend without a scheduler: validates prompts and strategies as the engine does
    prompt_bytes: int  # text beyond this many bytes cannot fit the context (see limits.prompt_byte_limit)

    @property
    def menu(self) -> Any:
        """The strategies this engine offers (its ``StrategyMenu``)."""
        return self.frontend.menu

    def describe(self) -> str:
        m = self.menu
        return f"default {m.default}, allowed {', '.join(m.allowed)}, k {m.k}, max_k {m.max_k}" + ("" if self.owned else " (attached)")


class ReplicaCore:
    """One replica's state: the engine, the tokenizer, the API keys, admission and metrics."""

    async def start(self, config: dict[str, Any] | ServeAppConfig) -> None:
        self.cfg = parse_config(config)
        self.keys = APIKeys(self.cfg)
        self.metrics = ServeMetrics(self.cfg.model_name)
        self.admission = Admission(self.cfg.max_ongoing_requests, self.metrics.ongoing_requests)
        self._health_probe: asyncio.Future | None = None
        self._data_plane: dict[str, Any] | None = None  # the engine's data plane, from its latest metrics
        loop = asyncio.get_running_loop()
        self.tokenizer, self.engine = await loop.run_in_executor(None, self._start_engine)
        self._poller = asyncio.ensure_future(self._poll_engine_metrics())
        log.info("saguaro serve replica ready: one engine, %s", self.engine.describe())

    # ------------------------------------------------------------ lifecycle
    def _start_engine(self) -> tuple[Any, ServedEngine]:
        from saguaro_ray.engine.frontend import Frontend
        from saguaro_ray.model_set import ModelSet
        from saguaro_ray.runtime.engine import Engine, connect

        cfg = self.cfg
        spec = cfg.spec()
        # the models the allowed strategies run, resolved and opened once here
        models = ModelSet.open(cfg.target, cfg.draft, cfg.qualifier, modes=[spec])
        if cfg.connect:
            handle, owned = connect(cfg.connect, namespace=cfg.namespace), False
        else:
            handle, owned = Engine.launch(cfg.launch_config(models.refs)), True
        engine = ServedEngine(
            handle=handle,
            owned=owned,
            frontend=Frontend.for_models(models, spec),
            prompt_bytes=prompt_byte_limit(max_token_bytes(models.tokenizer), models.max_context),
        )
        return models.tokenizer, engine

    def _shutdown_engine(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None and engine.owned:
            try:
                engine.handle.shutdown()
            except Exception:
                log.warning("engine shutdown failed", exc_info=True)

    def close(self) -> None:
        """Stop the metrics poller and the engine if this replica launched it
        (an attached engine keeps running). Serve calls it once the requests in
        flight have finished (it waits up to ``request_timeout_s`` for them);
        anything arriving from now on gets 503."""
        admission = getattr(self, "admission", None)
        if admission is not None:
            admission.draining = True
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.cancel()
        self._shutdown_engine()

    # ------------------------------------------------------------ health
    async def _engine_health(self) -> tuple[bool, str]:
        """The engine's ``EngineHandle.ahealth()``. Callers arriving while a
        probe is out share its answer: ``/health`` needs no key, and each
        probe costs the coordinator a thread."""
        if self._health_probe is None or self._health_probe.done():
            self._health_probe = asyncio.ensure_future(self.engine.handle.ahealth(self.cfg.health_check_timeout_s))
        return await asyncio.shield(self._health_probe)

    async def check_health(self) -> None:
        """Serve's replica health check: raising makes Serve replace this
        replica — so it raises when the engine cannot serve (a worker gone for
        good, a dead or unresponsive coordinator), not merely when it is slow."""
        ok, why = await self._engine_health()
        if not ok:
            raise RuntimeError(f"the engine cannot serve: {why}")

    async def health(self) -> Any:
        """``GET /health``: 200 only when the engine can serve and the replica
        is not draining (load balancers and Serve read it; see :meth:`check_health`).
        ``data_plane``: what the engine's tensors travel over and, when that
        is a fallback (gloo on GPUs, or the control frames), why — a slower
        engine, not a down one, so it does not change the status."""
        ok, why = await self._engine_health()
        serving = ok and not self.admission.draining
        overall = "ok" if serving else "draining" if self.admission.draining else "unhealthy"
        body: dict[str, Any] = {"status": overall, "engine": "ok" if ok else f"down: {why}"}
        if ok and self._data_plane is None:  # not polled yet: ask once
            await self._refresh_engine_metrics()
        if self._data_plane is not None:
            body["data_plane"] = self._data_plane
        return JSONResponse(body, status_code=200 if serving else 503)

    # ------------------------------------------------------------ metrics
    async def _poll_engine_metrics(self) -> None:
        while True:
            await self._refresh_engine_metrics()
            await asyncio.sleep(self.cfg.metrics_interval_s)

    async def _refresh_engine_metrics(self) -> dict[str, Any] | None:
        """The coordinator's metrics into the gauges; None when it did not answer."""
        try:
            m = await asyncio.wait_for(self.engine.handle.coordinator.metrics.remote(), ENGINE_PROBE_S)
        except Exception:
            log.debug("engine metrics unavailable", exc_info=True)
            return None
        self.metrics.engine_metrics(m)
        self._data_plane = PlaneStatus.from_metrics(m).describe()
        return m

    async def metrics_snapshot(self, request: Request) -> Any:
        """``GET /v1/saguaro/metrics``: the replica's metrics and its resources now."""
        self.keys.check(request)
        fresh = await self._refresh_engine_metrics()
        snapshot = self.metrics.snapshot()
        snapshot["resources"] = await self._resources(fresh)
        return snapshot

    async def _resources(self, fresh: dict[str, Any] | None) -> dict[str, Any]:
        """What a leak would grow, read now: this replica's Python threads and
        memory (:func:`~saguaro_ray.runtime.process_memory.memory`, as for
        each process below), the engine's samples queued or running and its
        coordinator's process (``fresh``: the coordinator's metrics) and each
        worker's pid, memory, free KV blocks and Python threads
        (when this replica launched the engine: an attached engine's workers
        belong to whoever launched it, and are not listed). The
        engine or its workers not answering within ``ENGINE_PROBE_S`` are
        None: the snapshot itself never hangs. A load test compares it before
        and after (``saguaro_ray.jobs.load_test``)."""
        try:  # the workers' info calls block: off the event loop
            infos = await asyncio.wait_for(asyncio.to_thread(self.engine.handle.worker_info), ENGINE_PROBE_S)
        except Exception:
            log.debug("engine workers unavailable", exc_info=True)
            infos = None
        workers = None if infos is None else {
            role: {
                "pid": i["pid"],  # one per worker actor; a sharded target's rank 0
                **{k: i[k] for k in MEMORY_FIELDS},  # as the worker read its own
                "free_kv_blocks": i["free_kv_blocks"],
                "kv_blocks": i["kv_tokens"] // i["block_size"],
                "python_threads": i["python_threads"],
                "thread_kinds": i["thread_kinds"],
                # a sharded target's other ranks: processes of their own, sampled too
                "ranks": [{k: r[k] for k in ("tp_rank", "pid", "python_threads", *MEMORY_FIELDS)} for r in i.get("ranks", [])[1:]],
            }
            for role, i in infos.items()
        }
        engine = {
            "active": None if fresh is None else fresh["active"],
            "queued": None if fresh is None else fresh["queued"],
            "coordinator": None if fresh is None else {**fresh["process"], "timeline_bytes": fresh["timeline_bytes"]},
            "workers": workers,
        }
        own = {"python_threads": len(own_threads()), "thread_kinds": thread_kinds(), **memory()}
        return {**own, "ongoing_requests": self.admission.active, "engine": engine}
