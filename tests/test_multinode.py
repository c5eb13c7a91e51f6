"""Multi-node placement on ``ray.cluster_utils.Cluster`` (three raylets on one machine).

The target and the draft are pinned to different nodes with custom
resources; the engine must see that its bundles span nodes, bind TCP (not
IPC) endpoints on the node address, and still decode exactly (DESIGN §5, §8).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from helpers import save_tiny_checkpoint
from ray.cluster_utils import Cluster

from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine

OBJECT_STORE = 80 * 1024 * 1024  # small: three raylets share one small machine
PROMPTS = [[3, 5, 7, 9], [1, 2], [4, 4, 4, 4, 4, 6], [10, 20, 30, 40]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    was_initialized = ray.is_initialized()
    if was_initialized:
        ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": OBJECT_STORE, "include_dashboard": False},
    )
    try:
        c.add_node(num_cpus=2, resources={"node_t": 1}, object_store_memory=OBJECT_STORE)
        c.add_node(num_cpus=2, resources={"node_d": 1}, object_store_memory=OBJECT_STORE)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if was_initialized:  # leave Ray as we found it: initialised (a fresh local instance)
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("multinode-models"), "llama", seed=0))


@pytest.mark.parametrize("encrypt", [False, True])  # True: every TCP socket under CURVE
def test_ssd_spread_over_nodes(cluster, ckpt, encrypt):
    ref = LocalEngine(EngineConfig(target=ckpt, threads_per_worker=1))
    try:
        expected = [r.token_ids for r in ref.generate(PROMPTS, GREEDY)]
    finally:
        ref.close()
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3
    node_t = next(nid for nid, res in nodes.items() if "node_t" in res)
    node_d = next(nid for nid, res in nodes.items() if "node_d" in res)

    h = Engine.launch(
        EngineConfig(
            target=ckpt,
            draft=ckpt,
            spec=SpeculationConfig(mode="ssd", k=3, budget=4, backup="neural"),
            resources={"target": {"node_t": 0.1}, "draft": {"node_d": 0.1}},
            placement_strategy="SPREAD",
            encrypt=encrypt,
        )
    )
    try:
        info = h.worker_info()
        print("worker info:", info)
        assert set(info) == {"target", "draft0"}
        for role, i in info.items():
            assert i["endpoint"].startswith("tcp://"), (role, i)
            assert i["endpoint"].startswith(f"tcp://{i['node']}:"), (role, i)  # bound on the node address Ray reports
        assert info["target"]["node_id"] == node_t
        assert info["draft0"]["node_id"] == node_d
        assert info["target"]["node_id"] != info["draft0"]["node_id"]

        with ThreadPoolExecutor(1) as pool:  # a deadline instead of a hung suite
            res = pool.submit(h.generate, PROMPTS, GREEDY).result(timeout=120)
            singles = [pool.submit(h.generate, [p], GREEDY).result(timeout=120)[0] for p in PROMPTS[:2]]
        assert [r.token_ids for r in res] == expected
        assert [r.token_ids for r in singles] == expected[:2]
        for r in res:
            assert r.mode == "ssd" and r.stats["cache_hit_rate"] == 1.0  # draft == target
        # the control plane crossed nodes over TCP and nothing was dropped
        assert all(i["dropped_frames"] == 0 for i in h.worker_info().values())
        assert sum(h.metrics()["dropped_frames"].values()) == 0
    finally:
        h.shutdown()
