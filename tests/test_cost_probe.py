"""``auto``'s step costs measured on the engine's own workers at start (issue 33), on the tiny zoo in process.

What is checked: the probe measures the target's calls at every batch up to the engine's and K + 1
tokens, and the draft's steps; the table is cached per models and runner options and read back by
the next engine of the same kind; the policy is seeded, so the first request's first decode round is
a search with a prediction (no cold-start schedule); the probe's throwaway sequences change no
request's tokens; and a failed probe only leaves the policy unseeded. No time is asserted.
"""

from __future__ import annotations

import json

import pytest

from engine_helpers import greedy
from saguaro_ray.algorithms.strategy_model import AutoPolicy
from saguaro_ray.config import Strategy
from saguaro_ray.engine import LocalEngine
from saguaro_ray.engine import cost_probe
from saguaro_ray.runtime.engine_config import EngineConfig

PROMPTS = ["the quick brown fox", "once upon a time"]


def _engine(zoo, draft: bool = True, **kw) -> LocalEngine:
    return LocalEngine(
        EngineConfig(target=str(zoo / "target"), draft=str(zoo / "draft") if draft else None, threads_per_worker=1, max_batch_size=4, **kw)
    )


@pytest.fixture
def costs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGUARO_COSTS_DIR", str(tmp_path / "costs"))
    return tmp_path / "costs"


def test_the_probe_seeds_auto_and_its_first_round_is_a_search(zoo_tiny, costs_dir):
    eng = _engine(zoo_tiny)
    try:
        [path] = list(costs_dir.glob("*.json"))
        saved = json.loads(path.read_text())
        assert saved["identity"]["models"]["target"] == repr(str(zoo_tiny / "target"))
        costs = saved["costs"]
        # max_k 8, batch <= 4, on short sequences; then batch 4 at K = 0 and 8 and its draft steps, at two contexts by turns
        long = cost_probe.PROBE_LONG
        verify = [(b, t, c >= long) for t, b, c, _ in costs["verify"]]
        assert verify[:12] == [(b, b * (k + 1), False) for b in (1, 2, 4) for k in (0, 1, 4, 8)]
        assert verify[12:] == [(4, 4, False), (4, 4, True), (4, 36, False), (4, 36, True)]
        assert [(n, c >= long) for n, c, _ in costs["draft"]] == [(1, False), (2, False), (4, False), (4, False), (4, True)]
        assert all(s >= 0.0 for _, _, s in costs["draft"])
        # a tree step over a sequence's branches costs at least a draft step over the sequence
        assert [n for n, _, _ in costs["build"]] == [1, 2, 4]
        assert all(b >= d for (_, _, b), (_, _, d) in zip(costs["build"], costs["draft"]))
        policy = eng.loop.assigner.policy
        assert isinstance(policy, AutoPolicy) and policy.snapshot()["verify_s"] is not None  # fitted before any round
        before = len(eng.timeline)
        auto = eng.generate(PROMPTS, greedy(12))
        decode = [r for r in eng.timeline[before:] if not r.prefill]
        assert decode[0].auto is not None and decode[0].auto["chosen"]["seconds"] > 0  # no cold-start round
        measured = decode[0].auto["measured"]  # beside it, what the round took
        assert measured == {"tokens": sum(decode[0].accepted) + decode[0].batch, "seconds": decode[0].end - decode[0].start}
        ar = eng.generate(PROMPTS, greedy(12, speculation=Strategy("ar")))
        assert [r.token_ids for r in auto] == [r.token_ids for r in ar]  # the probe's sequences touched no request's
        for w in eng.workers.values():  # every worker let the probe's sequences go
            w.call("release", [])
            assert not [s for s in w.logic.runner.kv.seqs if isinstance(s, int) and s >= cost_probe.PROBE_SEQ_BASE]
    finally:
        eng.close()


def test_a_second_engine_of_the_same_kind_reads_the_table_and_another_dtype_measures(zoo_tiny, costs_dir, monkeypatch):
    _engine(zoo_tiny).close()
    [first] = list(costs_dir.glob("*.json"))

    def no_probe(*args, **kwargs):
        raise AssertionError("measured again although the table is cached")

    monkeypatch.setattr(cost_probe, "measure", no_probe)
    eng = _engine(zoo_tiny)
    try:
        assert eng.loop.assigner.policy.snapshot()["verify_s"] is not None  # seeded from the cache
    finally:
        eng.close()
    monkeypatch.undo()
    monkeypatch.setenv("SAGUARO_COSTS_DIR", str(costs_dir))
    _engine(zoo_tiny, dtype="bfloat16").close()
    assert len(list(costs_dir.glob("*.json"))) == 2 and first.exists()


def test_no_draft_no_probe_and_a_failed_probe_leaves_the_cold_start(zoo_tiny, costs_dir, monkeypatch, caplog):
    _engine(zoo_tiny, draft=False).close()
    assert not costs_dir.exists()  # auto can only run AR: nothing to measure
    small = _engine(zoo_tiny, max_kv_tokens=256)  # the probe's sequences would take more than a quarter of the KV
    try:
        assert small.loop.assigner.policy.snapshot()["verify_s"] is None and not costs_dir.exists()
        assert small.generate(PROMPTS[:1], greedy(8))[0].token_ids
    finally:
        small.close()
    # room for the short sequences at every batch, not for the long ones: seeded, no cost per token held
    mid = _engine(zoo_tiny, max_kv_tokens=2048)
    try:
        [path] = list(costs_dir.glob("*.json"))
        costs = json.loads(path.read_text())["costs"]
        assert {b for _, b, _, _ in costs["verify"]} == {1, 2, 4}
        assert max(c for _, _, c, _ in costs["verify"]) < cost_probe.PROBE_LONG
        snapshot = mid.loop.assigner.policy.snapshot()
        assert snapshot["verify_s"] is not None and set(snapshot["per_token_held"].values()) == {0.0}
    finally:
        mid.close()
        path.unlink()
        costs_dir.rmdir()

    def broken(*args, **kwargs):
        raise RuntimeError("a worker fell over")

    monkeypatch.setattr(cost_probe, "measure", broken)
    eng = _engine(zoo_tiny)
    try:
        assert "step-cost probe failed" in caplog.text
        assert eng.loop.assigner.policy.snapshot()["verify_s"] is None  # unseeded: the cold-start schedule
        eng.generate(PROMPTS[:1], greedy(8))
        assert not costs_dir.exists()
    finally:
        eng.close()
