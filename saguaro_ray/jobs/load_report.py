"""What the load test concludes from what it saw: the resource checks after
the load (threads, KV pools, an idle engine), the exact-output comparison with
the single-request references, the server's status counts, latency quantiles,
and the report and its one-screen summary. Pure functions of the outcomes and
the metrics snapshots, so they are tested without a server
(:mod:`saguaro_ray.jobs.load_test` runs the load)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from saguaro_ray.jobs.load_clients import Outcome, Spec
from saguaro_ray.jobs.soak import soak_text

if TYPE_CHECKING:
    from saguaro_ray.jobs.load_test import LoadOptions


def _more_threads(now: dict[str, Any], baseline: dict[str, Any]) -> str | None:
    """How a process's threads grew past ``baseline`` (None: they did not).
    A thread pool starts its workers on demand up to its bound, so more
    workers of a pool the baseline already had are not a leak; a new pool,
    or any other thread, is."""
    pooled = sum(
        max(0, n - baseline["thread_kinds"][kind])
        for kind, n in now["thread_kinds"].items()
        if kind.startswith("ThreadPoolExecutor-") and kind in baseline["thread_kinds"]
    )
    if now["python_threads"] - pooled <= baseline["python_threads"]:
        return None
    grown = {k: f"{baseline['thread_kinds'].get(k, 0)} -> {n}" for k, n in now["thread_kinds"].items() if n > baseline["thread_kinds"].get(k, 0)}
    return f"threads {baseline['python_threads']} -> {now['python_threads']} ({grown})"


def resource_problems(now: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """What differs from an idle server with ``baseline``'s threads (empty: back to baseline)."""
    problems = []
    if now["ongoing_requests"]:
        problems.append(f"replica holds {now['ongoing_requests']} requests")
    if (grown := _more_threads(now, baseline)) is not None:
        problems.append(f"replica {grown}")
    eng = now["engine"]
    if eng["active"] is None or eng["workers"] is None:
        return [*problems, "engine did not answer"]
    if eng["active"] or eng["queued"]:
        problems.append(f"engine: {eng['active']} samples active, {eng['queued']} queued")
    for role, w in eng["workers"].items():
        if w["free_kv_blocks"] != w["kv_blocks"]:
            problems.append(f"engine {role}: {w['free_kv_blocks']} of {w['kv_blocks']} KV blocks free")
        if (grown := _more_threads(w, baseline["engine"]["workers"][role])) is not None:
            problems.append(f"engine {role}: {grown}")
    return problems


def _server_errors(end: dict[str, Any], start: dict[str, Any]) -> dict[str, int]:
    """The replica's 5xx answers during the load, by route, strategy and status."""
    out = {}
    for key, count in end["counters"].items():
        if key.startswith("requests{") and ",status=5" in key:
            grown = int(count - start["counters"].get(key, 0))
            if grown:
                out[key] = grown
    return out


def _statuses(snapshot: dict[str, Any]) -> Counter[str]:
    """The replica's answers so far by HTTP status (499: it saw the client leave)."""
    out: Counter[str] = Counter()
    for key, count in snapshot["counters"].items():
        if key.startswith("requests{"):
            out[key.rsplit("status=", 1)[1].rstrip("}")] += int(count)
    return out


def disagreements(refs: dict[Spec, dict[int, tuple[str, str]]]) -> list[str]:
    """T = 0 references that differ between strategies (each mode must give the target's output)."""
    groups: dict[tuple, dict[str, Any]] = {}
    for spec, ref in refs.items():
        key = (spec.route, spec.text, spec.max_tokens, spec.stop, spec.ignore_eos, spec.n)
        groups.setdefault(key, {})[spec.strategy] = ref
    return [f"{key}: {by_strategy}" for key, by_strategy in groups.items() if len({json.dumps(r, sort_keys=True) for r in by_strategy.values()}) > 1]


def mismatch(out: Outcome, ref: dict[int, tuple[str, str]]) -> str | None:
    got = {i: (out.texts.get(i, ""), out.finish.get(i)) for i in ref}
    return None if got == ref else f"{out.spec}: streamed {got} != reference {ref}"


def _quantiles(values: list[float]) -> dict[str, Any]:
    s = sorted(values)
    pick = lambda q: round(s[min(len(s) - 1, int(q * len(s)))], 6) if s else None
    return {"count": len(s), "p50": pick(0.5), "p99": pick(0.99), "max": round(s[-1], 6) if s else None}


def build_report(
    opts: LoadOptions,
    split: tuple[int, int, int],
    outcomes: list[Outcome],
    refs: dict[Spec, Any],
    disagree: list[str],
    start: dict[str, Any],
    end: dict[str, Any],
    problems: list[str],
    load_s: float,
    settle_s: float,
) -> dict[str, Any]:
    by_kind = {k: [o for o in outcomes if o.kind == k] for k in ("good", "disconnect", "poison")}
    good = by_kind["good"]
    checked = [o for o in good if o.spec in refs and o.error in (None, "T=0 mismatch")]
    mismatches = [o.detail for o in good if o.error == "T=0 mismatch"]
    streams = [o for o in good if o.error is None]
    # one sample's tokens after its first, over the time they took
    tpot = [sum(o.gaps_s) / (o.completion_tokens - 1) for o in streams if o.spec.n == 1 and (o.completion_tokens or 0) > 1 and o.gaps_s]
    hung_up = [o for o in by_kind["disconnect"] if o.error is None and o.spec and len(o.finish) < o.spec.n]
    statuses = _statuses(end)
    statuses.subtract(_statuses(start))
    errors = {k: dict(Counter(o.error for o in v if o.error is not None)) for k, v in by_kind.items()}
    failures = []
    if errors["good"]:
        failures.append(f"well-behaved clients got errors: {errors['good']}")
    if disagree:
        failures.append(f"{len(disagree)} T = 0 references differ between strategies")
    if errors["poison"]:
        failures.append(f"poison not refused with a 4xx OpenAI error: {errors['poison']}")
    if errors["disconnect"]:
        failures.append(f"disconnecting clients got errors before hanging up: {errors['disconnect']}")
    if problems:
        failures.append("resources not back to baseline: " + "; ".join(problems))
    return {
        "options": asdict(opts) | {"api_key": None},
        "clients": dict(zip(("good", "disconnect", "poison"), split)),
        "load_s": round(load_s, 3),
        "requests": {k: len(v) for k, v in by_kind.items()},
        "errors": errors,
        "error_examples": [f"{o.kind} {o.name}: {o.error}: {o.detail}" for o in outcomes if o.error][:20],
        "exact": {"t0_checked": len(checked), "t0_exact": len(checked) - len(mismatches), "mismatches": mismatches[:10]},
        "references": {"count": len(refs), "strategies_disagree": disagree[:10]},
        "completion_tokens": sum(o.completion_tokens or 0 for o in streams),
        "latency_s": {
            "ttft": _quantiles([o.ttft_s for o in streams if o.ttft_s is not None]),
            "itl": _quantiles([g for o in streams for g in o.gaps_s]),
            "tpot": _quantiles(tpot),
        },
        "disconnects": {"hung_up": len(hung_up), "server_499": statuses.get("499", 0)},
        "server_statuses": dict(statuses),
        "server_errors": _server_errors(end, start),
        "poison_status": {name: dict(Counter(o.status for o in by_kind["poison"] if o.name == name)) for name in sorted({o.name for o in by_kind["poison"]})},
        "resources": {"baseline": start["resources"], "after": end["resources"], "settle_s": round(settle_s, 3), "problems": problems},
        "failures": failures,
        "ok": not failures,
    }


def summary_text(report: dict[str, Any]) -> str:
    lat = report["latency_s"]
    ms = lambda q: "-" if q is None else f"{q * 1000:.1f} ms"
    lines = [
        f"clients {report['clients']}, load {report['load_s']:.0f} s, requests {report['requests']}",
        f"errors: {report['errors']}",
        f"T = 0 exact: {report['exact']['t0_exact']} of {report['exact']['t0_checked']} (references: {report['references']['count']})",
        f"disconnects: {report['disconnects']['hung_up']} hung up, server saw {report['disconnects']['server_499']} leave",
        f"TTFT p50 {ms(lat['ttft']['p50'])} p99 {ms(lat['ttft']['p99'])}; ITL p50 {ms(lat['itl']['p50'])} p99 {ms(lat['itl']['p99'])}",
        f"per token p50 {ms(lat['tpot']['p50'])} p99 {ms(lat['tpot']['p99'])} ({report['completion_tokens']} tokens)",
        f"resources back in {report['resources']['settle_s']:.1f} s" if not report["resources"]["problems"] else f"resources: {report['resources']['problems']}",
    ]
    kill = report.get("coordinator_kill")
    if kill:
        lines.append(f"coordinator killed at {kill['at_s']:.1f} s (pid {kill['pid']}) with {kill['good_requests_in_flight']} well-behaved requests in flight")
    if "soak" in report:
        lines.append(soak_text(report["soak"]))
    lines += [f"FAIL: {f}" for f in report["failures"]] or ["OK"]
    return "\n".join(lines)
