"""The round timeline and per-request stats (DESIGN §4 SSD protocol, §6).

SSD's point is that the draft builds round T+1's speculations *while* the
target verifies round T. The engine's timeline records each worker call's span
(perf_counter); these tests check the structure of that schedule — which
spans exist in which rounds, that the build starts before the verification it
overlaps has ended, and that the hit/miss/backup bookkeeping adds up — never
how long anything took.
"""

from __future__ import annotations


import pytest
from helpers import perturbed_checkpoint, save_tiny_checkpoint

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [3], [44, 45, 46, 47, 48, 49], [90, 12, 77, 31]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap_models")
    target = save_tiny_checkpoint(root, "llama", seed=3)
    # For the overlap test: big enough that one verification takes tens of
    # milliseconds even with the packed CPU kernels (10 layers of width 512).
    # With the tiny models a verification lasts ~1-2 ms, less
    # than one GIL switch interval (5 ms) and one OS time slice, and on a
    # loaded 2-core machine the draft's thread is often not even scheduled
    # before it ends — that measures the machine, not the engine's schedule.
    wide = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4)
    big = save_tiny_checkpoint(root, "llama", seed=5, **wide)
    return {
        "target": target,
        "draft": perturbed_checkpoint(target, root / "draft", 0.1, seed=7),  # mixes hits and misses
        "other": save_tiny_checkpoint(root, "llama", seed=11),
        "big_target": big,
        "big_draft": perturbed_checkpoint(big, root / "big_draft", 0.1, seed=7),
    }


def engine(models, mode: str, draft: str = "draft", target: str = "target", **spec) -> LocalEngine:
    return LocalEngine(
        EngineConfig(
            target=str(models[target]),
            draft=str(models[draft]) if mode != "ar" else None,
            qualifier=str(models["other"]) if mode == "pyramid" else None,
            spec=SpeculationConfig(mode=mode, **spec),
            threads_per_worker=1,
        )
    )


def generate_run(eng: LocalEngine, prompts, params):
    """One generate call; returns (results, the timeline records of that call)."""
    before = len(eng.timeline)
    res = eng.generate(prompts, params)
    return res, eng.timeline[before:]


def ragged_params(temperature: float, lengths=(9, 24, 17, 3, 30), seed: int = 4) -> list[SamplingParams]:
    """Different max_tokens per prompt, so sequences retire in different rounds."""
    return [
        SamplingParams(temperature=temperature, top_k=4 if temperature else 0, max_tokens=n, seed=seed, ignore_eos=True)
        for n in lengths
    ]


SSD_CONFIGS = [
    dict(k=3, fanout="auto", budget=4, backup="neural"),
    dict(k=2, fanout=(2, 1, 1), backup="fast"),
    dict(k=4, fanout="auto", budget=8, backup="auto"),
    dict(k=3, fanout=(1, 0, 0, 0), backup="neural"),
]


# ------------------------------------------------------------------ SSD overlap


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", SSD_CONFIGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_ssd_build_overlaps_verification(models, spec, temperature):
    eng = engine(models, "ssd", draft="big_draft", target="big_target", **spec)
    try:
        _, recs = generate_run(eng, PROMPTS, ragged_params(temperature))
    finally:
        eng.close()
    first, rounds = recs[0], recs[1:]
    assert first.build is None and first.verify is not None  # prefill round: no speculation yet
    assert rounds, "expected SSD rounds after the first"
    for r in rounds:
        assert r.build is not None, f"SSD round {r.index} has no build span"
        assert r.verify is not None
        assert r.build[0] <= r.build[1] and r.verify[0] <= r.verify[1]
        assert r.hidden == (r.build[1] <= r.verify[1])
    both = [r for r in rounds if r.build is not None and r.verify is not None]
    overlapped = [r for r in both if r.build[0] < r.verify[1]]
    assert len(overlapped) >= 0.8 * len(both), (
        f"build started after verification ended in {len(both) - len(overlapped)} of {len(both)} rounds"
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", SSD_CONFIGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_ssd_lookup_bookkeeping(models, spec, temperature):
    """hits + misses equals the sequences still live after the round (the next
    round's batch; 0 after the last round); lookups happen only while
    sequences are live. Drafting before verification happens only in the
    first SSD round (the admitted sequences have no speculation yet); a round
    with misses serves them at its lookup (the only draft drafts neural
    backups inside the lookup call; a fast guess right after it), so a round
    records a backup exactly when it is the first or it missed."""
    eng = engine(models, "ssd", **spec)
    try:
        res, recs = generate_run(eng, PROMPTS, ragged_params(temperature))
    finally:
        eng.close()
    assert [len(r.token_ids) for r in res] == [9, 24, 17, 3, 30]
    rounds = recs[1:]
    assert recs[0].batch == len(PROMPTS)
    for i, r in enumerate(rounds):
        live_after = rounds[i + 1].batch if i + 1 < len(rounds) else 0
        assert r.hits + r.misses == live_after, f"round {r.index}: {r.hits} hits + {r.misses} misses, {live_after} live"
        assert (r.lookup is not None) == (live_after > 0)
        assert len(r.accepted) == r.batch
        assert (r.draft is not None) == (i == 0), f"round {r.index}: drafting before verification"
        needs_backup = i == 0 or r.misses > 0
        assert (r.backup is not None) == needs_backup, f"round {r.index}: backup={r.backup}, needed={needs_backup}"
        if r.backup is not None:
            assert r.backup in ("neural", "fast")
            if spec["backup"] != "auto":
                assert r.backup == spec["backup"]
    batches = [r.batch for r in recs]
    assert batches == sorted(batches, reverse=True) and batches[-1] >= 1  # sequences only retire


def test_ssd_single_sequence_stats_match_timeline(models):
    eng = engine(models, "ssd", k=3, fanout="auto", budget=4)
    try:
        (res,), recs = generate_run(eng, [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    finally:
        eng.close()
    assert res.stats["rounds"] == len(recs)
    lookups = sum(r.hits + r.misses for r in recs)
    assert lookups == len(recs) - 2  # every SSD round but the last looks up
    assert res.stats["cache_hit_rate"] == pytest.approx(sum(r.hits for r in recs) / lookups)
    assert 0 < res.stats["cache_hit_rate"] < 1, "the draft should mix hits and misses"
    assert len(res.token_ids) == 1 + sum(a + 1 for r in recs[1:] for a in r.accepted)


def test_timeline_spans_per_mode(models):
    """Which spans each mode records: AR verifies only; SD drafts then
    verifies; PyramidSD drafts (with qualification) then verifies; none of them
    builds a cache or looks anything up."""
    params = ragged_params(0.0)
    for mode, spec in (("ar", {}), ("sd", dict(k=3)), ("pyramid", dict(lq=3, ld=2))):
        eng = engine(models, mode, **spec)
        try:
            _, recs = generate_run(eng, PROMPTS, params)
        finally:
            eng.close()
        for i, r in enumerate(recs):
            assert r.verify is not None
            assert r.build is None and r.lookup is None and r.hidden is None
            assert r.hits == r.misses == 0 and r.backup is None
            if mode == "ar" or i == 0:
                assert r.draft is None, (mode, r.index)
            else:
                assert r.draft is not None and r.draft[1] <= r.verify[0] + 1e-9, (mode, r.index)  # draft, then verify


# ------------------------------------------------------------------------- stats


@pytest.mark.parametrize(
    "mode, spec",
    [
        ("ar", {}),
        ("sd", dict(k=3)),
        ("ssd", dict(k=3, fanout="auto", budget=4)),
        ("ssd", dict(k=2, fanout=(0, 0, 0), backup="fast")),
        ("pyramid", dict(stage1="exact", stage2="exact")),
        ("pyramid", dict(stage1="assisted", stage2="exact")),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_stats_fields(models, mode, spec, temperature):
    eng = engine(models, mode, **spec)
    try:
        res, recs = generate_run(eng, PROMPTS, ragged_params(temperature))
    finally:
        eng.close()
    for r in res:
        s = r.stats
        assert r.mode == mode
        assert s["lossy"] is False
        assert s["rounds"] >= 1 and s["rounds"] <= len(r.token_ids)
        if mode == "ar":
            assert s["mean_accepted"] is None
            assert s["rounds"] == len(r.token_ids)
        else:
            # a 3-token request still verifies one speculation (the first round only samples)
            assert s["mean_accepted"] is not None and 0 <= s["mean_accepted"] <= max(spec.get("k", 0), spec.get("lq", 4))
        if mode == "ssd":
            # undefined (None) only for a sequence that finished in its first
            # SSD round, before any lookup
            if s["rounds"] <= 2:
                assert s["cache_hit_rate"] is None
            else:
                assert s["cache_hit_rate"] is not None and 0.0 <= s["cache_hit_rate"] <= 1.0
                if spec.get("fanout") == (0, 0, 0):
                    assert s["cache_hit_rate"] == 0.0
        else:
            assert s["cache_hit_rate"] is None
    assert max(r.stats["rounds"] for r in res) == len(recs)


def test_fuzzy_pyramid_reports_lossy(models):
    eng = engine(models, "pyramid", stage1="fuzzy", stage2="fuzzy", tau_q=0.1, tau_t=0.2, allow_lossy=True)
    try:
        res = eng.generate(PROMPTS[:2], SamplingParams(temperature=0.8, max_tokens=8, seed=1))
    finally:
        eng.close()
    assert all(r.stats["lossy"] is True for r in res)


def test_ssd_rounds_record_the_budget_they_spent(models):
    """An auto fan-out spends, each SSD round, a budget of 1 up to the
    ceiling; a fixed fan-out has none."""
    eng = engine(models, "ssd", k=3, fanout="auto", budget=6, backup="neural")
    try:
        _, recs = generate_run(eng, PROMPTS, ragged_params(0.0))
        decode = [r for r in eng.timeline if not r.prefill]
        assert decode and all(r.budget is not None and 1 <= r.budget <= 6 for r in decode)
    finally:
        eng.close()
    eng = engine(models, "ssd", k=2, fanout=(2, 1, 1), backup="fast")
    try:
        _, recs = generate_run(eng, PROMPTS, ragged_params(0.0))
        assert all(r.budget is None for r in recs)
    finally:
        eng.close()
