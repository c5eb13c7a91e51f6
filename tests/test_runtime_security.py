"""The engine's control and data plane under attack, end to end on a local Ray instance.

Forged frames sent to the workers' real sockets are dropped and show in the
coordinator's metrics (it used to count only its own drops), generation stays
exact, and shutdown leaves no IPC directory behind (every shutdown used to
leave one per worker). Replays and the closed data-plane store are covered
socket by socket in tests/test_control.py and tests/test_data_plane.py.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import zmq
from helpers import save_tiny_checkpoint

from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine, LocalEngineConfig
from saguaro_ray.runtime.control import _IPC_PREFIX, _owner_pid
from saguaro_ray.runtime.wire import FrameCodec, new_key

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[3, 5, 7, 9], [1, 2]]
CALL_TIMEOUT_S = 120.0


def bounded(fn, *args, timeout: float = CALL_TIMEOUT_S):
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=timeout)
    finally:
        pool.shutdown(wait=False)


@pytest.fixture(scope="module")
def ray_instance():
    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("security-models"), "llama", seed=0))


@pytest.fixture(scope="module")
def ar_tokens(target):
    eng = LocalEngine(LocalEngineConfig(target=target, num_threads=1))
    try:
        return [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
    finally:
        eng.close()


def _ipc_dirs() -> set[str]:
    """The IPC dirs on this machine that name their owner's pid (the others are not ours to judge)."""
    root = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 60 else "/tmp"
    return {os.path.join(root, n) for n in os.listdir(root) if n.startswith(_IPC_PREFIX) and _owner_pid(n) is not None}


def test_forged_frames_at_the_workers_show_in_the_engine_metrics(ray_instance, target, ar_tokens):
    handle = Engine.launch(EngineConfig(target=target, draft=target, spec=SpeculationConfig(mode="ssd", k=3, budget=4)))
    socks = []
    try:
        before = handle.metrics()
        assert set(before["dropped_frames"]) == {"target", "draft0", "coordinator"}
        forged = FrameCodec(new_key()).encode({"id": 1, "method": "verify", "args": []})
        ctx = zmq.Context.instance()
        for info in handle.worker_info().values():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(info["endpoint"])
            socks.append(s)
            for _ in range(50):
                s.send(forged)  # signed with another key
            s.send_multipart([b"extra", b"parts"])  # wrong shape
        deadline = time.monotonic() + 30
        while True:
            after = handle.metrics()
            grown = {r: after["dropped_frames"][r] - before["dropped_frames"][r] for r in ("target", "draft0")}
            if all(n >= 51 for n in grown.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert grown == {"target": 51, "draft0": 51}, after
        for role in ("target", "draft0"):
            reasons = after["drop_reasons"][role]
            assert reasons.get("bad mac", 0) - before["drop_reasons"][role].get("bad mac", 0) == 50
            assert reasons.get("malformed", 0) - before["drop_reasons"][role].get("malformed", 0) == 1
        assert sum(handle.worker_info()[r]["dropped_frames"] for r in ("target", "draft0")) >= 102
        assert [r.token_ids for r in bounded(handle.generate, PROMPTS, GREEDY)] == ar_tokens
    finally:
        for s in socks:
            s.close(0)
        handle.shutdown()


def test_shutdown_leaves_no_ipc_directory(ray_instance, target, ar_tokens):
    before = _ipc_dirs()
    # encrypt=True: the engine key with its CURVE keypair travels through Ray (on one node
    # every socket is IPC, so nothing is encrypted; tests/test_control.py covers TCP)
    handle = Engine.launch(EngineConfig(target=target, draft=target, spec=SpeculationConfig(mode="sd", k=3), encrypt=True))
    try:
        ours = _ipc_dirs() - before
        # a socket dir each for the target, the draft, the outcome broadcast and the data-plane store
        assert len(ours) >= 4, ours
        assert [r.token_ids for r in bounded(handle.generate, PROMPTS, GREEDY)] == ar_tokens
    finally:
        handle.shutdown()
    assert not {d for d in ours if os.path.exists(d)}
