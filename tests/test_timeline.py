"""The coordinator's round timeline is bounded in bytes (issue 36): a long-running
server keeps the most recent rounds up to its bound, whatever the batch size,
and the per-record estimate it counts with stays near what a record holds."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from saguaro_ray.engine.timeline import TIMELINE_BYTES, RoundRecord, Timeline, record_bytes
from saguaro_ray.errors import ConfigError
from saguaro_ray.runtime.engine_config import EngineConfig


def _record(index: int, batch: int, auto: bool = False) -> RoundRecord:
    """A round as the loop fills one in: every span and control-plane time set."""
    t = time.perf_counter
    rec = RoundRecord(index=index, batch=batch, start=t(), end=t(), verify=(t(), t()), draft=(t(), t()), build=(t(), t()), lookup=(t(), t()))
    rec.accepted, rec.proposed, rec.modes = [i % 5 for i in range(batch)], [4] * batch, {"ssd": batch // 2, "sd": batch - batch // 2}
    rec.looked_up = [[i % 4, 4, i % 2] for i in range(batch // 2)]  # the SSD half's lookups
    rec.sent, rec.back, rec.lookup_sent, rec.lookup_back, rec.backup, rec.budget = t(), t(), t(), t(), "auto", 8
    if auto:
        rec.auto = {"chosen": {"option": "sd4", "tokens": 3.2, "seconds": 0.1}, "runner_up": {"option": "ar", "tokens": 1.0, "seconds": 0.05}, "measured": {"tokens": 3, "seconds": 0.11}}
    return rec


def test_the_timeline_keeps_the_latest_rounds_within_its_bytes():
    line = Timeline(max_bytes=100_000)
    for i in range(1000):
        line.append(_record(i, batch=1 + i % 32))
    assert line.bytes <= 100_000
    kept = list(line)
    assert len(line) == len(kept) and 40 < len(kept) < 100
    assert [r.index for r in kept] == list(range(1000 - len(kept), 1000))  # the most recent, in order
    assert line.bytes == sum(record_bytes(r) for r in kept)
    assert line.appended == 1000


def test_one_record_larger_than_the_bound_is_still_kept():
    line = Timeline(max_bytes=10)
    line.append(_record(0, batch=4))
    line.append(_record(1, batch=4))
    assert [r.index for r in line] == [1]


@pytest.mark.parametrize("batch,auto", [(1, False), (32, False), (8, True)])
def test_the_estimate_is_near_what_a_record_holds(batch, auto):
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        recs = [_record(i, batch, auto) for i in range(500)]
        held = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename")) / len(recs)
    finally:
        tracemalloc.stop()
    assert 0.9 * held <= record_bytes(recs[0]) <= 1.3 * held, (held, record_bytes(recs[0]))


def test_the_bound_is_an_engine_option():
    assert EngineConfig(target="zoo:tiny/target").timeline_bytes is None  # the default: TIMELINE_BYTES
    assert TIMELINE_BYTES == 16 * 2**20
    assert EngineConfig(target="zoo:tiny/target", timeline_bytes=2**20).timeline_bytes == 2**20
    with pytest.raises(ConfigError, match="timeline_bytes must be a positive integer"):
        EngineConfig(target="zoo:tiny/target", timeline_bytes=0)
