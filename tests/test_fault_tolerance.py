"""Killing real worker processes mid-stream: generation completes with the same tokens.

DESIGN §5: the coordinator keeps every sequence's token history, so a lost
worker is rebuilt by re-prefill. A lost draft degrades to point-mass
backups (exact, just slower) while Ray restarts it, then SSD resumes; a lost
target is restarted and running sequences are re-prefilled; when restarts
are exhausted the affected requests fail with a clear error instead of
hanging. Restart budgets are windows (N restarts in any W seconds), a
worker that dies while the engine launches is waited for, and a lost
coordinator is restarted, re-attaches fresh workers, and the handle resumes
its requests.
"""

import math
import os
import signal
import threading
import time

import pytest
import ray

from helpers import coordinator_pid, save_tiny_checkpoint
from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig
from saguaro_ray.engine.transport import WorkerGone
from saguaro_ray.errors import ConfigError
from saguaro_ray.runtime.restart_budget import RestartBudget

PROMPT = [3, 5, 7, 9]
PARAMS = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, max_tokens=240, ignore_eos=True, seed=21)  # a seed fixes the output (issue 34)


@pytest.fixture(scope="module")
def exit_once(tmp_path_factory):
    """A worker whose role names a file here dies (os._exit) in its constructor, once."""
    folder = tmp_path_factory.mktemp("exit-once")
    os.environ["SAGUARO_EXIT_ONCE_DIR"] = str(folder)  # the Ray workers inherit it from ray.init
    yield folder
    del os.environ["SAGUARO_EXIT_ONCE_DIR"]


@pytest.fixture(scope="module")
def ray_instance(exit_once):
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ft"), "llama", seed=0, max_position_embeddings=512)


def _kill_mid_stream(handle, role, after_chunks=3, params=PARAMS):
    pid = handle.worker_info()[role]["pid"]
    tokens = []
    for i, chunk in enumerate(handle.stream(PROMPT, params)):
        tokens += chunk.token_ids
        if i == after_chunks:
            os.kill(pid, signal.SIGKILL)
    return tokens, pid


@pytest.mark.parametrize("mode,params", [("ssd", PARAMS), ("sd", PARAMS), ("ssd", SEEDED)], ids=["ssd", "sd", "ssd-seeded"])
def test_killing_the_draft_keeps_tokens_and_ssd_resumes(ray_instance, target, mode, params):
    """T = 0, and a seeded request at T = 0.8: its tokens do not depend on
    the draft, so one killed mid-request changes none of them."""
    handle = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=SpeculationConfig(mode=mode, k=3, budget=4)))
    try:
        reference = handle.generate([PROMPT], params)[0].token_ids
        tokens, old_pid = _kill_mid_stream(handle, "draft0", params=params)
        assert tokens == reference
        assert handle.metrics()["draft_failures"] == 1
        # the draft comes back as a new process and speculation resumes
        assert handle.worker_info()["draft0"]["pid"] != old_pid
        deadline = time.monotonic() + 120
        while not handle.metrics()["draft_up"]:  # the coordinator reconnects in the background
            assert time.monotonic() < deadline, "draft never came back"
            time.sleep(0.2)
        again = handle.generate([PROMPT], params)[0]
        assert again.token_ids == reference
        assert again.stats["mean_accepted"] > 2  # draft == target: nearly everything accepted again
        if mode == "ssd":
            assert again.stats["cache_hit_rate"] > 0.8
    finally:
        handle.shutdown()


def test_a_draft_too_busy_to_answer_the_liveness_probe_is_not_taken_for_dead(ray_instance, target):
    """A stopped process (SIGSTOP: paused, swapped out, starved on a loaded
    machine) answers nothing for longer than the 2 s liveness probe: slow, not
    dead. Taken for dead, the draft had its calls failed and was dropped from
    the engine while it lived on, and the releases of the sequences it held
    stopped reaching it (their KV stayed held: the soak test's leak under two
    test processes)."""
    handle = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=SpeculationConfig(mode="ssd", k=3, budget=4)))
    pid = handle.worker_info()["draft0"]["pid"]
    resume = threading.Timer(4.0, os.kill, (pid, signal.SIGCONT))
    try:
        reference = handle.generate([PROMPT], PARAMS)[0].token_ids
        tokens = []
        for i, chunk in enumerate(handle.stream(PROMPT, PARAMS)):
            tokens += chunk.token_ids
            if i == 3:
                os.kill(pid, signal.SIGSTOP)
                resume.start()
        assert tokens == reference
        metrics = handle.metrics()
        assert (metrics["draft_failures"], metrics["draft_up"]) == (0, True)
        deadline = time.monotonic() + 30
        while (info := handle.worker_info()["draft0"])["free_kv_blocks"] != info["kv_tokens"] // info["block_size"]:
            assert time.monotonic() < deadline, f"the draft still holds sequences {info['held_sequences']}"
            time.sleep(0.2)
        assert info["pid"] == pid
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
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


def test_restart_budget_is_a_sliding_window():
    now = [0.0]
    budget = RestartBudget(2, 10.0, clock=lambda: now[0])
    for t in (0.0, 5.0, 10.0, 15.0, 20.0, 25.0):  # 2 in any 10 s: as many as you like over time
        now[0] = t
        assert budget.spend(), t
    now[0] = 29.0  # 20, 25 and 29 are three within 10 s
    assert budget.exhausted() and budget.exhausted()  # asking records nothing
    now[0] = 30.0  # 20 has left the window: one more fits
    assert not budget.exhausted()
    now[0] = 29.0
    assert not budget.spend()
    lifetime = RestartBudget(1, math.inf, clock=lambda: now[0])
    assert lifetime.spend() and not (now.__setitem__(0, 1e9) or lifetime.spend())
    assert "max_restarts=2 within 10 s" in str(budget) and "lifetime" in str(lifetime)


@pytest.mark.parametrize("window", [0, -1.0, float("nan"), "60", True])
def test_restart_window_must_be_positive_seconds(target, window):
    with pytest.raises(ConfigError, match="restart_window_s"):
        EngineConfig(target=str(target), restart_window_s=window)


def test_restarts_spread_over_more_than_the_window_keep_serving(ray_instance, target):
    """max_restarts=1 per 2 s: two target deaths 2 s apart both recover (a
    lifetime count of 1 — Ray's own max_restarts — failed the second)."""
    window = 2.0
    handle = Engine.launch(EngineConfig(target=str(target), spec=SpeculationConfig(mode="ar"), max_restarts=1, restart_window_s=window))
    try:
        reference = handle.generate([PROMPT], PARAMS)[0].token_ids
        for restarts in (1, 2):
            tokens, _ = _kill_mid_stream(handle, "target")
            assert tokens == reference
            assert handle.metrics()["restarts"]["target"] == restarts
            time.sleep(window + 0.5)  # the restart leaves the window
    finally:
        handle.shutdown()


def test_exhausted_restarts_fail_requests_with_a_clear_error(ray_instance, target):
    """One restart per hour: the second death within it fails the requests and stops the worker for good."""
    handle = Engine.launch(EngineConfig(target=str(target), spec=SpeculationConfig(mode="ar"), max_restarts=1, restart_window_s=3600))
    try:
        reference = handle.generate([PROMPT], PARAMS)[0].token_ids
        assert _kill_mid_stream(handle, "target")[0] == reference
        with pytest.raises(WorkerGone, match=r"target .*budget .*max_restarts=1 within 3600 s"):
            _kill_mid_stream(handle, "target")
        with pytest.raises(ray.exceptions.ActorDiedError):  # stopped: Ray does not restart it again
            ray.get(handle.workers["target"].info.remote(), timeout=60)
        with pytest.raises(WorkerGone, match="target"):
            handle.generate([PROMPT], PARAMS)
    finally:
        handle.shutdown()


def test_a_worker_dying_while_the_engine_launches_is_waited_for(ray_instance, target, exit_once):
    (exit_once / "draft0").touch()
    handle = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=SpeculationConfig(mode="sd", k=3)))
    try:
        assert not (exit_once / "draft0").exists()  # it did die once
        assert handle.metrics()["restarts"] == {"target": 0, "draft0": 1}
        result = handle.generate([PROMPT], PARAMS)[0]
        assert result.stats["mean_accepted"] > 2  # draft == target: the restarted draft serves
    finally:
        handle.shutdown()


def test_a_worker_dying_at_launch_past_its_budget_fails_the_launch_naming_it(ray_instance, target, exit_once):
    (exit_once / "draft0").touch()
    config = EngineConfig(target=str(target), draft=str(target), spec=SpeculationConfig(mode="sd", k=3), max_restarts=0)
    with pytest.raises(WorkerGone, match="^worker draft0 was restarted more often than its budget allows") as err:
        Engine.launch(config)
    assert "\n" not in str(err.value)
    assert not (exit_once / "draft0").exists()


def _wait_for_coordinator(handle, timeout_s: float = 180) -> None:
    """Until the restarted coordinator answers (meanwhile calls fail with WorkerGone: it is restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            handle.metrics()
            return
        except WorkerGone as exc:
            assert "restarting" in str(exc)
            assert time.monotonic() < deadline, "the coordinator never came back"
            time.sleep(0.5)


def test_a_lost_coordinator_is_restarted_with_fresh_workers_and_its_stream_resumes(ray_instance, target):
    """The coordinator holds the token histories, so its in-flight requests
    are lost with it — but not their callers' part: the handle resumes the
    stream from what it emitted once Ray has restarted the coordinator (see
    tests/test_coordinator_loss.py), with the same tokens. The new one
    restarts the workers (their KV belonged to the lost requests). Past its
    restarts, requests fail with WorkerGone naming the coordinator."""
    handle = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=SpeculationConfig(mode="sd", k=3), max_restarts=1))
    try:
        reference = handle.generate([PROMPT], PARAMS)[0].token_ids
        pids = {role: info["pid"] for role, info in handle.worker_info().items()}
        coordinator = coordinator_pid(handle)
        tokens = []
        for i, chunk in enumerate(handle.stream(PROMPT, PARAMS)):
            tokens += chunk.token_ids
            if i == 2:
                os.kill(coordinator, signal.SIGKILL)
        assert tokens == reference
        _wait_for_coordinator(handle)
        again = handle.generate([PROMPT], PARAMS)[0]
        assert again.token_ids == reference
        assert coordinator_pid(handle) != coordinator
        info = handle.worker_info()
        assert all(info[role]["pid"] != pid for role, pid in pids.items())  # fresh workers, re-attached
        deadline = time.monotonic() + 30  # the lost stream's resumed copy has released its blocks
        while (t := handle.worker_info()["target"])["free_kv_blocks"] != t["kv_tokens"] // t["block_size"]:
            assert time.monotonic() < deadline, "the target still holds blocks"
            time.sleep(0.2)
        with pytest.raises(WorkerGone, match="coordinator"):
            for i, _ in enumerate(handle.stream(PROMPT, PARAMS)):
                if i == 2:
                    os.kill(coordinator_pid(handle), signal.SIGKILL)  # its one restart is spent
        with pytest.raises(WorkerGone, match="coordinator"):
            handle.metrics()
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
