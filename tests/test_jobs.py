"""Batch generation as a Ray job: ``ray job submit -- python -m saguaro_ray.jobs.generate``.

The module starts its own single-node cluster with ``ray start --head --block``
in a subprocess — unique free ports for GCS, dashboard (job server), client
server, agent and metrics, its own ``--temp-dir`` (so ``ray.init()`` elsewhere
on this machine never discovers it) — submits the job through the dashboard's
job server, and stops the cluster by terminating the ``ray start`` process it
launched (never ``ray stop``, which would kill every Ray instance on the
machine). If the job server cannot come up here, the job module runs directly
against the cluster with ``--address`` instead, and the test says so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from helpers import save_tiny_checkpoint

from saguaro_ray.jobs.generate import completed, read_prompts

VENV_BIN = Path(sys.executable).parent
PROMPTS = ["def add(a, b):", "import os", "class Foo:", "for i in range(10):", "x = [1, 2, 3]"]
MORE = ["while True:", "print('hi')"]
JOB_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # the job's `python` is this venv's
    env.pop("RAY_ADDRESS", None)
    # Ray 2.60 turns token authentication on for `ray start` clusters; this
    # private test cluster opts out so `ray job submit` needs no token
    env["RAY_AUTH_MODE"] = "disabled"
    return env


@pytest.fixture(scope="module")
def cluster():
    tmp = Path(tempfile.mkdtemp(prefix="srj-"))  # short: Ray's unix sockets live under it
    ports = {name: free_port() for name in ("gcs", "dashboard", "client", "agent", "metrics")}
    cmd = [
        str(VENV_BIN / "ray"), "start", "--head", "--block",
        f"--port={ports['gcs']}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
        f"--ray-client-server-port={ports['client']}",
        f"--dashboard-agent-listen-port={ports['agent']}",
        f"--metrics-export-port={ports['metrics']}",
        "--num-cpus=8", f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats",
    ]  # fmt: skip
    log = open(tmp / "ray-start.log", "w")  # noqa: SIM115 (the cluster's stdout for the module's lifetime)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    info = {"tmp": tmp, "ports": ports, "address": f"127.0.0.1:{ports['gcs']}", "job_server": None, "why": ""}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", ports["gcs"]), timeout=1):
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"ray start did not come up: {(tmp / 'ray-start.log').read_text()[-3000:]}")
        import httpx

        url = f"http://127.0.0.1:{ports['dashboard']}"
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/api/version", timeout=2).status_code == 200:
                    info["job_server"] = url
                    break
            except httpx.HTTPError as exc:
                info["why"] = f"{type(exc).__name__}: {exc}"
            time.sleep(1)
        yield info
    finally:
        # stop exactly the cluster this module started: SIGTERM to `ray start --block`
        # makes it stop its own processes; then sweep its process group
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass  # a slow graceful stop: the group kill below finishes it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        log.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("jobs-models"), "llama", seed=0, max_position_embeddings=256))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def run_job(cluster: dict, workdir: Path, args: list[str]) -> str:
    """Submit through the job server (or run the module against the cluster); returns the job's log."""
    module = ["python", "-m", "saguaro_ray.jobs.generate", *args]
    if cluster["job_server"]:
        cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", cluster["job_server"], "--working-dir", str(workdir), "--", *module]
    else:
        warnings.warn(f"job server unavailable ({cluster['why']}); running the job module directly with --address", stacklevel=2)
        cmd = [str(VENV_BIN / "python"), *module[1:], "--address", cluster["address"]]
    res = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    return out


def test_job_submit_generates_and_resumes(cluster, ckpt, tmp_path):
    from saguaro_ray.config import SamplingParams, SpeculationConfig
    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.engine_config import EngineConfig

    workdir = tmp_path / "wd"
    workdir.mkdir()
    prompts, output = workdir / "prompts.jsonl", tmp_path / "out" / "results.jsonl"
    write_jsonl(prompts, [{"prompt": p} for p in PROMPTS])
    args = [
        "--input", str(prompts), "--output", str(output),
        "--target", ckpt, "--draft", ckpt, "--mode", "ssd", "--k", "3", "--budget", "4",
        "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "--worker-cpus", "0.25",
    ]  # fmt: skip
    log = run_job(cluster, workdir, args)
    assert f"{len(PROMPTS)} to run" in log

    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(len(PROMPTS)))
    engine = LocalEngine(EngineConfig(target=ckpt, spec=SpeculationConfig(mode="ar")))
    try:
        ref = engine.generate(PROMPTS + MORE, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finally:
        engine.close()
    cli_fields = {"prompt_index", "sample_index", "mode", "token_ids", "text", "finish_reason", "prompt_tokens", "stats"}
    for r in rows:
        assert cli_fields | {"index", "prompt"} <= set(r)
        assert r["prompt"] == PROMPTS[r["index"]] and r["prompt_index"] == r["index"]
        assert r["mode"] == "ssd" and r["finish_reason"] == "length"
        assert r["token_ids"] == ref[r["index"]].token_ids  # exact: SSD == AR at T = 0
        assert r["text"] == ref[r["index"]].text

    # resume: more prompts, one result lost, a torn line from a killed run
    write_jsonl(prompts, [{"prompt": p} for p in PROMPTS + MORE])
    kept = [line for line in output.read_text().splitlines() if json.loads(line)["index"] != 2]
    output.write_text("\n".join(kept) + "\n" + '{"index": 6, "prompt": "pri', encoding="utf-8")
    log = run_job(cluster, workdir, args)
    assert f"{len(PROMPTS) - 1} already in" in log and "3 to run" in log
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(len(PROMPTS) + len(MORE)))
    for r in rows:
        assert r["token_ids"] == ref[r["index"]].token_ids

    # everything done: a third run has nothing to do and does not launch an engine
    log = run_job(cluster, workdir, args)
    assert "0 to run" in log


def test_completed_counts_samples_and_trims_torn_lines(tmp_path):
    out = tmp_path / "r.jsonl"
    lines = [
        {"index": 0, "sample_index": 0}, {"index": 0, "sample_index": 1},
        {"index": 1, "sample_index": 0},
        {"index": 2, "error": "too long"},
    ]  # fmt: skip
    out.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"index": 3, "sam')
    assert completed(str(out), n=2) == {0}
    assert completed(str(out), n=1) == {0, 1}
    assert out.read_text().endswith("}\n")  # the torn line is gone
    assert completed(str(tmp_path / "missing.jsonl"), 1) == set()


def test_read_prompts_validates(tmp_path):
    from saguaro_ray.errors import ConfigError

    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": [1, 2], "max_tokens": 3}\n')
    assert [r["prompt"] for r in read_prompts(str(good))] == ["a", [1, 2]]
    for text, needle in (('{"prompt": 1}\n', "prompt"), ("not json\n", "JSON"), ('{"prompt": "a", "bogus": 1}\n', "unknown")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            read_prompts(str(bad))


def test_rays_own_serve_run_starts_our_config(cluster, ckpt, tmp_path):
    """Ray's `serve run CONFIG.yaml` (not our CLI) deploys the app from a Serve config."""
    import signal
    import time

    import httpx
    import yaml

    port = free_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "serve-run",
                "route_prefix": "/",
                "import_path": "saguaro_ray.serve:build_app",
                "args": {"model_name": "tiny", "target": ckpt, "speculation": {"mode": "ar"}, "engine_options": {"worker_cpus": 0.25}},
            }
        ],
    }
    path = tmp_path / "serve-run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [str(VENV_BIN / "serve"), "run", "--address", cluster["address"], str(path)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        resp = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3}, timeout=30)
                if resp.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert resp is not None and resp.status_code == 200, proc.stdout.read()[-3000:] if proc.poll() is not None else "timed out"
        assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        proc.send_signal(signal.SIGINT)  # serve run tears the app down on Ctrl-C
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


# after serve run's Ctrl-C tore Serve down: a detached deployment starts afresh
def test_cli_serve_detach_leaves_the_app_on_the_cluster(cluster, ckpt, tmp_path):
    """`saguaro-ray serve --config ... --detach` returns once RUNNING; the app keeps serving."""
    import httpx
    import yaml

    port = free_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "detached",
                "route_prefix": "/",
                "import_path": "saguaro_ray.serve:build_app",
                "args": {"model_name": "tiny", "target": ckpt, "speculation": {"mode": "ar"}, "engine_options": {"worker_cpus": 0.25}},
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [str(VENV_BIN / "saguaro-ray"), "serve", "--config", str(path), "--detach", "--address", cluster["address"], "--timeout", "240"]
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert f"RUNNING at http://127.0.0.1:{port}/" in res.stdout
    # the command has exited; the application is still there
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3}, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    # Serve cannot move its HTTP proxy while it runs: a config on another port is refused
    # before anything is deployed (it would print a URL where nothing listens), and the
    # running application is left as it was
    config["http_options"]["port"] = other = free_port()
    config["applications"][0]["name"] = "elsewhere"
    path.write_text(yaml.safe_dump(config))
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False)
    assert res.returncode != 0 and f"already runs on this cluster with HTTP at 127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
    assert f":{other}" in res.stderr and "RUNNING" not in res.stdout
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3}, timeout=120)
    assert resp.status_code == 200

