"""The soak (``load_test --soak``): its verdict on synthetic series, and a
short soak on the zoo CPU deployment through the very command a user runs.

The verdict leaves the warm-up out and fits a line to each process's held
memory (anonymous RSS less glibc's free-held bytes) over the rest: a flat
series after a warm-up bump passes, a steady climb fails (and so does a soak too short to show a trend). The short soak runs
30 s of load sampled every 5 s and checks the report: every process of the
server (replica, coordinator, each worker) sampled with the memory it read
itself, the table and the verdict in the text, the exit status agreeing with
it. No timing and no memory figure of the real run is asserted (its 15 s
window after the warm-up says little about a leak; the 20-minute soak on the real model is
the measurement, docs/runtime.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from saguaro_ray.jobs.soak import SoakBound, SoakPlan, add_to_report, judge, processes, slope, soak_text

ROOT = Path(__file__).resolve().parents[1]


def _samples(
    series: dict[str, list[float]], every_min: float = 1.0, pids: dict[str, list[int]] | None = None, rss: dict[str, list[float]] | None = None
) -> list[dict]:
    """One sample per point: each process's held memory (MiB; its RSS 100 MiB
    more unless ``rss`` gives it) and a flat heap."""
    n = len(next(iter(series.values())))
    out = []
    for i in range(n):
        procs = {}
        for name, held in series.items():
            pid = (pids or {}).get(name, [1] * n)[i]
            r = (rss or {}).get(name, [h + 100 for h in held])[i]
            procs[name] = {"pid": pid, "held_mib": held[i], "rss_mib": r, "heap_in_use_mib": 50.0, "heap_free_mib": 5.0, "threads": 7}
        out.append({"t_min": round(i * every_min, 3), "processes": procs})
    return out


def test_slope_is_least_squares():
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope([0, 1, 2], [5, 4, 6]) == pytest.approx(0.5)


def test_flat_after_a_warm_up_bump_passes():
    # 20 minutes: a climb of 250 MiB in the first 5 (caches, arenas), then flat with +-3 MiB of noise
    bump = [500 + 50 * min(i, 5) + (3 if i % 2 else -3) for i in range(21)]
    verdict = judge(_samples({"target": bump, "replica": [200.0] * 21}), SoakPlan(20))
    assert verdict["ok"], verdict
    t = verdict["processes"]["target"]
    assert t["samples"] == 11 and abs(t["slope_mib_per_min"]) < 1.0
    assert verdict["warmup_minutes"] == 10 and "1 MiB/min" in verdict["bound"] and "8 MiB" in verdict["bound"]
    # the same bump judged from the start would fail: the warm-up is what is left out
    assert not judge(_samples({"target": bump}), SoakPlan(20, warmup_minutes=0))["ok"]


def test_a_steady_climb_fails():
    climb = [600 + 3 * i for i in range(21)]  # 3 MiB/min, 30 MiB over the second half
    verdict = judge(_samples({"draft": climb, "coordinator": [300.0] * 21}), SoakPlan(20))
    assert not verdict["ok"]
    d = verdict["processes"]["draft"]
    assert d["slope_mib_per_min"] == pytest.approx(3.0) and d["growth_mib"] == pytest.approx(30.0)
    assert not d["ok"] and "3.00 MiB/min" in d["why"]
    assert verdict["processes"]["coordinator"]["ok"]


def test_held_memory_is_judged_not_rss():
    """RSS that swings with glibc's free-held bytes and the kernel's file pages
    (the real soak's draft: -84 MiB over its window, its target's +27 with a flat
    heap) is not judged; held memory that climbs under a flat RSS is."""
    swing = [2700 + (60 if i % 3 == 0 else 0) + (-90 if i > 15 else 0) + 3 * i for i in range(21)]
    flat = judge(_samples({"draft": [2500.0] * 21}, rss={"draft": swing}), SoakPlan(20))
    assert flat["ok"] and flat["processes"]["draft"]["rss_slope_mib_per_min"] != 0
    climb = judge(_samples({"target": [2500 + 3.0 * i for i in range(21)]}, rss={"target": [2700.0] * 21}), SoakPlan(20))
    assert not climb["ok"] and "held memory grows 3.00 MiB/min" in climb["processes"]["target"]["why"]


def test_the_bound_needs_both_a_slope_and_a_growth():
    # 4 MiB/min over a 1-minute window is 4 MiB: noise for a short soak, under the 8 MiB growth bound
    short = _samples({"target": [600, 600, 602, 604, 606]}, every_min=0.25)
    assert judge(short, SoakPlan(1))["ok"]
    # 0.5 MiB/min over 40 minutes is 10 MiB, but under the slope bound: passes
    slow = _samples({"target": [600 + 0.5 * i for i in range(81)]})
    assert judge(slow, SoakPlan(80))["ok"]
    # a stricter bound fails it
    assert not judge(slow, SoakPlan(80, bound=SoakBound(slope_mib_per_min=0.25, growth_mib=5)))["ok"]


def test_too_few_samples_or_a_restart():
    few = judge(_samples({"target": [600.0, 600.0, 600.0]}), SoakPlan(2))
    assert not few["ok"] and "at least 3" in few["processes"]["target"]["why"]
    # Ray restarted the worker at minute 14: its new life is judged alone (flat), not the drop and refill
    rss = [900.0] * 14 + [500.0, 520.0, 520.0, 520.0, 520.0, 520.0, 520.0]
    pids = {"target": [1] * 14 + [2] * 7}
    verdict = judge(_samples({"target": rss}, pids=pids), SoakPlan(20))
    t = verdict["processes"]["target"]
    assert t["restarted"] and t["pid"] == 2 and t["samples"] == 7


def test_report_and_text():
    samples = _samples({"replica": [200.0] * 5, "target": [600.0, 610, 620, 630, 640]}, every_min=0.5)
    samples[0]["processes"]["target"] |= {"kv_used": 3, "kv_blocks": 64}
    for s in samples[1:]:
        s["processes"]["target"] |= {"kv_used": 5, "kv_blocks": 64}
    report = {"failures": [], "ok": True}
    add_to_report(report, samples, SoakPlan(2, sample_every_s=30))
    assert not report["ok"] and report["failures"] == ["soak: target: held memory grows 20.00 MiB/min, 20.0 MiB over the window"]
    text = soak_text(report["soak"])
    assert "replica" in text.splitlines()[1] and "target" in text.splitlines()[1]
    assert "slope +20.00 MiB/min" in text and text.endswith("soak verdict: FAIL")


def test_processes_read_from_the_metrics_resources():
    mine = {"pid": 7, "rss_bytes": 300 * 2**20, "rss_anon_bytes": 200 * 2**20, "heap_in_use_bytes": 2**20, "heap_free_bytes": 2**21, "python_threads": 9}
    resources = {
        **mine,
        "engine": {
            "coordinator": {**mine, "pid": 8, "timeline_bytes": 2**21},
            "workers": {"target": {**mine, "pid": 9, "kv_blocks": 64, "free_kv_blocks": 60, "ranks": [{**mine, "pid": 10, "tp_rank": 1}]}},
        },
    }
    got = processes(resources)
    assert set(got) == {"replica", "coordinator", "target", "target.rank1"}  # a sharded target's rank 1 is a process of its own
    assert got["target.rank1"]["pid"] == 10 and got["target.rank1"]["rss_mib"] == 300.0
    assert got["replica"]["rss_mib"] == 300.0 and got["coordinator"]["timeline_mib"] == 2.0
    assert got["replica"]["held_mib"] == 198.0  # anonymous RSS less glibc's free-held bytes
    assert processes({**mine, "rss_anon_bytes": None, "engine": {}})["replica"]["held_mib"] == 298.0  # no RssAnon: RSS less free-held
    assert got["target"]["kv_used"] == 4 and got["target"]["pid"] == 9
    resources["engine"] = {"coordinator": None, "workers": None}  # an engine that did not answer in time
    assert set(processes(resources)) == {"replica"}


def test_plan_refuses_what_cannot_be_a_soak():
    with pytest.raises(ValueError, match="positive"):
        SoakPlan(0)
    with pytest.raises(ValueError, match="less than the soak"):
        SoakPlan(2, warmup_minutes=2)


# ------------------------------------------------------------------ a short soak, end to end


@pytest.fixture(scope="module")
def soak_report(tmp_path_factory, zoo_tiny) -> dict:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "saguaro_ray.jobs.load_test", "--config", str(ROOT / "deploy/serve/zoo-cpu.yaml")]
    cmd += ["--clients", "4", "--disconnect", "0", "--poison", "0", "--soak", "0.5", "--sample-every", "5", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT, check=False)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    data["returncode"], data["stdout"] = res.returncode, res.stdout
    return data


def test_short_soak_samples_every_process_and_gives_a_verdict(soak_report):
    soak = soak_report["soak"]
    samples = soak["samples"]
    assert len(samples) >= 6  # every 5 s over 30 s, and the load's end
    for s in samples:
        assert {"replica", "coordinator", "target"} <= set(s["processes"]) and any(n.startswith("draft") for n in s["processes"]), s
        for p in s["processes"].values():
            assert p["rss_mib"] > p["held_mib"] > 0 and p["threads"] > 0 and p["python_blocks"] > 0
    # the memory each process read itself: distinct pids, the workers' KV pools
    assert len({p["pid"] for p in samples[-1]["processes"].values()}) == len(samples[-1]["processes"])
    assert samples[-1]["processes"]["coordinator"]["timeline_mib"] > 0
    assert all(0 <= s["processes"]["target"]["kv_used"] <= s["processes"]["target"]["kv_blocks"] for s in samples)
    verdict = soak["verdict"]
    assert set(verdict["processes"]) == set(samples[-1]["processes"])
    assert all("slope_mib_per_min" in v for v in verdict["processes"].values()), verdict
    assert "soak verdict: " + ("PASS" if verdict["ok"] else "FAIL") in soak_report["stdout"]
    assert "MiB/min" in soak_report["stdout"]
    assert soak_report["returncode"] == (0 if soak_report["ok"] else 1)
    assert soak_report["errors"]["good"] == {}, soak_report["error_examples"]
