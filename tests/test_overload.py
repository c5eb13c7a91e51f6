"""Overload control in the engine (issue 20): a bounded admission queue
(``max_queued``: past it a request is refused whole with
EngineOverloadedError) and a per-request deadline (``deadline_s``: queueing
included; past it the request is aborted with DeadlineExceededError and its
KV freed). Rounds are counted, never timed."""

from __future__ import annotations

import pytest
from engine_helpers import free_blocks, greedy, local_engine, settle

from saguaro_ray.config import SamplingParams
from saguaro_ray.errors import ConfigError, DeadlineExceededError, EngineOverloadedError

LONG = 1500


def test_a_full_admission_queue_refuses_the_whole_request(zoo_tiny):
    eng = local_engine(zoo_tiny, "ar", max_batch_size=1, max_queued=2)
    try:
        with eng.scheduler._cv:  # nothing is admitted while the queue fills
            a = eng.scheduler.submit(eng.frontend.make_sequences(["def main("], greedy(8)))
            b = eng.scheduler.submit(eng.frontend.make_sequences(["import os"], greedy(8)))
            with pytest.raises(EngineOverloadedError, match="at most 2 may wait"):
                eng.scheduler.submit(eng.frontend.make_sequences(["class Foo:"], greedy(8)))
            with pytest.raises(EngineOverloadedError):  # all or none: neither of two prompts is queued
                eng.frontend.generate(["x", "y"], greedy(8))
            assert eng.scheduler.queued == 2
        assert len(a.result()[0].output_ids) == 8 and len(b.result()[0].output_ids) == 8
        assert len(eng.generate(["class Foo:"], greedy(8))[0].token_ids) == 8  # room again
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_a_request_past_its_deadline_is_aborted(zoo_tiny, mode):
    eng = local_engine(zoo_tiny, mode, max_batch_size=1)
    try:
        settle(eng)
        baseline = free_blocks(eng)
        [late] = eng.frontend.make_sequences(["def main("], greedy(LONG, deadline_s=0.05))
        # behind a long request in a batch of one: its deadline passes while it waits. Both are
        # queued in one call, so their deadlines are one clock reading apart by none: two separate
        # submits could let the round that expires the first one fall between the two deadlines
        # and admit the second (CI saw it run two tokens)
        [waiting] = eng.frontend.make_sequences(["import os"], greedy(LONG, deadline_s=0.05))
        fut_late, fut_waiting = eng.scheduler.submit_many([[late], [waiting]])
        with pytest.raises(DeadlineExceededError, match="deadline of 0.05 s"):
            fut_late.result()
        with pytest.raises(DeadlineExceededError):
            fut_waiting.result()
        assert 0 < len(late.output_ids) < LONG
        assert waiting.output_ids == []  # never admitted
        settle(eng)
        assert free_blocks(eng) == baseline
        # a request without a deadline beside them is unaffected
        assert len(eng.generate(["class Foo:"], greedy(30))[0].token_ids) == 30
    finally:
        eng.close()


def test_deadline_and_queue_values_are_validated(zoo_tiny):
    for bad in (0, -1, float("inf"), float("nan"), True, "1", 10**9):
        with pytest.raises(ConfigError, match="deadline_s"):
            SamplingParams(deadline_s=bad)
    with pytest.raises(ConfigError, match="max_queued"):
        local_engine(zoo_tiny, "ar", max_queued=0)
