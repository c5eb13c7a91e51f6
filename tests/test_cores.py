"""Each CPU worker claims cores of its own (saguaro_ray.runtime.cores, EngineConfig.pin_cores).

Claims are exclusive across processes (engines on one node never share a
core), a process that finds too few free cores stays unpinned, and a dead
holder's cores are free again at once. Then through Ray: an engine's target
and draft actors run on different cores.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from saguaro_ray.runtime.cores import claim_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _claimer(folder: str, n: int, out: mp.Queue, release: mp.Event) -> None:
    os.environ["SAGUARO_CORES_DIR"] = folder
    got = claim_cores(n)
    out.put((got, sorted(os.sched_getaffinity(0))))
    release.wait(60)


class _Holder:
    """A process that claims ``n`` cores and keeps them until :meth:`stop`."""

    def __init__(self, folder: Path, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.out, self.release = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=_claimer, args=(str(folder), n, self.out, self.release))
        self.proc.start()
        self.claimed, self.affinity = self.out.get(timeout=60)

    def stop(self) -> None:
        self.release.set()
        self.proc.join(30)


def test_claims_are_exclusive_and_freed_with_their_process(tmp_path: Path) -> None:
    everything = _Holder(tmp_path, len(CORES))
    try:
        assert everything.claimed == CORES and everything.affinity == CORES
        late = _Holder(tmp_path, 1)  # nothing free: unpinned, may run anywhere
        assert late.claimed is None and late.affinity == CORES
        late.stop()
    finally:
        everything.stop()
    again = _Holder(tmp_path, 1)  # the holder died: its cores are free
    try:
        assert again.claimed == CORES[:1] and again.affinity == CORES[:1]
    finally:
        again.stop()


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_two_processes_get_different_cores(tmp_path: Path) -> None:
    a = _Holder(tmp_path, 1)
    b = _Holder(tmp_path, 1)
    try:
        assert a.claimed and b.claimed and set(a.claimed).isdisjoint(b.claimed)
        assert a.affinity == a.claimed and b.affinity == b.claimed
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def ray_own_registry(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray instance whose processes claim cores in a registry of this
    module's own (other engines on the machine hold cores in the shared one)."""
    import ray

    assert not ray.is_initialized()
    folder = tmp_path_factory.mktemp("cores")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"SAGUARO_CORES_DIR": str(folder)}})
    yield folder
    ray.shutdown()


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_ray_workers_run_on_cores_of_their_own(ray_own_registry: Path, zoo_tiny: Path) -> None:
    from saguaro_ray.config import SpeculationConfig
    from saguaro_ray.runtime.engine import Engine
    from saguaro_ray.runtime.engine_config import EngineConfig

    config = EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), spec=SpeculationConfig(mode="sd", k=2), max_kv_tokens=512)
    handle = Engine.launch(config)
    try:
        cores = {role: info["cores"] for role, info in handle.worker_info().items()}
        assert len(cores["target"]) == 1 and len(cores["draft0"]) == 1 and cores["target"] != cores["draft0"], cores
        assert sorted(p.name for p in ray_own_registry.iterdir()) == sorted(f"cpu{c}.lock" for c in CORES[:2])
    finally:
        handle.shutdown()
    unpinned = Engine.launch(EngineConfig(target=config.target, draft=config.draft, spec=config.spec, max_kv_tokens=512, pin_cores=False))
    try:
        assert all(info["cores"] == CORES for info in unpinned.worker_info().values())
    finally:
        unpinned.shutdown()
