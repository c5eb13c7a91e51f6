"""One Serve replica's engines: starting and stopping them, their health, their metrics.

:class:`ReplicaCore` is a plain class holding what one replica has — its
config, API keys, metrics, admission, tokenizer and engines. The Serve
ingress class in ``app.py`` creates it, then builds the replica's HTTP app
over it (the OpenAI routes are :mod:`saguaro_ray.serve.openai_routes`').
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from saguaro_ray.runtime.threads import own_threads, thread_kinds
from saguaro_ray.serve.auth import APIKeys
from saguaro_ray.serve.config import EngineEntry, ServeAppConfig, parse_config
from saguaro_ray.serve.limits import Admission, max_token_bytes, prompt_byte_limit
from saguaro_ray.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

ENGINE_PROBE_S = 10.0  # how long a metrics snapshot waits for one engine's coordinator or workers


@dataclass
class ServedEngine:
    """One engine of the replica, with what requests to it are checked against."""

    entry: EngineEntry
    handle: Any  # EngineHandle
    owned: bool  # launched by this replica (else attached by name: someone else stops it)
    frontend: Any  # a Frontend without a scheduler: validates prompts against this engine's context
    mode: str
    k: int | None
    prompt_bytes: int  # text beyond this many bytes cannot fit the context (see limits.prompt_byte_limit)


class ReplicaCore:
    """One replica's state: the engines, the tokenizer, the API keys, admission and metrics."""

    async def start(self, config: dict[str, Any] | ServeAppConfig) -> None:
        self.cfg = parse_config(config)
        self.keys = APIKeys(self.cfg)
        self.metrics = ServeMetrics(self.cfg.model_name)
        self.admission = Admission(self.cfg.max_ongoing_requests, self.metrics.ongoing_requests)
        self._health_probe: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        self.tokenizer, self.engines = await loop.run_in_executor(None, self._start_engines)
        self._poller = asyncio.ensure_future(self._poll_engine_metrics())
        log.info("saguaro serve replica ready: engines %s", [e.entry.describe() for e in self.engines.values()])

    # ------------------------------------------------------------ lifecycle
    def _start_engines(self) -> tuple[Any, dict[str, ServedEngine]]:
        from saguaro_ray.engine.frontend import Frontend
        from saguaro_ray.model_set import ModelSet
        from saguaro_ray.runtime.engine import Engine, connect

        cfg = self.cfg
        # every engine's models, resolved and opened once here (not once per engine)
        models = ModelSet.open(cfg.target, cfg.draft, cfg.qualifier, modes=[e.spec() for e in cfg.engines])
        token_bytes = max_token_bytes(models.tokenizer)

        def start(entry: EngineEntry) -> tuple[Any, bool]:
            if entry.connect:
                return connect(entry.connect, namespace=entry.namespace), False
            return Engine.launch(cfg.launch_config(entry, models.refs)), True

        engines: dict[str, ServedEngine] = {}
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
                own = models.restrict(spec)  # this engine's models: its context window is theirs
                engines[name] = ServedEngine(
                    entry=entry,
                    handle=handle,
                    owned=owned,
                    frontend=Frontend.for_models(own, spec.mode),
                    mode=spec.mode,
                    k=spec.k if spec.mode in ("sd", "ssd") else None,
                    prompt_bytes=prompt_byte_limit(token_bytes, own.max_context),
                )
        if errors:
            self._shutdown_engines(engines)
            raise errors[0]
        return models.tokenizer, engines

    def _shutdown_engines(self, engines: dict[str, ServedEngine]) -> None:
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

    # ------------------------------------------------------------ health
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

    async def health(self) -> Any:
        """``GET /health``: 200 only when every engine can serve and the replica
        is not draining (load balancers and Serve read it; see :meth:`check_health`)."""
        status = {name: "ok" if ok else f"down: {why}" for name, (ok, why) in (await self._engine_health()).items()}
        ok = all(v == "ok" for v in status.values()) and not self.admission.draining
        overall = "ok" if ok else "draining" if self.admission.draining else "unhealthy"
        return JSONResponse({"status": overall, "engines": status}, status_code=200 if ok else 503)

    # ------------------------------------------------------------ metrics
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

    async def metrics_snapshot(self, request: Request) -> Any:
        """``GET /v1/saguaro/metrics``: the replica's metrics and its resources now."""
        self.keys.check(request)
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
