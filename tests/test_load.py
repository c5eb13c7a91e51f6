"""The load test (``python -m saguaro_ray.jobs.load_test``), CI-sized.

Issue 20's target is 64 streaming clients for 2 minutes, 10 % hanging up
mid-stream and 5 % sending poison; here the same code path runs 16 clients
for 20 s on the zoo CPU deployment (``deploy/serve/zoo-cpu.yaml``: one
engine; requests name auto, AR, SD and SSD) through the very command a user runs, and the test reads its
JSON report: no error for any well-behaved client, every T = 0 output equal
to its single-request reference, every poison refused with a 4xx OpenAI
error, every hang-up seen by the server and aborted (the engine idle
afterwards), every KV pool full and no thread more than at the baseline.
No timings are asserted. The report's own checks are tested without a
server at the bottom.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from saguaro_ray.jobs.load_report import resource_problems
from saguaro_ray.jobs.load_test import LoadOptions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory, zoo_tiny) -> dict:
    out = tmp_path_factory.mktemp("load") / "load.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "saguaro_ray.jobs.load_test", "--config", str(ROOT / "deploy/serve/zoo-cpu.yaml")]
    cmd += ["--clients", "16", "--seconds", "20", "--disconnect", "0.1", "--poison", "0.05", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT, check=False)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    data["returncode"] = res.returncode
    data["stdout"] = res.stdout
    return data


def test_well_behaved_clients_get_no_errors_and_exact_outputs(report):
    assert report["clients"] == {"good": 13, "disconnect": 2, "poison": 1}
    assert report["requests"]["good"] > 0
    assert report["errors"]["good"] == {}, report["error_examples"]
    exact = report["exact"]
    assert exact["t0_checked"] > 0 and exact["t0_exact"] == exact["t0_checked"], exact["mismatches"]
    assert report["references"]["strategies_disagree"] == []
    assert report["latency_s"]["ttft"]["count"] > 0 and report["latency_s"]["itl"]["count"] > 0


def test_poison_gets_openai_4xx_errors(report):
    assert report["requests"]["poison"] > 0
    assert report["errors"]["poison"] == {}, report["error_examples"]
    statuses = {int(s) for by_status in report["poison_status"].values() for s in by_status}
    assert statuses and all(400 <= s < 500 and s != 429 for s in statuses)
    assert report["server_statuses"].get("500", 0) == 0


def test_hung_up_streams_are_aborted_and_resources_return(report):
    hang = report["disconnects"]
    assert hang["hung_up"] > 0 and report["errors"]["disconnect"] == {}
    assert hang["server_499"] == hang["hung_up"]  # the replica saw each client leave
    assert report["resources"]["problems"] == []
    engine = report["resources"]["after"]["engine"]
    assert engine["active"] == engine["queued"] == 0
    assert all(w["free_kv_blocks"] == w["kv_blocks"] for w in engine["workers"].values())
    assert report["ok"] and report["returncode"] == 0, report["stdout"]


# ------------------------------------------------------------------ the checks, without a server


def _resources(threads: int, free: int, active: int = 0, pool: int = 2) -> dict:
    worker = {"free_kv_blocks": free, "kv_blocks": 8, "python_threads": threads, "thread_kinds": {"MainThread": 1, "waiter": threads - 1}}
    return {
        "python_threads": 3 + pool,
        "thread_kinds": {"MainThread": 1, "loop": 2, "ThreadPoolExecutor-0": pool},
        "ongoing_requests": 0,
        "engine": {"active": active, "queued": 0, "workers": {"draft0": worker}},
    }


def test_resource_problems_name_what_did_not_return():
    base = _resources(4, 8)
    assert resource_problems(_resources(4, 8), base) == []
    assert resource_problems(_resources(3, 8), base) == []  # fewer threads is fine
    assert resource_problems(_resources(6, 8), base) == ["engine draft0: threads 4 -> 6 ({'waiter': '3 -> 5'})"]
    silent = _resources(4, 8)
    silent["engine"]["workers"] = None  # a snapshot whose workers did not answer in time
    assert resource_problems(silent, base) == ["engine did not answer"]
    assert resource_problems(_resources(4, 8, pool=5), base) == []  # a pool's workers start on demand, up to its bound
    leak = _resources(4, 8)
    leak["python_threads"] += 1
    leak["thread_kinds"]["ThreadPoolExecutor-1"] = 1  # a new pool is not a pool growing
    assert resource_problems(leak, base) == ["replica threads 5 -> 6 ({'ThreadPoolExecutor-1': '0 -> 1'})"]
    assert resource_problems(_resources(4, 7, active=1), base) == [
        "engine: 1 samples active, 0 queued",
        "engine draft0: 7 of 8 KV blocks free",
    ]


def test_client_split():
    assert LoadOptions(clients=64).split() == (55, 6, 3)
    assert LoadOptions(clients=16).split() == (13, 2, 1)
    assert LoadOptions(clients=4, disconnect=0.0, poison=0.0).split() == (4, 0, 0)
    with pytest.raises(ValueError, match="none well-behaved"):
        LoadOptions(clients=2, disconnect=0.5, poison=0.5).split()


def test_cli_refuses_impossible_fractions_without_starting_anything():
    res = subprocess.run(
        [sys.executable, "-m", "saguaro_ray.jobs.load_test", "--url", "http://127.0.0.1:9", "--clients", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 2 and "none well-behaved" in res.stderr and "Traceback" not in res.stderr
    # a coordinator to kill is this test's own (--config), never a server's at --url
    res = subprocess.run(
        [sys.executable, "-m", "saguaro_ray.jobs.load_test", "--url", "http://127.0.0.1:9", "--kill-coordinator", "5"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 2 and "--kill-coordinator needs --config" in res.stderr and "Traceback" not in res.stderr


def test_good_requests_name_every_strategy_and_references_agree_across_them():
    """The clients name each strategy the deployment allows (its one engine
    runs them all), and a T = 0 reference that differs between two strategies
    is reported."""
    from saguaro_ray.jobs.load_clients import good_specs
    from saguaro_ray.jobs.load_report import disagreements

    specs = good_specs(["auto", "ar", "ssd"])
    assert {s.strategy for s in specs} == {"auto", "ar", "ssd"}
    assert {s.body("m", True)["speculation"] for s in specs} == {"auto", "ar", "ssd"}
    greedy = [s for s in specs if s.temperature == 0 and s.text == specs[0].text and s.route == specs[0].route]
    refs = {s: {0: ("same", "length")} for s in greedy}
    assert disagreements(refs) == []
    refs[greedy[1]] = {0: ("other", "length")}
    [line] = disagreements(refs)
    assert "'ar'" in line and "'other'" in line
