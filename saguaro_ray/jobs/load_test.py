"""``python -m saguaro_ray.jobs.load_test --config deploy/serve/zoo-cpu.yaml --clients 64 --seconds 120``

A load test of the OpenAI server (issue 20's target): N concurrent streaming
clients for a while, a fraction of them hanging up mid-stream and a fraction
sending poison (see :mod:`saguaro_ray.jobs.load_clients`). It passes (exit
status 0) when

* no well-behaved client saw an error (HTTP, stream or transport; a 429 is one);
* every T = 0 output — each sample of it — equals its single-request
  reference (the same request, non-streamed and alone, made before the load),
  and the references agree across strategies (every mode gives the target's output);
* every poison request got a 4xx (not 429) OpenAI-shaped error;
* no disconnecting client saw an error before it hung up — with
  ``--kill-coordinator S`` too, the engine's coordinator SIGKILLed S seconds
  into the load (``--config`` only: the engine runs in this test's own Ray
  instance): every request in flight then resumes from what it emitted, so
  the same checks (no error, every T = 0 output exact) say none was lost;
* afterwards (within a bounded wait for releases that run asynchronously)
  the engine is idle — no sample queued or running, so the hung-up
  requests were aborted — every worker's KV pool is full again, no worker
  and not the replica holds more Python threads than at the baseline taken
  after a warm-up, and the replica holds no request.

It reports requests and errors by class per kind of client, the exact-output
count, the server's 499s (requests it saw the client leave), and p50/p99 of
time to first token, of the gap between content chunks (inter-token latency
as a streaming client sees it; a speculative round delivers several tokens in
one chunk) and of time per output token. ``--config`` starts the Serve
application from a Serve YAML on a free loopback port in a Ray instance of its
own, with an API key (so a bad bearer token is poison too); ``--url`` drives a
server already running (``--api-key`` if it checks keys). The resources come
from the replica's ``/v1/saguaro/metrics`` (its ``resources`` section): its
one engine, which every strategy's requests share.

``--soak MINUTES`` runs the load that long and samples every process's
memory, threads and KV blocks meanwhile (``--sample-every``, default 60 s);
it FAILS when a process's RSS keeps growing after the warm-up (the bound
and why: :mod:`saguaro_ray.jobs.soak`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from saguaro_ray.errors import SaguaroError
from saguaro_ray.jobs.load_clients import (
    Outcome,
    Spec,
    client_loop,
    disconnect_spec,
    good_specs,
    poison_request,
    poisons,
    stream_request,
)
from saguaro_ray.jobs.load_report import build_report, disagreements, mismatch, resource_problems, summary_text
from saguaro_ray.jobs.soak import SoakPlan, add_to_report, sample_until

log = logging.getLogger("saguaro_ray.jobs.load_test")

REQUEST_TIMEOUT_S = 300.0  # one request, or the gap between two of its chunks
SETTLE_S = 60.0  # how long releases (aborts, KV frees) may take once the load stops
POISON_PAUSE_S = 0.2  # a poison client's pause between requests: a client's pace, not a flood
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # the server's default (ServeAppConfig.max_body_bytes)


@dataclass(frozen=True)
class LoadOptions:
    """One load test: who connects, for how long, and how they misbehave."""

    clients: int = 64  # concurrent streaming clients
    seconds: float = 120.0  # of load, after the references and a warm-up
    disconnect: float = 0.1  # fraction of clients that hang up mid-stream
    poison: float = 0.05  # fraction of clients that send poison bodies
    seed: int = 0  # of every client's random choices
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # the server's limit, which the "huge body" poison exceeds
    kill_coordinator_s: float | None = None  # SIGKILL the engine's coordinator this far into the load
    soak: SoakPlan | None = None  # sample every process's memory during the load, and judge its trend

    def split(self) -> tuple[int, int, int]:
        """(good, disconnecting, poison) clients; a fraction above 0 gets at least one."""

        def share(fraction: float) -> int:
            return max(1, round(self.clients * fraction)) if fraction > 0 else 0

        disconnect, poison = share(self.disconnect), share(self.poison)
        if disconnect + poison >= self.clients:
            raise ValueError(f"{self.clients} clients leave none well-behaved with these fractions")
        return self.clients - disconnect - poison, disconnect, poison


# ------------------------------------------------------------------ server state


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _snapshot(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> dict[str, Any]:
    resp = await client.get(base + "/v1/saguaro/metrics", headers=headers)
    resp.raise_for_status()
    return resp.json()


async def _resources_now(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> dict[str, Any]:
    return (await _snapshot(client, base, headers))["resources"]


async def _settle(client: httpx.AsyncClient, base: str, headers: dict[str, str], baseline: dict[str, Any] | None) -> tuple[dict[str, Any], list[str], float]:
    """Poll the snapshot until the server is back to ``baseline`` (its own
    threads when None) or ``SETTLE_S`` passes; returns it, what is still
    off, and how long it took."""
    t0 = time.monotonic()
    while True:
        snap = await _snapshot(client, base, headers)
        problems = resource_problems(snap["resources"], baseline or snap["resources"])
        if not problems or time.monotonic() - t0 > SETTLE_S:
            return snap, problems, time.monotonic() - t0
        await asyncio.sleep(1.0)


# ------------------------------------------------------------------ references


async def _reference(client: httpx.AsyncClient, base: str, model: str, spec: Spec, headers: dict[str, str]) -> dict[int, tuple[str, str]]:
    """``spec`` alone and non-streamed: each sample's (text, finish reason)."""
    resp = await client.post(base + spec.path, json=spec.body(model, False), headers=headers)
    if resp.status_code != 200:
        raise ValueError(f"reference request {spec} failed: HTTP {resp.status_code} {resp.text[:300]}")
    out = {}
    for c in resp.json()["choices"]:
        out[c["index"]] = (c["message"]["content"] if spec.route == "chat" else c["text"], c["finish_reason"])
    return out


# ------------------------------------------------------------------ the load


async def run_load(base: str, opts: LoadOptions) -> dict[str, Any]:
    """Warm up, take the baseline, run the load, settle; returns the report."""
    good_n, disconnect_n, poison_n = opts.split()
    headers = _headers(opts.api_key)
    limits = httpx.Limits(max_connections=2 * opts.clients + 8, max_keepalive_connections=opts.clients + 4)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        resp = await client.get(base + "/v1/models", headers=headers)
        resp.raise_for_status()
        served = resp.json()["data"][0]
        model, strategies, max_k = served["id"], served["saguaro"]["allowed_modes"], served["saguaro"]["max_k"]
        specs = good_specs(strategies)
        refs = {s: await _reference(client, base, model, s, headers) for s in specs if s.temperature == 0}
        disagree = disagreements(refs)
        # warm-up: every request once, concurrently, and two hang-ups; then the baseline
        rng = random.Random(opts.seed)
        warm = [stream_request(client, base, model, s, headers, "good") for s in specs]
        warm += [stream_request(client, base, model, disconnect_spec(rng, strategies), headers, "disconnect", 2) for _ in range(2)]
        await asyncio.gather(*warm)
        start_snap, _, _ = await _settle(client, base, headers, None)
        baseline = start_snap["resources"]

        outcomes: list[Outcome] = []
        stop_at = time.monotonic() + opts.seconds
        poison_list = poisons(model, max_k, opts.api_key, opts.max_body_bytes)

        def good(c: int) -> Any:
            crng = random.Random(opts.seed * 1000 + c)

            async def send(i: int) -> Outcome:
                spec = crng.choice(specs)
                started = time.monotonic()
                out = await stream_request(client, base, model, spec, headers, "good")
                out.started, out.ended = started, time.monotonic()
                if out.error is None and spec in refs:
                    why = mismatch(out, refs[spec])
                    if why is not None:
                        out.error, out.detail = "T=0 mismatch", why
                return out

            return client_loop(stop_at, send, outcomes.append)

        def hang_up(c: int) -> Any:
            crng = random.Random(opts.seed * 1000 + 500 + c)

            async def send(i: int) -> Outcome:
                return await stream_request(client, base, model, disconnect_spec(crng, strategies), headers, "disconnect", crng.randint(1, 4))

            return client_loop(stop_at, send, outcomes.append)

        def poison(c: int) -> Any:
            async def send(i: int) -> Outcome:
                out = await poison_request(client, base, poison_list[(c + i) % len(poison_list)], headers)
                await asyncio.sleep(POISON_PAUSE_S)
                return out

            return client_loop(stop_at, send, outcomes.append)

        t_load = time.monotonic()
        loops = [good(c) for c in range(good_n)] + [hang_up(c) for c in range(disconnect_n)] + [poison(c) for c in range(poison_n)]
        killer = None if opts.kill_coordinator_s is None else asyncio.ensure_future(_kill_coordinator_after(opts.kill_coordinator_s))
        samples: list[dict[str, Any]] = []
        if opts.soak is not None:
            snapshot = lambda: _resources_now(client, base, headers)  # noqa: E731
            loops.append(sample_until(snapshot, stop_at, opts.soak.sample_every_s, samples))
        await asyncio.gather(*loops)
        load_s = time.monotonic() - t_load
        kill = None if killer is None else await killer
        # a killed coordinator restarted its workers: the resources are compared with a new baseline's processes
        end_snap, problems, settle_s = await _settle(client, base, headers, None if kill else baseline)
    report = build_report(opts, (good_n, disconnect_n, poison_n), outcomes, refs, disagree, start_snap, end_snap, problems, load_s, settle_s)
    if opts.soak is not None:
        add_to_report(report, samples, opts.soak)
    if kill is not None:
        at = kill.pop("at")
        report["coordinator_kill"] = kill
        # the well-behaved requests the kill caught mid-flight (each checked like every other)
        report["coordinator_kill"]["good_requests_in_flight"] = sum(1 for o in outcomes if o.kind == "good" and o.started <= at <= o.ended)
    return report


def coordinator_pids() -> list[int]:
    """The pids of the live engine coordinators in this process's Ray instance."""
    import ray

    actors = ray._private.state.state.actor_table(None)  # the GCS's table: no dashboard needed
    return [a["Pid"] for a in actors.values() if a["ActorClassName"] == "CoordinatorActor" and a["State"] == "ALIVE"]


async def _kill_coordinator_after(seconds: float) -> dict[str, Any]:
    """SIGKILL the engine's coordinator ``seconds`` from now (Ray restarts it)."""
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    pids = coordinator_pids()
    if len(pids) != 1:
        raise ValueError(f"--kill-coordinator: expected one engine coordinator, found {len(pids)}")
    os.kill(pids[0], signal.SIGKILL)
    at = time.monotonic()
    return {"pid": pids[0], "at_s": round(at - t0, 3), "at": at}


# ------------------------------------------------------------------ the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_from_config(path: str | Path, api_key: str) -> Iterator[tuple[str, int]]:
    """Run the Serve config at ``path`` on a free loopback port, in a Ray
    instance of its own, with ``api_key`` as the only key of our application;
    yields (base URL, its max_body_bytes) and shuts Serve and Ray down after."""
    import ray
    import yaml
    from ray import serve

    from saguaro_ray.serve.config import parse_config
    from saguaro_ray.serve.runner import OUR_BUILDERS, load_serve_config, run_config

    load_serve_config(path)  # one-line errors for a bad file
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    ours = [a for a in raw["applications"] if a.get("import_path") in OUR_BUILDERS]
    if len(ours) != 1:
        raise ValueError(f"{path}: expected one application of saguaro_ray.serve:build_app, found {len(ours)}")
    port = _free_port()
    raw["http_options"] = {**(raw.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    args = ours[0].setdefault("args", {})
    args.pop("api_keys_env", None)
    args["api_keys"] = [api_key]
    limit = parse_config(args).max_body_bytes
    from ray.serve._private.constants import SERVE_NAMESPACE

    # our own instance (as run_config would start it), with the replicas' logs kept out of the report
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 8), namespace=SERVE_NAMESPACE, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="saguaro-load-") as tmp:
        config = Path(tmp) / "serve.yaml"
        config.write_text(yaml.safe_dump(raw), encoding="utf-8")
        run_config(config, address="local", block=False)
    try:
        yield f"http://127.0.0.1:{port}{(ours[0].get('route_prefix') or '/').rstrip('/')}", limit
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# ------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m saguaro_ray.jobs.load_test", description="load test of the OpenAI server")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="a Serve YAML to start (its own Ray instance, a free loopback port)")
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", help="the key a --url server checks (with --config: generated)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--disconnect", type=float, default=0.1, help="fraction of clients that hang up mid-stream")
    p.add_argument("--poison", type=float, default=0.05, help="fraction of clients that send poison bodies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-coordinator", type=float, metavar="SECONDS", help="SIGKILL the engine's coordinator this far into the load (--config only)")
    p.add_argument("--soak", type=float, metavar="MINUTES", help="load for MINUTES (instead of --seconds), sampling every process's memory; FAIL if it keeps growing")
    p.add_argument("--sample-every", type=float, default=60.0, metavar="SECONDS", help="--soak: the sampling interval")
    p.add_argument("--soak-warmup", type=float, metavar="MINUTES", help="--soak: samples left out of the verdict (default: the first half)")
    p.add_argument("--json", help="write the report here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        soak = None if args.soak is None else SoakPlan(args.soak, args.sample_every, args.soak_warmup)
        seconds = args.seconds if soak is None else soak.minutes * 60
        opts = LoadOptions(args.clients, seconds, args.disconnect, args.poison, args.seed, args.api_key, kill_coordinator_s=args.kill_coordinator, soak=soak)
        if args.kill_coordinator is not None and not args.config:
            raise ValueError("--kill-coordinator needs --config (the engine in this test's own Ray instance)")
        opts.split()  # refuse impossible fractions before starting anything
        if args.config:
            key = args.api_key or "sk-load-" + secrets.token_hex(8)
            with serve_from_config(args.config, key) as (base, limit):
                report = asyncio.run(run_load(base, replace(opts, api_key=key, max_body_bytes=limit)))
        else:
            report = asyncio.run(run_load(args.url.rstrip("/"), opts))
    except (SaguaroError, httpx.HTTPError, ValueError) as exc:  # a bad config, no server, a refused reference
        print(f"load_test: {exc}", file=sys.stderr)
        return 2
    print(summary_text(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
