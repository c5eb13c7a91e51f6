"""``saguaro-ray serve`` joins only a Ray cluster the user meant (issue 36).

``--address``, ``RAY_ADDRESS``, or the cluster ``ray start`` recorded in its
address file; otherwise its own local instance — never the short-lived
private instance another script's ``ray.init()`` started on the machine
(Ray's legacy ``address="auto"`` joins any Ray process it finds, and serve
died with that script). Each Ray instance here lives in its own process and
its own ``RAY_TMPDIR`` (where the address file lives), so the test neither
sees nor touches another Ray on the machine; ``ray start``'s file is written
with Ray's own writer (``ray start``/``ray stop`` themselves act machine-wide).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from saguaro_ray.errors import ConfigError
from saguaro_ray.serve.runner import _connect_or_start, intended_cluster

TIMEOUT_S = 180

PRIVATE = textwrap.dedent(
    """
    import sys, time, ray
    ray.init(num_cpus=1, include_dashboard=False)  # a script's own, private instance
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test closes stdin
    """
)

SERVE_CONNECT = textwrap.dedent(
    """
    import json, ray
    from saguaro_ray.serve.runner import _connect_or_start
    started = _connect_or_start(None, False)
    print(json.dumps({"started": started, "gcs": ray.get_runtime_context().gcs_address}), flush=True)
    ray.shutdown()
    """
)


@pytest.fixture
def ray_tmpdir() -> Iterator[str]:
    """A Ray temp directory of this test's own (short: Ray's socket paths live under it)."""
    path = tempfile.mkdtemp(prefix="rsc", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _env(tmpdir: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_TMPDIR": tmpdir, **extra}


@pytest.fixture
def private_instance(ray_tmpdir: str) -> Iterator[str]:
    """Another script's private Ray instance, running; yields its GCS address."""
    proc = subprocess.Popen([sys.executable, "-c", PRIVATE], env=_env(ray_tmpdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip() if proc.stdout else ""
        assert line, "the private Ray instance did not start"
        yield line
    finally:
        if proc.stdin:
            proc.stdin.close()  # the script ends, and its Ray with it
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve_connect(tmpdir: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SERVE_CONNECT], env=_env(tmpdir, **env), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_serve_never_joins_another_scripts_private_instance(ray_tmpdir, private_instance):
    joined = _serve_connect(ray_tmpdir)
    assert joined["started"] is True, joined
    assert joined["gcs"] != private_instance


def test_serve_joins_the_clusters_the_user_meant(ray_tmpdir, private_instance):
    # RAY_ADDRESS names it (a named address takes Ray's token auth only when asked, as with `ray job submit`)
    assert _serve_connect(ray_tmpdir, RAY_ADDRESS=private_instance, RAY_AUTH_MODE="token") == {"started": False, "gcs": private_instance}
    # `ray start` recorded it (with Ray's own writer, where ray.init() reads it)
    from ray._private.utils import write_ray_address

    os.makedirs(Path(ray_tmpdir) / "ray", exist_ok=True)
    write_ray_address(private_instance, str(Path(ray_tmpdir) / "ray"))
    assert _serve_connect(ray_tmpdir) == {"started": False, "gcs": private_instance}


def test_intended_cluster_sources(ray_tmpdir, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert intended_cluster(None)[0] is None
    assert intended_cluster("local")[0] is None
    assert intended_cluster("10.0.0.1:6379") == ("10.0.0.1:6379", "--address")
    (Path(ray_tmpdir) / "ray").mkdir()
    (Path(ray_tmpdir) / "ray" / "ray_current_cluster").write_text("10.0.0.2:6379")
    assert intended_cluster(None)[0] == "10.0.0.2:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.3:6379")
    assert intended_cluster(None) == ("10.0.0.3:6379", "RAY_ADDRESS")
    assert intended_cluster("local")[0] is None  # --address wins


def test_detach_without_a_cluster_is_one_clear_error(ray_tmpdir, monkeypatch):
    import ray

    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="--detach needs a running Ray cluster"):
        _connect_or_start(None, True)
    assert not ray.is_initialized()
