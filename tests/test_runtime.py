"""The distributed runtime on a local Ray instance (CPU, tiny random models).

One Ray instance serves the whole module (8 logical CPUs on a 2-core box on
purpose: the actors ask for fractional CPUs) and one SSD engine (draft =
target) serves most tests; every token stream is compared against the
in-process ``ar`` engine on the same checkpoint. DESIGN §5, §6, §8.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import ray
import zmq
from helpers import engine_pids, save_tiny_checkpoint

from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig, connect
from saguaro_ray.engine import LocalEngine
from saguaro_ray.errors import (
    CheckpointError,
    ConfigError,
    IncompatibleModelsError,
    PromptTooLongError,
)
from saguaro_ray.runtime.wire import FrameCodec, new_key

SPEC = SpeculationConfig(mode="ssd", k=3, budget=4, backup="neural")  # with draft == target every lookup then hits
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[3, 5, 7, 9], [1, 2], [4, 4, 4, 4, 4, 6], [10, 20, 30, 40, 50, 60, 70, 80, 90], [99], [17, 42, 8]]
CALL_TIMEOUT_S = 120.0


def bounded(fn: Callable[..., Any], *args: Any, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
    """Run ``fn`` with a deadline so a hung engine fails the test instead of the suite."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args, **kwargs).result(timeout=timeout)
    finally:
        pool.shutdown(wait=False)


def tokens(results: list) -> list[list[int]]:
    return [r.token_ids for r in results]


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-models")
    return {
        "target": str(save_tiny_checkpoint(root, "llama", seed=0)),
        # same vocabulary and tokenizer, unrelated weights and architecture: many misses
        "other": str(save_tiny_checkpoint(root, "qwen3", seed=7)),
        # a different vocabulary: must be refused before anything starts
        "small_vocab": str(save_tiny_checkpoint(root, "llama", seed=1, vocab_size=112)),
        # a target ~10x the tiny one (same vocabulary) for the overlap timeline
        "big": str(save_tiny_checkpoint(root, "llama", seed=3, hidden_size=384, intermediate_size=1536, num_hidden_layers=4)),
    }


@pytest.fixture(scope="module")
def reference(ckpts):
    """The in-process ``ar`` engine on the target: the ground truth at T = 0."""
    eng = LocalEngine(EngineConfig(target=ckpts["target"], threads_per_worker=1))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ar_tokens(reference):
    """Reference greedy tokens per prompt (each prompt alone)."""
    return {tuple(p): reference.generate([p], GREEDY)[0].token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def engine(ray_instance, ckpts):
    h = Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["target"], spec=SPEC))
    yield h
    h.shutdown()


def _alive_actors() -> set[str]:
    from ray._private import state

    return {aid for aid, a in state.actors().items() if a.get("State") != "DEAD"}


def _live_pgs() -> set[str]:
    return {pid for pid, pg in ray.util.placement_group_table().items() if pg.get("state") != "REMOVED"}


# --------------------------------------------------------- 1. exactness T = 0


def _check_stats(results: list) -> None:
    for r in results:
        assert r.mode == "ssd"
        assert "mean_accepted" in r.stats and "cache_hit_rate" in r.stats
        assert isinstance(r.stats["mean_accepted"], float) and 0.0 <= r.stats["mean_accepted"] <= SPEC.k
        assert isinstance(r.stats["cache_hit_rate"], float) and 0.0 <= r.stats["cache_hit_rate"] <= 1.0


def test_ssd_same_draft_matches_ar(engine, ar_tokens):
    for p in PROMPTS:  # batch 1
        [r] = bounded(engine.generate, [p], GREEDY)
        assert r.token_ids == ar_tokens[tuple(p)], f"prompt {p}"
        assert r.finish_reason == "length" and len(r.token_ids) == GREEDY.max_tokens
        _check_stats([r])
        # the draft is the target: every speculation is right, every lookup hits —
        # lookups the target placed itself as verification ended (a lookup that
        # overtakes its round's build waits for it at the draft)
        assert r.stats["cache_hit_rate"] == 1.0 and r.stats["mean_accepted"] > 1.0
    assert engine.worker_info()["target"]["forwarded_calls"] > 0
    assert all(x["forwarded"] for x in engine.timeline() if x["lookup"] is not None)
    # every next proposal is a hit the draft served: it starts each next build itself,
    # once its lookup is answered, and the build call is answered from that build —
    # all but the first of each sequence's six rounds (its proposal is the backup the
    # round loop asked for); the last too, whose K depended on the outcome (21 of 24
    # tokens out after round 5): that lookup carried one plan per outcome
    spec_rounds = [x for x in engine.timeline() if x["build"] is not None]
    assert len(spec_rounds) == 6 * len(PROMPTS)
    assert sum(x["ahead"] for x in spec_rounds) == 5 * len(PROMPTS), [x["ahead"] for x in spec_rounds]
    four = PROMPTS[:4]  # batch 4
    res = bounded(engine.generate, four, GREEDY)
    assert [r.prompt_index for r in res] == [0, 1, 2, 3]
    assert tokens(res) == [ar_tokens[tuple(p)] for p in four]
    _check_stats(res)


def test_ssd_unrelated_draft_matches_ar(ray_instance, ckpts, ar_tokens, reference):
    # (with builds started ahead off: the draft builds only when the build call comes)
    h = Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["other"], spec=SPEC, build_ahead=False))
    try:
        singles = [bounded(h.generate, [p], GREEDY)[0] for p in PROMPTS]
        assert tokens(singles) == [ar_tokens[tuple(p)] for p in PROMPTS]
        four = PROMPTS[2:6]
        res = bounded(h.generate, four, GREEDY)
        assert tokens(res) == [ar_tokens[tuple(p)] for p in four]
        _check_stats(singles + res)
        # an unrelated draft must miss sometimes (otherwise the miss path went untested)
        rates = [r.stats["cache_hit_rate"] for r in singles + res]
        print("unrelated draft: cache hit rates", rates, "mean accepted", [r.stats["mean_accepted"] for r in res])
        assert min(rates) < 1.0
        # A ragged batch: sequences leave at different rounds, and near its length limit a
        # sequence's neural backup depends on the outcome, so it is drafted after the lookup
        # the target placed. Every live sequence's lookup is answered once per round.
        ragged = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17, 24)]
        before = len(h.timeline())
        res = bounded(h.generate, PROMPTS[:4], ragged)
        assert tokens(res) == tokens(reference.generate(PROMPTS[:4], ragged))
        recs = [x for x in h.timeline()[before:] if not x["prefill"]]
        for i, x in enumerate(recs):
            live_after = recs[i + 1]["batch"] if i + 1 < len(recs) else 0
            assert x["hits"] + x["misses"] == live_after, x
            assert x["forwarded"] or x["lookup"] is None, x
        assert any(x["misses"] for x in recs)
        assert not any(x["ahead"] for x in h.timeline()) and h.worker_info()["draft0"]["builds_ahead"]["started"] == 0
    finally:
        h.shutdown()


def test_two_drafts_match_ar_and_share_the_outcome_set(ray_instance, ckpts, ar_tokens):
    """Two draft actors split the outcome set; T = 0 is token-exact, and with
    the target as draft (every proposal accepted, KV deltas shared between the
    drafts) sampled outputs are a function of the seed alone — identical to
    the in-process engine."""
    spec = SpeculationConfig(mode="ssd", k=3, budget=2)
    h = Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["other"], spec=spec, num_drafts=2))
    try:
        assert sorted(h.worker_info()) == ["draft0", "draft1", "target"]
        res = bounded(h.generate, PROMPTS[:4], GREEDY)
        assert tokens(res) == [ar_tokens[tuple(p)] for p in PROMPTS[:4]]
        _check_stats(res)
    finally:
        h.shutdown()
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=5)
    h = Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["target"], spec=spec, num_drafts=2))
    local = LocalEngine(EngineConfig(target=ckpts["target"], draft=ckpts["target"], spec=spec, threads_per_worker=1))
    try:
        got = bounded(h.generate, PROMPTS[:3], sampled)
        want = local.generate(PROMPTS[:3], sampled)
        assert tokens(got) == tokens(want)
        # KV deltas reached the peer draft over the data plane
        m = h.metrics()
        assert m["data_plane_generation"] >= 1
        assert (m["data_plane_backend"], m["data_plane_error"]) == ("gloo", None)  # a CPU engine: gloo is no fallback
        info = h.worker_info()
        assert all(info[r]["data_plane"]["warmed_pairs"] == 2 for r in info)  # every pair exchanged at formation
        # every round's outcomes reached both drafts straight from the target (the
        # coordinator's one-message broadcast stays the path when a verification was re-sent)
        assert h.metrics()["broadcast_subscribers"] == ["draft0", "draft1"]
        assert info["target"]["forwarded_calls"] > 0 and info["target"]["forwarded_calls"] % 2 == 0
        assert info["draft0"]["broadcast_calls"] == info["draft1"]["broadcast_calls"]
        assert sum(info[d]["data_plane"]["received"] for d in ("draft0", "draft1")) > 0
        assert any(r.stats["cache_hit_rate"] > 0 for r in got)
    finally:
        h.shutdown()
        local.close()


def test_ssd_over_ray_samples_match_in_process(ray_instance, ckpts):
    """At T > 0 with a fixed fan-out and neural backups an SSD run is a
    function of the seeds, so through the actors — lookups placed by the
    target, backups and next builds made by the draft from its plans (one per
    outcome in the last rounds, where the next K depends on it) — it gives the
    in-process engine's tokens, whose law the sampling tests check. The unrelated draft mostly misses (backups), the
    same one mostly hits (cached speculations)."""
    sampled = SamplingParams(temperature=0.9, top_k=20, max_tokens=20, ignore_eos=True, seed=5)
    spec = SpeculationConfig(mode="ssd", k=3, fanout=(2, 2, 1, 1), backup="neural")
    for draft in ("target", "other"):
        same = dict(target=ckpts["target"], draft=ckpts[draft], spec=spec)
        local = LocalEngine(EngineConfig(**same, threads_per_worker=1))
        try:
            want = tokens(local.generate(PROMPTS[:3], sampled))
        finally:
            local.close()
        h = Engine.launch(EngineConfig(**same))
        try:
            assert tokens(bounded(h.generate, PROMPTS[:3], sampled)) == want, draft
            decode = [x for x in h.timeline() if not x["prefill"]]
            assert sum(x["ahead"] for x in decode) >= len(decode) // 2, [x["ahead"] for x in decode]
        finally:
            h.shutdown()


def test_pyramid_over_ray_matches_in_process(ray_instance, ckpts, ar_tokens):
    """PyramidSD through the actors: T = 0 equals AR; at T > 0 the samples are
    a function of the seed, so the exact stages (the drafter-invariant rule,
    tokens only) and the lossy fuzzy ones — whose q rows go draft → qualifier
    → target over the data plane, qualified blocks concatenated as
    references — give the in-process tokens."""
    spec = SpeculationConfig(mode="pyramid", lq=4, ld=2)
    h = Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["other"], qualifier=ckpts["target"], spec=spec))
    try:
        assert tokens(bounded(h.generate, PROMPTS[:3], GREEDY)) == [ar_tokens[tuple(p)] for p in PROMPTS[:3]]
    finally:
        h.shutdown()
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=9)
    fuzzy = replace(spec, stage1="fuzzy", stage2="fuzzy", tau_q=0.05, tau_t=0.1, allow_lossy=True)
    for sp, rows in ((spec, False), (fuzzy, True)):
        same = dict(target=ckpts["target"], draft=ckpts["other"], qualifier=ckpts["target"], spec=sp)
        h = Engine.launch(EngineConfig(**same))
        local = LocalEngine(EngineConfig(**same, threads_per_worker=1))
        try:
            assert tokens(bounded(h.generate, PROMPTS[:3], sampled)) == tokens(local.generate(PROMPTS[:3], sampled)), sp.stage1
            info = h.worker_info()
            assert (info["qualifier"]["data_plane"]["received"] > 0 and info["target"]["data_plane"]["received"] > 0) == rows
        finally:
            h.shutdown()
            local.close()


def test_one_engine_runs_every_strategy_in_one_batch_over_ray(ray_instance, ckpts, ar_tokens):
    """Through the actors (the target places SSD's lookups for the SSD items
    of a mixed verification): every strategy in one batch equals AR at T = 0, and at
    T > 0 with fixed fan-outs and backups (nothing timed) the samples equal
    the in-process engine's sample by sample."""
    from saguaro_ray.config import Strategy

    spec = SpeculationConfig(k=3, fanout=(2, 2, 1, 1), backup="neural", lq=3, ld=2)
    same = dict(target=ckpts["target"], draft=ckpts["other"], qualifier=ckpts["target"], spec=spec)
    modes = ["ar", "sd", "ssd", "pyramid", "ssd", "sd"]
    h = Engine.launch(EngineConfig(**same))
    local = LocalEngine(EngineConfig(**same, threads_per_worker=1))
    try:
        greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculation=m) for m in modes[:5]] + [
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculation=Strategy("auto"))
        ]
        got = bounded(h.generate, PROMPTS, greedy)
        assert tokens(got) == [ar_tokens[tuple(p)] for p in PROMPTS]
        assert [r.mode for r in got] == modes[:5] + ["auto"]
        sampled = [SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=9 + i, speculation=m) for i, m in enumerate(modes)]
        got = tokens(bounded(h.generate, PROMPTS, sampled))
        assert got == tokens(local.generate(PROMPTS, sampled))
        # the one rule: each sample is AR's under its seed, whatever strategy ran it
        assert got == tokens(local.generate(PROMPTS, [replace(p, speculation=Strategy("ar")) for p in sampled]))
        info = h.worker_info()
        assert info["target"]["forwarded_calls"] > 0  # the mixed verifications placed the SSD lookups
        chosen = h.metrics()["strategies"]["sequence_rounds"]  # the engine's metrics say what ran
        assert set(chosen) >= {"ar", "sd", "ssd", "pyramid"}
    finally:
        h.shutdown()
        local.close()


# ------------------------------------------------------ 2. stream / async API


def test_stream_concatenates_to_generate(engine, ar_tokens):
    p = PROMPTS[0]
    chunks = bounded(lambda: list(engine.stream(p, GREEDY)))
    assert len(chunks) >= 2
    assert all(set(vars(c)) >= {"token_ids", "text", "finish_reason"} for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == ar_tokens[tuple(p)]
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    [gen] = bounded(engine.generate, [p], GREEDY)
    assert "".join(c.text for c in chunks) == gen.text


def test_agenerate_and_astream(engine, ar_tokens):
    p1, p2 = PROMPTS[1], PROMPTS[2]

    async def main():
        res, chunks = await asyncio.gather(
            engine.agenerate([p1, p2], GREEDY),
            _collect(engine.astream(p2, GREEDY)),
        )
        return res, chunks

    async def _collect(agen):
        return [c async for c in agen]

    res, chunks = bounded(asyncio.run, main())
    assert tokens(res) == [ar_tokens[tuple(p1)], ar_tokens[tuple(p2)]]
    assert [t for c in chunks for t in c.token_ids] == ar_tokens[tuple(p2)]
    assert chunks[-1].finish_reason == "length"


# --------------------------------------------------- 3. continuous batching


def test_concurrent_requests_equal_alone(engine):
    reqs = [
        ([3, 5, 7, 9], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        ([1, 2], SamplingParams(temperature=0.8, max_tokens=30, seed=11, ignore_eos=True)),
        ([4, 4, 4, 6], SamplingParams(temperature=1.0, top_k=20, max_tokens=25, seed=3, ignore_eos=True)),
        ([10, 20, 30], SamplingParams(temperature=1.3, top_p=0.9, max_tokens=35, seed=12345)),
        ([99, 98], SamplingParams(temperature=0.5, top_k=5, top_p=0.8, max_tokens=20, seed=0, ignore_eos=True)),
        ([17, 42, 8, 8], SamplingParams(temperature=1.0, max_tokens=60, seed=7, ignore_eos=True)),
    ]
    alone = [tokens(bounded(engine.generate, [p], sp)) for p, sp in reqs]
    start = len(engine.timeline())
    barrier = threading.Barrier(len(reqs))

    def one(i: int) -> list[list[int]]:
        barrier.wait(timeout=30)
        p, sp = reqs[i]
        return tokens(engine.generate([p], sp))

    with ThreadPoolExecutor(len(reqs)) as pool:
        futs = [pool.submit(one, i) for i in range(len(reqs))]
        together = [f.result(timeout=CALL_TIMEOUT_S) for f in futs]
    assert together == alone
    # the requests did share rounds (else this proved nothing about batching)
    batches = [r["batch"] for r in engine.timeline()[start:]]
    print("concurrent: batch sizes per round", batches)
    assert max(batches) >= 2
    # and T > 0 really sampled (different seeds of one request differ)
    p, sp = reqs[1]
    other = tokens(bounded(engine.generate, [p], sp.with_seed(12)))
    assert other != alone[1]


# ------------------------------------------------------------- 4. connect


def test_connect_from_another_process(ray_instance, ckpts, ar_tokens):
    name = f"rt-{uuid.uuid4().hex[:8]}"
    ns = f"saguaro-test-{os.getpid()}"
    h = Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["target"], spec=SPEC, name=name, namespace=ns))
    try:
        mine = tokens(bounded(h.generate, PROMPTS[:3], GREEDY))
        assert mine == [ar_tokens[tuple(p)] for p in PROMPTS[:3]]
        address = ray.get_runtime_context().gcs_address
        code = textwrap.dedent(
            f"""
            import json
            from saguaro_ray import SamplingParams, connect
            h = connect({name!r}, address={address!r}, namespace={ns!r})
            r = h.generate({PROMPTS[:3]!r}, SamplingParams(temperature=0.0, max_tokens={GREEDY.max_tokens}, ignore_eos=True))
            print("RESULT " + json.dumps([x.token_ids for x in r]), flush=True)
            """
        )
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150, env=env, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:{proc.stdout[-2000:]}\nstderr:{proc.stderr[-4000:]}"
        assert json.loads(lines[-1][len("RESULT "):]) == mine
        # attaching from this process works too, before shutdown
        assert tokens(bounded(connect(name, namespace=ns).generate, PROMPTS[:1], GREEDY)) == mine[:1]
    finally:
        h.shutdown()
    # ray.kill is asynchronous in the GCS: allow it a moment to drop the name
    t0 = time.monotonic()
    deadline = t0 + 15
    while True:
        try:
            connect(name, namespace=ns)
        except ConfigError as e:
            assert name in str(e)
            print(f"connect() refused {time.monotonic() - t0:.2f} s after shutdown() returned")
            break
        assert time.monotonic() < deadline, "connect() still finds the engine 15 s after shutdown()"
        time.sleep(0.2)


# ------------------------------------------------ 5. validation before start


def test_invalid_configs_start_nothing(engine, ckpts):
    before_actors, before_pgs = _alive_actors(), _live_pgs()
    assert len(before_actors) >= 3 and len(before_pgs) >= 1  # the shared engine: the census sees live actors
    with pytest.raises(ConfigError, match="draft"):
        EngineConfig(target=ckpts["target"], spec=SpeculationConfig(mode="ssd"))
    with pytest.raises(ConfigError, match="num_drafts"):
        EngineConfig(target=ckpts["target"], draft=ckpts["target"], spec=SPEC, num_drafts=0)
    with pytest.raises(ConfigError, match="placement_strategy"):
        EngineConfig(target=ckpts["target"], draft=ckpts["target"], spec=SPEC, placement_strategy="NOPE")
    with pytest.raises(IncompatibleModelsError, match="vocab"):
        Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["small_vocab"], spec=SPEC))
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["target"] + "-missing", spec=SPEC))
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.launch(EngineConfig(target="/nonexistent/saguaro/model", spec=SpeculationConfig(mode="ar")))
    assert _alive_actors() == before_actors
    assert _live_pgs() == before_pgs


# --------------------------------------------------------- 6. bad input


def test_bad_input_raises_user_errors_and_engine_keeps_serving(engine, ar_tokens):
    long_prompt = [5] * 120  # + max_tokens 24 > context 128

    async def astream_all():
        return [c async for c in engine.astream(long_prompt, GREEDY)]

    calls = {
        "generate": lambda: engine.generate([long_prompt], GREEDY),
        "stream": lambda: list(engine.stream(long_prompt, GREEDY)),
        "agenerate": lambda: asyncio.run(engine.agenerate([long_prompt], GREEDY)),
        "astream": lambda: asyncio.run(astream_all()),
    }
    for how, call in calls.items():
        with pytest.raises(PromptTooLongError, match="context window") as err:
            bounded(call)
        # the handle unwraps Ray's wrapper: the caller gets our error itself
        assert type(err.value) is PromptTooLongError, (how, type(err.value).__mro__)
    with pytest.raises(ConfigError, match="token ids") as err:
        bounded(engine.generate, [[1, 2, 100000]], GREEDY)
    assert type(err.value) is ConfigError
    # a bad prompt in a batch fails the whole call before any model work
    with pytest.raises(PromptTooLongError):
        bounded(engine.generate, [PROMPTS[0], long_prompt], GREEDY)
    res = bounded(engine.generate, PROMPTS[:2], GREEDY)
    assert tokens(res) == [ar_tokens[tuple(p)] for p in PROMPTS[:2]]


# -------------------------------------------------------- 7. forged frames


def test_forged_control_frames_are_dropped(engine, ar_tokens):
    info = engine.worker_info()
    assert set(info) == {"target", "draft0"}
    before = {role: i["dropped_frames"] for role, i in info.items()}
    metrics_before = engine.metrics()
    ctx = zmq.Context.instance()
    forged = FrameCodec(new_key()).encode({"id": 1, "method": "verify", "args": []})
    socks = []
    try:
        for i in info.values():
            assert i["endpoint"].startswith("ipc://"), i  # one node: IPC
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(i["endpoint"])
            socks.append(s)
            s.send(b"garbage")  # shorter than a MAC
            s.send(os.urandom(200))  # random bytes: bad MAC
            s.send(forged)  # a well-formed request signed with the wrong key
            s.send_multipart([b"extra", b"parts"])  # wrong shape
        deadline = time.monotonic() + 20
        while True:
            now = {role: i["dropped_frames"] for role, i in engine.worker_info().items()}
            if all(now[r] - before[r] >= 4 for r in before) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert all(now[r] - before[r] == 4 for r in before), (before, now)
        # the engine's metrics count what the workers dropped (they once showed only the coordinator's own drops)
        metrics = engine.metrics()
        for r in before:
            assert metrics["dropped_frames"][r] - metrics_before["dropped_frames"][r] == 4, (metrics_before, metrics)
            grown = {k: v - metrics_before["drop_reasons"][r].get(k, 0) for k, v in metrics["drop_reasons"][r].items()}
            assert {k: v for k, v in grown.items() if v} == {"bad mac": 3, "malformed": 1}
        for s in socks:  # nothing is ever answered to an unauthenticated peer
            assert not s.poll(200, zmq.POLLIN)
    finally:
        for s in socks:
            s.close(0)
    res = bounded(engine.generate, PROMPTS[:3], GREEDY)
    assert tokens(res) == [ar_tokens[tuple(p)] for p in PROMPTS[:3]]


def _ipc_dirs() -> set[str]:
    """The IPC dirs on this machine that name their owner's pid (others' are not ours to judge)."""
    from saguaro_ray.runtime.control.endpoints import _IPC_PREFIX, _ipc_dir_root, _owner_pid

    root = _ipc_dir_root()
    return {os.path.join(root, n) for n in os.listdir(root) if n.startswith(_IPC_PREFIX) and _owner_pid(n) is not None}


def test_shutdown_leaves_no_ipc_directory(ray_instance, ckpts, ar_tokens):
    """Every shutdown used to leave a private IPC dir per worker behind."""
    from saguaro_ray.runtime.control.endpoints import _owner_pid

    before = _ipc_dirs()
    # encrypt=True: the engine key with its CURVE keypair travels through Ray (on one node
    # every socket is IPC, so nothing is encrypted; tests/test_control.py covers TCP)
    h = Engine.launch(EngineConfig(target=ckpts["target"], draft=ckpts["target"], spec=SpeculationConfig(mode="sd", k=3), encrypt=True))
    try:
        pids = engine_pids(h)  # this engine's (not those of engines another test process launches meanwhile)
        ours = {d for d in _ipc_dirs() - before if _owner_pid(os.path.basename(d)) in pids}
        # a socket dir each for the target, the draft, the outcome broadcast and the data-plane store
        assert len(ours) >= 4, ours
        assert tokens(bounded(h.generate, PROMPTS[:2], GREEDY)) == [ar_tokens[tuple(p)] for p in PROMPTS[:2]]
    finally:
        h.shutdown()
    assert not {d for d in ours if os.path.exists(d)}


# ----------------------------------------------------------- 8. timeline


def test_timeline_overlaps_build_with_verify(ray_instance, ckpts):
    """The draft builds round T+1's cache while the target verifies round T.

    The target here is ~10x the tiny model (verify ~15 ms on one thread):
    with the 1 ms verify of the tiny model, the skew between the two workers
    starting on a loaded 2-core box is as long as verification itself, and
    the overlap would be decided by the OS scheduler, not by the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    p = PROMPTS[3]
    ref = LocalEngine(EngineConfig(target=ckpts["big"], threads_per_worker=1))
    try:
        expected = ref.generate([p], params)[0].token_ids
    finally:
        ref.close()
    h = Engine.launch(EngineConfig(target=ckpts["big"], draft=ckpts["target"], spec=SPEC))
    try:
        [r] = bounded(h.generate, [p], params)
        recs = h.timeline()
    finally:
        h.shutdown()
    assert r.token_ids == expected
    assert len(recs) == r.stats["rounds"]
    ssd = [x for x in recs if x["verify"] is not None and x["build"] is not None]
    assert len(ssd) >= 5, recs
    overlapped = [x["build"][0] < x["verify"][1] for x in ssd]
    assert sum(overlapped) > len(ssd) / 2, f"build started after verify ended in {overlapped.count(False)}/{len(ssd)} rounds"
    # control-plane overhead: each round's wall time as the coordinator saw it
    # (its start/end stamps) beyond the worker time on its critical path:
    # backup drafting (misses), then max(verify, build), then the cache lookup
    def dur(span):
        return 0.0 if span is None else span[1] - span[0]

    overhead, skew, hidden = [], [], []
    for x in ssd:
        assert x["start"] <= x["verify"][0] and x["verify"][1] <= x["end"], x
        busy = dur(x["draft"]) + max(dur(x["verify"]), dur(x["build"])) + dur(x["lookup"])
        overhead.append(1e3 * (x["end"] - x["start"] - busy))
        skew.append(1e3 * (x["build"][0] - x["verify"][0]))
        hidden.append(x["build"][1] <= x["verify"][1])
    assert overhead
    verify_ms = [1e3 * (x["verify"][1] - x["verify"][0]) for x in ssd]
    build_ms = [1e3 * (x["build"][1] - x["build"][0]) for x in ssd]
    print(
        f"\nSSD timeline: {len(ssd)} rounds; verify median {statistics.median(verify_ms):.2f} ms, "
        f"build median {statistics.median(build_ms):.2f} ms; build started during verify in "
        f"{sum(overlapped)}/{len(ssd)}, finished within it in {sum(hidden)}/{len(ssd)}; "
        f"build-start skew median {statistics.median(skew):.2f} ms; control-plane overhead per round: "
        f"median {statistics.median(overhead):.2f} ms, mean {statistics.mean(overhead):.2f} ms, max {max(overhead):.2f} ms"
    )
