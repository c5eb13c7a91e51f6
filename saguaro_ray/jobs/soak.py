"""The soak: ``python -m saguaro_ray.jobs.load_test --config ... --soak MINUTES``.

The load test's load runs for MINUTES while every process of the server is
sampled at a fixed interval (default once a minute) through the replica's
``/v1/saguaro/metrics`` ``resources`` section, where each process reports its
own numbers (:mod:`saguaro_ray.runtime.process_memory`): the replica, the
engine's coordinator and every worker — RSS, glibc's heap in use and held
free, Python threads, and a worker's KV blocks in use.

The verdict asks whether memory keeps growing once warmed up, in the memory
a process *holds*: its anonymous resident memory less the bytes glibc keeps
freed for reuse (``held``). RSS itself moves with two things no leak grows:
the arenas keep freed chunks after a large batch (the real soak's target
kept 27-159 MiB freed, up and down with the largest recent batches), and the
kernel drops and reads back file-backed pages — libraries, mapped weights —
when other processes need memory (a draft's RSS fell 105 MiB in a minute
with its heap flat). A leak — a native cache filling, a tensor or a Python
object kept — is anonymous memory in use, and shows in ``held`` (before the
linear layers' row buckets, oneDNN's per-shape caches grew the target's RSS
less free-held bytes by 2.2 MiB/min and the draft's by 2.8 on the real
model). RSS and its slope are reported beside it.

Caches fill, arenas grow to the load's high-water mark and torch's first
batches of each shape allocate during the first minutes; so the samples of
the warm-up (by default the first half) are left out, a least-squares line is
fitted to each process's held memory over the rest, and the soak FAILS when
any process's line rises both

* faster than ``slope_mib_per_min`` (1 MiB/min): at that rate a server gains
  1.4 GiB a day — a leak that ends in an OOM kill; slower than that a
  ten-minute window cannot tell from allocator noise; and
* by more than ``growth_mib`` (8 MiB) over the window (slope x its length):
  between two samples a torch worker's memory moves by a few MiB (a large
  batch's temporaries, an arena reused or not), so a short window's fitted
  slope is noisy; requiring an 8 MiB rise keeps that noise from failing a
  short soak — over a 10-minute window the slope bound decides, over a
  1-minute one a rise must be 8 MiB/min to fail.

A process whose pid changed during the window (Ray restarted it) is judged on
its latest life. Fewer than three samples after warm-up cannot show a trend:
that is a FAIL too (the soak was too short for its interval). glibc's heap
in use gets its slope beside it, and Python's allocated blocks their first
and last count: the heap in use climbing is native memory kept (a leak, or a
native cache filling); Python's blocks climbing is Python objects kept alive.
Where ``RssAnon`` or ``mallinfo2`` cannot be read, ``held`` falls back to RSS
(less the free-held bytes when known).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("saguaro_ray.jobs.soak")

MIB = 2**20
MIN_SAMPLES = 3  # after warm-up: fewer cannot show a trend


@dataclass(frozen=True)
class SoakBound:
    """The growth that fails a soak (see the module docstring for why these)."""

    slope_mib_per_min: float = 1.0
    growth_mib: float = 8.0

    def text(self) -> str:
        return (
            f"FAIL if a process's held memory (anonymous RSS less glibc's free-held bytes) rises > {self.slope_mib_per_min:g} MiB/min "
            f"AND its fitted growth over the window > {self.growth_mib:g} MiB"
        )


@dataclass(frozen=True)
class SoakPlan:
    """How long the soak runs, how often it samples, and how much of it is warm-up."""

    minutes: float
    sample_every_s: float = 60.0
    warmup_minutes: float | None = None  # None: the first half
    bound: SoakBound = field(default_factory=SoakBound)

    def __post_init__(self) -> None:
        if not self.minutes > 0 or not self.sample_every_s > 0:
            raise ValueError(f"--soak needs positive minutes and sampling interval, got {self.minutes} min every {self.sample_every_s} s")
        if self.warmup_minutes is not None and not 0 <= self.warmup_minutes < self.minutes:
            raise ValueError(f"--soak-warmup must be at least 0 and less than the soak's {self.minutes} minutes, got {self.warmup_minutes}")

    @property
    def warmup(self) -> float:
        return self.minutes / 2 if self.warmup_minutes is None else self.warmup_minutes


# ------------------------------------------------------------------ sampling


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 2)


def held_bytes(p: dict[str, Any]) -> int:
    """The memory a process holds (see the module docstring): anonymous RSS
    (else RSS) less what glibc keeps freed (when known)."""
    anon = p.get("rss_anon_bytes")
    return (p["rss_bytes"] if anon is None else anon) - (p.get("heap_free_bytes") or 0)


def _process(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "pid": p["pid"],
        "held_mib": _mib(held_bytes(p)),
        "rss_mib": _mib(p["rss_bytes"]),
        "heap_in_use_mib": _mib(p.get("heap_in_use_bytes")),
        "heap_free_mib": _mib(p.get("heap_free_bytes")),
        "python_blocks": p.get("python_blocks"),
        "threads": p["python_threads"],
    }


def processes(resources: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each process's sample from a metrics snapshot's ``resources``: the
    replica, the coordinator and every worker (by role; a worker also its KV
    blocks in use; a sharded target's ranks > 0 as ``target.rank1``, ...).
    One that did not answer is left out of this sample."""
    out = {"replica": _process(resources)}
    engine = resources["engine"]
    if engine.get("coordinator"):
        out["coordinator"] = _process(engine["coordinator"]) | {"timeline_mib": _mib(engine["coordinator"]["timeline_bytes"])}
    for role, w in (engine.get("workers") or {}).items():
        out[role] = _process(w) | {"kv_used": w["kv_blocks"] - w["free_kv_blocks"], "kv_blocks": w["kv_blocks"]}
        for rank in w.get("ranks", []):  # a sharded target's ranks > 0, judged as processes of their own
            out[f"{role}.rank{rank['tp_rank']}"] = _process(rank)
    return out


async def sample_until(snapshot: Callable[[], Awaitable[dict[str, Any]]], stop_at: float, every_s: float, samples: list[dict[str, Any]]) -> None:
    """Append a sample of ``snapshot()``'s resources to ``samples`` now,
    every ``every_s`` seconds, and once more at ``stop_at`` (monotonic). A
    snapshot that fails is logged and skipped: the load goes on."""
    t0 = time.monotonic()

    async def take() -> None:
        at = time.monotonic() - t0
        try:
            samples.append({"t_min": round(at / 60, 3), "processes": processes(await snapshot())})
        except Exception as exc:  # noqa: BLE001 — one missed sample does not end a soak
            log.warning("soak: no sample at %.0f s (%s: %s)", at, type(exc).__name__, exc)

    for k in itertools.count(1):
        await take()
        due = t0 + k * every_s
        await asyncio.sleep(max(0.0, min(due, stop_at) - time.monotonic()))
        if due >= stop_at:
            await take()  # the load's end
            return


# ------------------------------------------------------------------ the verdict


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs`` (at least two distinct xs)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def judge(samples: list[dict[str, Any]], plan: SoakPlan) -> dict[str, Any]:
    """Each process's held-memory trend after the warm-up and the verdict (see the module docstring)."""
    bound = plan.bound
    window = [s for s in samples if s["t_min"] >= plan.warmup]
    names = list(dict.fromkeys(n for s in samples for n in s["processes"]))
    verdicts = {}
    for name in names:
        points = [(s["t_min"], s["processes"][name]) for s in window if name in s["processes"]]
        pid = points[-1][1]["pid"] if points else None
        life = [(t, p) for t, p in points if p["pid"] == pid]  # a restarted process: its latest life
        v: dict[str, Any] = {"pid": pid, "samples": len(life), "restarted": len(life) < len(points)}
        if len(life) < MIN_SAMPLES:
            verdicts[name] = v | {"ok": False, "why": f"{len(life)} samples after warm-up (at least {MIN_SAMPLES} show a trend)"}
            continue
        ts = [t for t, _ in life]
        held = slope(ts, [p["held_mib"] for _, p in life])
        growth = held * (ts[-1] - ts[0])
        heap = [p["heap_in_use_mib"] for _, p in life]
        v |= {
            "held_first_mib": life[0][1]["held_mib"],
            "held_last_mib": life[-1][1]["held_mib"],
            "slope_mib_per_min": round(held, 3),
            "growth_mib": round(growth, 2),
            "rss_first_mib": life[0][1]["rss_mib"],
            "rss_last_mib": life[-1][1]["rss_mib"],
            "rss_slope_mib_per_min": round(slope(ts, [p["rss_mib"] for _, p in life]), 3),
            "heap_in_use_slope_mib_per_min": None if None in heap else round(slope(ts, heap), 3),
            "threads_first_last": [life[0][1]["threads"], life[-1][1]["threads"]],
            "python_blocks_first_last": [life[0][1].get("python_blocks"), life[-1][1].get("python_blocks")],
        }
        grows = held > bound.slope_mib_per_min and growth > bound.growth_mib
        verdicts[name] = v | {"ok": not grows, "why": f"held memory grows {held:.2f} MiB/min, {growth:.1f} MiB over the window" if grows else None}
    ok = bool(verdicts) and all(v["ok"] for v in verdicts.values())
    return {"plan": asdict(plan), "bound": bound.text(), "warmup_minutes": plan.warmup, "processes": verdicts, "ok": ok}


def add_to_report(report: dict[str, Any], samples: list[dict[str, Any]], plan: SoakPlan) -> None:
    """The soak's samples and verdict into the load test's ``report`` (a FAIL is one of its failures)."""
    verdict = judge(samples, plan)
    report["soak"] = {"samples": samples, "verdict": verdict}
    for name, v in verdict["processes"].items():
        if not v["ok"]:
            report["failures"].append(f"soak: {name}: {v['why']}")
    if not verdict["processes"]:
        report["failures"].append("soak: no sample")
    report["ok"] = not report["failures"]


def soak_text(soak: dict[str, Any]) -> str:
    """The per-sample table (held MiB, threads; KV blocks in use per worker), the slopes and the verdict."""
    samples, verdict = soak["samples"], soak["verdict"]
    names = list(verdict["processes"])
    workers = [n for n in names if n not in ("replica", "coordinator")]
    head = f"{'min':>6} " + " ".join(f"{n[:11]:>11}" for n in names) + " | threads " + "/".join(names) + (" | KV used " + "/".join(workers) if workers else "")
    lines = [f"soak: held MiB per process every {verdict['plan']['sample_every_s']:g} s (warm-up: first {verdict['warmup_minutes']:g} min)", head]
    for s in samples:
        ps = s["processes"]
        held = " ".join(f"{ps[n]['held_mib']:>11.1f}" if n in ps else f"{'-':>11}" for n in names)
        threads = "/".join(str(ps[n]["threads"]) if n in ps else "-" for n in names)
        kv = "/".join(str(ps[n]["kv_used"]) if n in ps else "-" for n in workers)
        lines.append(f"{s['t_min']:>6.2f} {held} | {threads}" + (f" | {kv}" if workers else ""))
    lines.append(verdict["bound"])
    for name, v in verdict["processes"].items():
        if "slope_mib_per_min" in v:
            heap = v["heap_in_use_slope_mib_per_min"]
            lines.append(
                f"  {name}: held {v['held_first_mib']:.1f} -> {v['held_last_mib']:.1f} MiB, slope {v['slope_mib_per_min']:+.2f} MiB/min "
                f"({v['growth_mib']:+.1f} MiB over {v['samples']} samples); RSS {v['rss_first_mib']:.1f} -> {v['rss_last_mib']:.1f} MiB, "
                f"{v['rss_slope_mib_per_min']:+.2f} MiB/min; heap in use {'-' if heap is None else f'{heap:+.2f}'} MiB/min, "
                f"Python blocks {'-' if None in v['python_blocks_first_last'] else ' -> '.join(map(str, v['python_blocks_first_last']))}"
                + (" (restarted)" if v["restarted"] else "") + ("" if v["ok"] else "  FAIL")
            )
        else:
            lines.append(f"  {name}: FAIL ({v['why']})")
    lines.append(f"soak verdict: {'PASS' if verdict['ok'] else 'FAIL'}")
    return "\n".join(lines)
