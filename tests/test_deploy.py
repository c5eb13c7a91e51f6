"""Everything under ``deploy/`` loads and validates, and ``saguaro-ray serve`` runs a config.

* Serve configs (``deploy/serve/*.yaml`` and RayService's ``serveConfigV2``):
  Ray's ``ServeDeploySchema``, an importable ``import_path``, and ``args``
  accepted by our own builder (``build_app``, which validates without Ray).
* The cluster-launcher YAML: Ray's own ``prepare_config`` + ``validate_config``
  (what ``ray up`` runs before touching a cloud).
* KubeRay manifests: the fields KubeRay requires, custom resources that parse,
  GPU requests, and Ray versions that match the installed Ray.
* ``saguaro-ray serve --config`` end to end on a tiny checkpoint: starts its
  own local Ray, serves, answers, and shuts down cleanly on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SERVE_CONFIGS = sorted((DEPLOY / "serve").glob("*.yaml"))


def load(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert len(docs) == 1, f"{path}: expected one YAML document"
    return docs[0]


def test_every_yaml_in_deploy_loads():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    names = {str(f.relative_to(DEPLOY)) for f in files}
    assert {
        "serve/zoo-cpu.yaml", "serve/smollm2-cpu.yaml", "serve/llama-3.1-70b.yaml", "serve/qwen3-32b.yaml",
        "cluster/aws-gpu.yaml", "kuberay/raycluster.yaml", "kuberay/rayservice.yaml", "jobs/generate-rayjob.yaml",
    } <= names  # fmt: skip
    for f in files:
        assert isinstance(load(f), dict), f


# ------------------------------------------------------------------ Serve configs


def check_serve_config(raw: dict, where: str) -> list:
    from ray._common.utils import import_attr
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    from saguaro_ray.serve import build_app, parse_config
    from saguaro_ray.serve.runner import OUR_BUILDERS

    schema = ServeDeploySchema.model_validate(raw)
    assert schema.applications, where
    apps = []
    for app in schema.applications:
        builder = import_attr(app.import_path)
        assert app.import_path in OUR_BUILDERS and builder is build_app, f"{where}: {app.import_path}"
        cfg = parse_config(app.args)  # the args block is a valid ServeAppConfig
        assert isinstance(build_app(app.args), Application)
        apps.append((app, cfg))
    return apps


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_validate(path):
    raw = load(path)
    apps = check_serve_config(raw, str(path))
    assert raw["http_options"]["host"] == "127.0.0.1" and raw["http_options"]["port"] == 8000
    for app, cfg in apps:
        assert "engines" not in app.args  # one engine per model: the strategies it allows instead
        ec = cfg.engine_config()  # its EngineConfig is valid
        assert ec.roles.count("target") == 1  # one target copy serves every strategy
        if cfg.api_keys_env:  # keys come from the environment, documented in the file
            assert cfg.api_keys_env in path.read_text()


@pytest.mark.parametrize(
    "name, target, draft",
    [("zoo-cpu", "zoo:tiny/target", "zoo:tiny/draft"), ("smollm2-cpu", "real:smollm2-135m-instruct", "self:int4")],
)
def test_cpu_configs_fit_two_cores(name, target, draft):
    """`serve run` starts Ray with one logical CPU per core: the replica and the
    engine's placement group must fit in 2 CPUs together."""
    [(_, cfg)] = check_serve_config(load(DEPLOY / "serve" / f"{name}.yaml"), name)
    assert cfg.target == target and cfg.draft == draft
    ec = cfg.engine_config()
    assert ec.device == "cpu"
    total = cfg.num_replicas * (cfg.ray_actor_options.get("num_cpus", 1) + ec.coordinator_cpus + ec.worker_cpus * ec.num_worker_actors)
    assert total <= 2.0, total
    assert set(ec.allowed_modes) >= {"auto", "ar", "sd", "ssd"}


def test_large_model_configs():
    [(_, llama)] = check_serve_config(load(DEPLOY / "serve" / "llama-3.1-70b.yaml"), "llama")
    assert "Llama-3.1-70B-Instruct" in llama.target and "Llama-3.2-1B-Instruct" in llama.draft
    assert llama.engine_options["target_tp"] == 4 and llama.engine_options["device"] == "cuda"
    assert llama.engine_options["gpus_per_worker"] == 1
    ec = llama.engine_config()
    assert (ec.target_tp, ec.target_placement_strategy) == (4, "STRICT_PACK")
    assert set(ec.allowed_modes) >= {"ar", "sd", "ssd"}
    [(_, qwen)] = check_serve_config(load(DEPLOY / "serve" / "qwen3-32b.yaml"), "qwen")
    assert "Qwen3-32B" in qwen.target and "Qwen3-0.6B" in qwen.draft
    assert qwen.engine_options["device"] == "cuda"
    qec = qwen.engine_config()
    assert qec.target_tp == 2 and qec.spec.mode == "ssd" and "ar" in qec.allowed_modes


# ------------------------------------------------------------------ cluster launcher


def test_cluster_launcher_config_validates_with_ray():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load(DEPLOY / "cluster" / "aws-gpu.yaml")
    config = prepare_config(raw)
    validate_config(config)  # Ray's JSON schema + node-type checks, as `ray up` does
    types = config["available_node_types"]
    assert config["head_node_type"] == "head" and types["head"]["resources"].get("GPU") == 0
    gpu_types = [t for name, t in types.items() if name != "head"]
    assert gpu_types and all(t["resources"].get("GPU", 0) >= 1 for t in gpu_types)
    custom = {k for t in gpu_types for k in t["resources"] if k not in ("CPU", "GPU")}
    assert custom == {"saguaro_target", "saguaro_draft"}
    assert any("pip install" in c and "saguaro-ray" in c for c in config["setup_commands"])
    assert "~/saguaro-ray" in config["file_mounts"]


# ------------------------------------------------------------------ KubeRay


def _check_ray_cluster_spec(spec: dict, where: str) -> set[str]:
    import ray

    assert spec["rayVersion"] == ray.__version__, f"{where}: rayVersion {spec['rayVersion']} != installed {ray.__version__}"
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    [head_container] = head["template"]["spec"]["containers"]
    assert head_container["image"] and head_container["name"]
    ports = {p["containerPort"] for p in head_container["ports"]}
    assert {6379, 8265, 8000} <= ports, f"{where}: head ports {ports}"
    custom: set[str] = set()
    assert spec["workerGroupSpecs"], where
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"]
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        [c] = group["template"]["spec"]["containers"]
        assert c["image"] == head_container["image"]
        limits = c["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1, group["groupName"]
        res = group.get("rayStartParams", {}).get("resources")
        if res:  # KubeRay's quoting: '"{\"name\": 1}"'
            parsed = json.loads(json.loads(res))
            assert all(isinstance(v, (int, float)) and v > 0 for v in parsed.values())
            custom |= set(parsed)
    return custom


def test_kuberay_raycluster():
    m = load(DEPLOY / "kuberay" / "raycluster.yaml")
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayCluster" and m["metadata"]["name"]
    custom = _check_ray_cluster_spec(m["spec"], "raycluster")
    assert custom == {"saguaro_target", "saguaro_draft"}


def test_kuberay_rayservice_points_at_our_app():
    m = load(DEPLOY / "kuberay" / "rayservice.yaml")
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayService" and m["metadata"]["name"]
    serve_config = yaml.safe_load(m["spec"]["serveConfigV2"])
    apps = check_serve_config(serve_config, "rayservice serveConfigV2")
    custom = _check_ray_cluster_spec(m["spec"]["rayClusterConfig"], "rayservice")
    for _, cfg in apps:
        ec = cfg.engine_config()
        wanted = {k for res in ec.resources.values() for k in res}
        assert wanted <= custom, f"engine asks for {wanted}, the cluster offers {custom}"
        if cfg.api_keys_env:  # every pod that may host the replica gets the variable
            text = m["spec"]["serveConfigV2"] + json.dumps(m["spec"]["rayClusterConfig"])
            assert text.count(cfg.api_keys_env) >= 2


def test_dockerfile_matches_ray_version():
    import ray

    text = (DEPLOY / "kuberay" / "Dockerfile").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(ray.__version__)}-", text, re.MULTILINE)


# ------------------------------------------------------------------ jobs


def test_job_examples():
    from saguaro_ray.jobs.generate import build_parser, read_prompts

    job = load(DEPLOY / "jobs" / "generate-rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "saguaro_ray.jobs.generate"]
    args = build_parser().parse_args(argv[3:])
    assert args.mode == "ssd" and args.device == "cuda"
    script = DEPLOY / "jobs" / "generate-job.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    assert "saguaro_ray.jobs.generate" in script.read_text()
    assert len(read_prompts(str(DEPLOY / "jobs" / "prompts.example.jsonl"))) >= 3


def test_readme_covers_the_launch_paths():
    text = (DEPLOY / "README.md").read_text()
    for needle in ("saguaro-ray serve", "serve run", "ray up", "ray job submit", "kubectl apply", "SPREAD", "resources", "target_tp"):
        assert needle in text, needle


def test_every_subpackage_is_packaged():
    """A wheel (the Docker image, `pip install .`) only ships the packages pyproject lists."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "saguaro_ray").rglob("__init__.py")}
    missing = sorted(found - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"


# ------------------------------------------------------------------ the CLI, end to end


def test_cli_rejects_bad_configs(tmp_path):
    from saguaro_ray.errors import ConfigError
    from saguaro_ray.serve.runner import load_serve_config, validate_app_args

    bad_schema = tmp_path / "bad.yaml"
    bad_schema.write_text("applications:\n  - name: x\n    import_path: 42x\n    route_prefix: nope\n")
    with pytest.raises(ConfigError, match="invalid Serve config"):
        load_serve_config(bad_schema)
    def app_config(name: str, args: str) -> Path:
        path = tmp_path / name
        path.write_text(f"applications:\n  - name: a\n    route_prefix: /\n    import_path: saguaro_ray.serve:build_app\n    args: {args}\n")
        return path

    bad_args = app_config("args.yaml", "{target: t, speculation: {mode: ssd}}")
    with pytest.raises(ConfigError, match="application 'a'.*needs a draft"):
        validate_app_args(load_serve_config(bad_args))
    old_engines = app_config("engines.yaml", "{target: t, engines: [{mode: ar}]}")
    with pytest.raises(ConfigError, match="application 'a'.*`engines` was replaced by `speculation`"):
        validate_app_args(load_serve_config(old_engines))
    with pytest.raises(ConfigError, match="cannot read"):
        load_serve_config(tmp_path / "missing.yaml")
    res = subprocess.run(
        [sys.executable, "-m", "saguaro_ray", "serve", "--config", str(bad_args)], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 2 and "needs a draft" in res.stderr and "Traceback" not in res.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _ongoing(base: str) -> float:
    return httpx.get(base + "/v1/saguaro/metrics", timeout=60).json()["gauges"].get("ongoing_requests", 0.0)


def _session_process(sid: int, title: str) -> int:
    """The pid of the process of session ``sid`` whose command line mentions ``title``
    (Ray names an actor's process after its class)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid and title in (entry / "cmdline").read_bytes().decode(errors="replace"):
                return int(entry.name)
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no {title} process in session {sid}")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_cli_serve_runs_a_config_until_ctrl_c(tmp_path, stop):
    """`saguaro-ray serve --config` serves until Ctrl-C, or the SIGTERM a process
    manager sends, and then shuts Serve and its own Ray instance down cleanly."""
    from helpers import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path, "llama", seed=0, max_position_embeddings=256)
    port = free_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "cli-test",
                "route_prefix": "/",
                "import_path": "saguaro_ray.serve:build_app",
                "args": {"model_name": "tiny", "target": str(ckpt), "speculation": {"mode": "ar"}, "engine_options": {"worker_cpus": 0.25}},
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 (outlives this block: the server's stdout)
    # --address local: its own embedded Ray, never another instance on this machine
    proc = subprocess.Popen(
        [sys.executable, "-m", "saguaro_ray", "serve", "--config", str(path), "--address", "local", "--timeout", "240"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "RUNNING at" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "saguaro-ray serve did not report RUNNING"
            time.sleep(1)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 4
        # graceful drain: a request in flight when the stop comes still gets its answer
        # (held in flight by freezing the engine's coordinator until the stop has begun)
        coordinator = _session_process(proc.pid, "CoordinatorActor")
        os.kill(coordinator, signal.SIGSTOP)
        pool = ThreadPoolExecutor(1)
        try:
            in_flight = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=120)
            deadline = time.monotonic() + 120
            while _ongoing(base) < 1:  # the replica holds it
                assert time.monotonic() < deadline, "the request never reached the replica"
                time.sleep(0.2)
            proc.send_signal(stop)
            while _answers(base + "/v1/models"):  # until the stop has reached the application
                assert time.monotonic() < deadline, "still serving new requests after the signal"
                time.sleep(0.2)
        finally:
            os.kill(coordinator, signal.SIGCONT)
            pool.shutdown(wait=False)
        resp = in_flight.result(timeout=120)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 4, resp.text
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of that session left behind
        except (ProcessLookupError, PermissionError):
            pass
        log.close()
