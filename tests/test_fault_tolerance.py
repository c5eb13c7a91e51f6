"""Killing real worker processes mid-stream: generation completes with the same tokens.

DESIGN §5: the coordinator keeps every sequence's token history, so a lost
worker is rebuilt by re-prefill. A lost draft degrades to point-mass
backups (exact, just slower) while Ray restarts it, then SSD resumes; a lost
target is restarted and running sequences are re-prefilled; when restarts
are exhausted the affected requests fail with a clear error instead of
hanging.
"""

import os
import signal
import time

import pytest
import ray

from helpers import save_tiny_checkpoint
from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig
from saguaro_ray.engine.transport import WorkerGone

PROMPT = [3, 5, 7, 9]
PARAMS = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_instance():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ft"), "llama", seed=0, max_position_embeddings=512)


def _kill_mid_stream(handle, role, after_chunks=3):
    pid = handle.worker_info()[role]["pid"]
    tokens = []
    for i, chunk in enumerate(handle.stream(PROMPT, PARAMS)):
        tokens += chunk["token_ids"]
        if i == after_chunks:
            os.kill(pid, signal.SIGKILL)
    return tokens, pid


@pytest.mark.parametrize("mode", ["ssd", "sd"])
def test_killing_the_draft_keeps_tokens_and_ssd_resumes(ray_instance, target, mode):
    handle = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=SpeculationConfig(mode=mode, k=3, budget=4)))
    try:
        reference = handle.generate([PROMPT], PARAMS)[0].token_ids
        tokens, old_pid = _kill_mid_stream(handle, "draft0")
        assert tokens == reference
        assert handle.metrics()["draft_failures"] == 1
        # the draft comes back as a new process and speculation resumes
        assert handle.worker_info()["draft0"]["pid"] != old_pid
        deadline = time.monotonic() + 120
        while not handle.metrics()["draft_up"]:  # the coordinator reconnects in the background
            assert time.monotonic() < deadline, "draft never came back"
            time.sleep(0.2)
        again = handle.generate([PROMPT], PARAMS)[0]
        assert again.token_ids == reference
        assert again.stats["mean_accepted"] > 2  # draft == target: nearly everything accepted again
        if mode == "ssd":
            assert again.stats["cache_hit_rate"] > 0.8
    finally:
        handle.shutdown()


def test_killing_the_target_recovers_with_identical_tokens(ray_instance, target):
    handle = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=SpeculationConfig(mode="ssd", k=3, budget=4)))
    try:
        reference = handle.generate([PROMPT, [1, 2]], PARAMS)
        tokens, _ = _kill_mid_stream(handle, "target")
        assert tokens == reference[0].token_ids
        assert handle.metrics()["restarts"]["target"] == 1
        assert [r.token_ids for r in handle.generate([PROMPT, [1, 2]], PARAMS)] == [r.token_ids for r in reference]
    finally:
        handle.shutdown()


def test_exhausted_restarts_fail_requests_with_a_clear_error(ray_instance, target):
    handle = Engine.launch(EngineConfig(target=str(target), spec=SpeculationConfig(mode="ar"), max_restarts=0))
    try:
        with pytest.raises(WorkerGone, match="target"):
            _kill_mid_stream(handle, "target")
    finally:
        handle.shutdown()


def test_killing_one_of_two_drafts_keeps_tokens_and_rebuilds_the_data_plane(ray_instance, target):
    """Two drafts pass KV deltas over the data plane. Killing one breaks that
    group: the other draft carries on alone, the dead one restarts, the
    coordinator rebuilds the group (a new generation) and both build again."""
    spec = SpeculationConfig(mode="ssd", k=3, budget=2)
    handle = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=spec, num_drafts=2))
    try:
        reference = handle.generate([PROMPT], PARAMS)[0].token_ids
        generation = handle.metrics()["data_plane_generation"]
        assert generation >= 1
        tokens, old_pid = _kill_mid_stream(handle, "draft1")
        assert tokens == reference
        deadline = time.monotonic() + 120
        # rebuilt group, and the round loop uses the restarted draft again
        while (
            handle.worker_info()["draft1"]["data_plane"] is None
            or handle.metrics()["data_plane_generation"] <= generation
            or handle.metrics()["drafts_up"] < 2
        ):
            assert time.monotonic() < deadline, "the data plane was never rebuilt"
            time.sleep(0.2)
        assert handle.worker_info()["draft1"]["pid"] != old_pid
        sent = {d: handle.worker_info()[d]["data_plane"]["sent"] for d in ("draft0", "draft1")}
        again = handle.generate([PROMPT], PARAMS)[0]
        assert again.token_ids == reference
        assert again.stats["cache_hit_rate"] > 0.8
        # both drafts serve hits again and hand their KV deltas to each other
        info = handle.worker_info()
        assert all(info[d]["data_plane"]["sent"] > sent[d] for d in ("draft0", "draft1")), (sent, info)
        # sampled generation through a rebuilt group completes in full
        sampled = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True, seed=3)
        assert len(handle.generate([PROMPT], sampled)[0].token_ids) == 64
    finally:
        handle.shutdown()
