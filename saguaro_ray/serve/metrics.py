"""Serving metrics through ``ray.util.metrics`` (exported by Ray's Prometheus
endpoint as ``ray_saguaro_serve_*``), mirrored in a plain per-replica
snapshot served at ``GET /v1/saguaro/metrics`` for environments without
Prometheus.

===================================  =========  ==========================================
metric                               kind       tags
===================================  =========  ==========================================
saguaro_serve_requests               Counter    route, engine, status (HTTP code)
saguaro_serve_generated_tokens       Counter    route, engine
saguaro_serve_prompt_tokens          Counter    route, engine
saguaro_serve_request_latency_s      Histogram  route, engine
saguaro_serve_time_to_first_token_s  Histogram  route, engine  (streaming requests)
saguaro_serve_inter_token_latency_s  Histogram  route, engine  (streaming; per token)
saguaro_serve_mean_accepted          Histogram  engine         (per sample, sd/ssd/pyramid)
saguaro_serve_cache_hit_rate         Histogram  engine         (per sample, ssd)
saguaro_serve_dropped_frames         Gauge      engine, role   (control-plane frames dropped)
saguaro_serve_engine_queued          Gauge      engine         (samples waiting for admission)
saguaro_serve_ongoing_requests       Gauge                     (generation requests this replica holds)
===================================  =========  ==========================================
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

_LATENCY_BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_TOKEN_BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
_ACCEPT_BOUNDS = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0]
_RATE_BOUNDS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


class ServeMetrics:
    def __init__(self, app: str) -> None:
        from ray.util import metrics as m

        self._lock = threading.Lock()
        base = {"app": app}
        rt, rte = ("app", "route", "engine"), ("app", "route", "engine", "status")
        self.requests = m.Counter("saguaro_serve_requests", "HTTP requests answered", tag_keys=rte)
        self.generated = m.Counter("saguaro_serve_generated_tokens", "completion tokens returned", tag_keys=rt)
        self.prompt = m.Counter("saguaro_serve_prompt_tokens", "prompt tokens processed", tag_keys=rt)
        self.latency = m.Histogram("saguaro_serve_request_latency_s", "request latency (s)", _LATENCY_BOUNDS, tag_keys=rt)
        self.ttft = m.Histogram("saguaro_serve_time_to_first_token_s", "time to first token (s), streaming", _LATENCY_BOUNDS, tag_keys=rt)
        self.itl = m.Histogram("saguaro_serve_inter_token_latency_s", "inter-token latency (s), streaming", _TOKEN_BOUNDS, tag_keys=rt)
        self.accepted = m.Histogram("saguaro_serve_mean_accepted", "mean accepted draft tokens per round", _ACCEPT_BOUNDS, tag_keys=("app", "engine"))
        self.hit_rate = m.Histogram("saguaro_serve_cache_hit_rate", "SSD speculation cache hit rate", _RATE_BOUNDS, tag_keys=("app", "engine"))
        self.dropped = m.Gauge("saguaro_serve_dropped_frames", "control frames dropped (malformed/unauthenticated)", tag_keys=("app", "engine", "role"))
        self.queued = m.Gauge("saguaro_serve_engine_queued", "samples waiting for admission", tag_keys=("app", "engine"))
        self.ongoing = m.Gauge("saguaro_serve_ongoing_requests", "generation requests this replica holds", tag_keys=("app",))
        for metric in (self.requests, self.generated, self.prompt, self.latency, self.ttft, self.itl, self.accepted, self.hit_rate, self.dropped, self.queued, self.ongoing):
            metric.set_default_tags(base)
        self.names = [
            "saguaro_serve_requests", "saguaro_serve_generated_tokens", "saguaro_serve_prompt_tokens",
            "saguaro_serve_request_latency_s", "saguaro_serve_time_to_first_token_s",
            "saguaro_serve_inter_token_latency_s", "saguaro_serve_mean_accepted",
            "saguaro_serve_cache_hit_rate", "saguaro_serve_dropped_frames", "saguaro_serve_engine_queued",
            "saguaro_serve_ongoing_requests",
        ]  # fmt: skip
        # the snapshot: plain numbers, per replica
        self._counts: dict[str, float] = defaultdict(float)
        self._obs: dict[str, list[float]] = defaultdict(list)
        self._gauges: dict[str, float] = {}

    # --------------------------------------------------------------- record
    def request(self, route: str, engine: str, status: int, latency_s: float | None = None) -> None:
        tags = {"route": route, "engine": engine, "status": str(status)}
        self.requests.inc(1, tags)
        with self._lock:
            self._counts[f"requests{{route={route},engine={engine},status={status}}}"] += 1
            self._counts["requests_total"] += 1
        if latency_s is not None:
            self.latency.observe(latency_s, {"route": route, "engine": engine})
            self._observe("request_latency_s", latency_s)

    def tokens(self, route: str, engine: str, prompt: int, completion: int) -> None:
        tags = {"route": route, "engine": engine}
        if completion:
            self.generated.inc(completion, tags)
        if prompt:
            self.prompt.inc(prompt, tags)
        with self._lock:
            self._counts["generated_tokens"] += completion
            self._counts["prompt_tokens"] += prompt

    def first_token(self, route: str, engine: str, seconds: float) -> None:
        self.ttft.observe(seconds, {"route": route, "engine": engine})
        self._observe("time_to_first_token_s", seconds)

    def inter_token(self, route: str, engine: str, seconds: float, tokens: int) -> None:
        per = seconds / max(tokens, 1)
        tags = {"route": route, "engine": engine}
        for _ in range(max(tokens, 1)):
            self.itl.observe(per, tags)
        self._observe("inter_token_latency_s", per, max(tokens, 1))

    def sample_stats(self, engine: str, stats: dict[str, Any] | None) -> None:
        if not stats:
            return
        if stats.get("mean_accepted") is not None:
            self.accepted.observe(float(stats["mean_accepted"]), {"engine": engine})
            self._observe("mean_accepted", float(stats["mean_accepted"]))
        if stats.get("cache_hit_rate") is not None:
            self.hit_rate.observe(float(stats["cache_hit_rate"]), {"engine": engine})
            self._observe("cache_hit_rate", float(stats["cache_hit_rate"]))

    def engine_metrics(self, engine: str, metrics: dict[str, Any]) -> None:
        for role, count in (metrics.get("dropped_frames") or {}).items():
            self.dropped.set(float(count), {"engine": engine, "role": str(role)})
            with self._lock:
                self._gauges[f"dropped_frames{{engine={engine},role={role}}}"] = float(count)
        if metrics.get("queued") is not None:
            self.queued.set(float(metrics["queued"]), {"engine": engine})
            with self._lock:
                self._gauges[f"engine_queued{{engine={engine}}}"] = float(metrics["queued"])

    def ongoing_requests(self, count: int) -> None:
        self.ongoing.set(float(count))
        with self._lock:
            self._gauges["ongoing_requests"] = float(count)

    def _observe(self, name: str, value: float, times: int = 1) -> None:
        with self._lock:
            obs = self._obs[name]
            obs.extend([value] * times)
            del obs[:-1000]  # keep the last 1000 observations

    # --------------------------------------------------------------- read
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            hist = {}
            for name, values in self._obs.items():
                s = sorted(values)
                hist[name] = {"count": len(s), "p50": s[len(s) // 2] if s else None, "max": s[-1] if s else None}
            return {"metrics": list(self.names), "counters": dict(self._counts), "gauges": dict(self._gauges), "histograms": hist}
