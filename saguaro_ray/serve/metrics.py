"""Serving metrics through ``ray.util.metrics`` (exported by Ray's Prometheus
endpoint as ``ray_saguaro_serve_*``), mirrored in a plain per-replica
snapshot served at ``GET /v1/saguaro/metrics`` for environments without
Prometheus.

A replica runs one engine; what tells requests apart is the strategy each
asked for (``strategy``: the request's mode, ``auto`` when it named none and
the deployment's default is auto, ``-`` before it is known), and, per round,
the mode its sequences ran (``mode``: what ``auto`` chose).

===================================  =========  ==========================================
metric                               kind       tags
===================================  =========  ==========================================
saguaro_serve_requests               Counter    route, strategy, status (HTTP code)
saguaro_serve_generated_tokens       Counter    route, strategy
saguaro_serve_prompt_tokens          Counter    route, strategy
saguaro_serve_request_latency_s      Histogram  route, strategy
saguaro_serve_time_to_first_token_s  Histogram  route, strategy  (streaming requests)
saguaro_serve_inter_token_latency_s  Histogram  route, strategy  (streaming; per token)
saguaro_serve_rounds                 Counter    strategy, mode   (rounds its samples ran in each mode)
saguaro_serve_mean_accepted          Histogram  strategy         (per sample, speculative rounds)
saguaro_serve_mean_k                 Histogram  strategy         (per sample: mean K of its speculative rounds)
saguaro_serve_cache_hit_rate         Histogram  strategy         (per sample, ssd)
saguaro_serve_dropped_frames         Gauge      role             (control-plane frames dropped)
saguaro_serve_engine_queued          Gauge                       (samples waiting for admission)
saguaro_serve_ongoing_requests       Gauge                       (generation requests this replica holds)
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
        rt, rts, st = ("app", "route", "strategy"), ("app", "route", "strategy", "status"), ("app", "strategy")
        self.requests = m.Counter("saguaro_serve_requests", "HTTP requests answered", tag_keys=rts)
        self.generated = m.Counter("saguaro_serve_generated_tokens", "completion tokens returned", tag_keys=rt)
        self.prompt = m.Counter("saguaro_serve_prompt_tokens", "prompt tokens processed", tag_keys=rt)
        self.latency = m.Histogram("saguaro_serve_request_latency_s", "request latency (s)", _LATENCY_BOUNDS, tag_keys=rt)
        self.ttft = m.Histogram("saguaro_serve_time_to_first_token_s", "time to first token (s), streaming", _LATENCY_BOUNDS, tag_keys=rt)
        self.itl = m.Histogram("saguaro_serve_inter_token_latency_s", "inter-token latency (s), streaming", _TOKEN_BOUNDS, tag_keys=rt)
        self.rounds = m.Counter("saguaro_serve_rounds", "rounds a request's samples ran, by the mode each ran in", tag_keys=("app", "strategy", "mode"))
        self.accepted = m.Histogram("saguaro_serve_mean_accepted", "mean accepted draft tokens per round", _ACCEPT_BOUNDS, tag_keys=st)
        self.mean_k = m.Histogram("saguaro_serve_mean_k", "mean draft tokens per speculative round", _ACCEPT_BOUNDS, tag_keys=st)
        self.hit_rate = m.Histogram("saguaro_serve_cache_hit_rate", "SSD speculation cache hit rate", _RATE_BOUNDS, tag_keys=st)
        self.dropped = m.Gauge("saguaro_serve_dropped_frames", "control frames dropped (malformed/unauthenticated)", tag_keys=("app", "role"))
        self.queued = m.Gauge("saguaro_serve_engine_queued", "samples waiting for admission", tag_keys=("app",))
        self.ongoing = m.Gauge("saguaro_serve_ongoing_requests", "generation requests this replica holds", tag_keys=("app",))
        metrics = (
            self.requests, self.generated, self.prompt, self.latency, self.ttft, self.itl, self.rounds,
            self.accepted, self.mean_k, self.hit_rate, self.dropped, self.queued, self.ongoing,
        )  # fmt: skip
        for metric in metrics:
            metric.set_default_tags(base)
        self.names = [metric.info["name"] for metric in metrics]
        # the snapshot: plain numbers, per replica
        self._counts: dict[str, float] = defaultdict(float)
        self._obs: dict[str, list[float]] = defaultdict(list)
        self._gauges: dict[str, float] = {}

    # --------------------------------------------------------------- record
    def request(self, route: str, strategy: str, status: int, latency_s: float | None = None) -> None:
        tags = {"route": route, "strategy": strategy, "status": str(status)}
        self.requests.inc(1, tags)
        with self._lock:
            self._counts[f"requests{{route={route},strategy={strategy},status={status}}}"] += 1
            self._counts["requests_total"] += 1
        if latency_s is not None:
            self.latency.observe(latency_s, {"route": route, "strategy": strategy})
            self._observe("request_latency_s", latency_s)

    def tokens(self, route: str, strategy: str, prompt: int, completion: int) -> None:
        tags = {"route": route, "strategy": strategy}
        if completion:
            self.generated.inc(completion, tags)
        if prompt:
            self.prompt.inc(prompt, tags)
        with self._lock:
            self._counts["generated_tokens"] += completion
            self._counts["prompt_tokens"] += prompt

    def first_token(self, route: str, strategy: str, seconds: float) -> None:
        self.ttft.observe(seconds, {"route": route, "strategy": strategy})
        self._observe("time_to_first_token_s", seconds)

    def inter_token(self, route: str, strategy: str, seconds: float, tokens: int) -> None:
        per = seconds / max(tokens, 1)
        tags = {"route": route, "strategy": strategy}
        for _ in range(max(tokens, 1)):
            self.itl.observe(per, tags)
        self._observe("inter_token_latency_s", per, max(tokens, 1))

    def sample_stats(self, strategy: str, stats: dict[str, Any] | None) -> None:
        """One finished sample's round statistics (``GenerationResult.stats``)."""
        if not stats:
            return
        tags = {"strategy": strategy}
        for mode, rounds in (stats.get("strategy") or {}).items():
            if rounds:
                self.rounds.inc(float(rounds), {**tags, "mode": str(mode)})
                with self._lock:
                    self._counts[f"rounds{{strategy={strategy},mode={mode}}}"] += rounds
        for key, histogram in (("mean_accepted", self.accepted), ("mean_k", self.mean_k), ("cache_hit_rate", self.hit_rate)):
            if stats.get(key) is not None:
                histogram.observe(float(stats[key]), tags)
                self._observe(key, float(stats[key]))

    def engine_metrics(self, metrics: dict[str, Any]) -> None:
        """The engine coordinator's metrics (``EngineHandle.metrics()``) into the gauges."""
        for role, count in (metrics.get("dropped_frames") or {}).items():
            self.dropped.set(float(count), {"role": str(role)})
            with self._lock:
                self._gauges[f"dropped_frames{{role={role}}}"] = float(count)
        if metrics.get("queued") is not None:
            self.queued.set(float(metrics["queued"]))
            with self._lock:
                self._gauges["engine_queued"] = float(metrics["queued"])

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
