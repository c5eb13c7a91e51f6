"""One request's failure is its own (issue 20, item 1).

A worker that refuses one sequence — at its admission, or in a later round,
while other requests decode beside it — fails that request alone: the
others finish with exactly their single-request T = 0 tokens, and every
worker's KV returns to where it started. Through Ray the poison is a value
that cannot be encoded for the workers (see test_engine_requests_ray.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import free_blocks, greedy, local_engine, settle

from saguaro_ray.engine.sequence import SequenceState

PROMPTS = ["def main(", "import os", "class Foo:"]
MAX_TOKENS = 40


class Refused(RuntimeError):
    """What the faulty worker raises for the poisoned sequence."""


def refuse(engine: Any, method: str, seq_id: int, from_pos: int) -> None:
    """Make the target's ``method`` fail for any batch holding ``seq_id`` once
    that sequence has emitted ``from_pos`` tokens (0: at its prefill)."""
    logic = engine.workers["target"].logic
    real = getattr(logic, method)

    def faulty(items: list) -> Any:
        if any(it.step.seq_id == seq_id and it.step.output_pos >= from_pos for it in items):
            raise Refused(f"sequence {seq_id} refused")
        return real(items)

    setattr(logic, method, faulty)


@pytest.mark.parametrize("mode,from_pos", [("ar", 0), ("ar", 3), ("ssd", 0), ("ssd", 3), ("pyramid", 3)])
def test_a_refused_sequence_fails_alone(zoo_tiny, mode, from_pos):
    eng = local_engine(zoo_tiny, mode)
    try:
        want = [eng.generate([p], greedy(MAX_TOKENS))[0].token_ids for p in PROMPTS]
        settle(eng)
        baseline = free_blocks(eng)
        [bad] = eng.frontend.make_sequences([PROMPTS[1]], greedy(MAX_TOKENS))
        refuse(eng, "verify", bad.seq_id, from_pos)
        stream = eng.frontend.stream(PROMPTS[0], greedy(MAX_TOKENS))
        first = next(stream)  # A is running
        # the poison and B arrive together, so that they share an admission round
        with eng.scheduler._cv:
            poison = eng.scheduler.submit([bad])
            [b] = eng.frontend.make_sequences([PROMPTS[2]], greedy(MAX_TOKENS))
            fut_b = eng.scheduler.submit([b])
        got_a = first.token_ids + [t for chunk in stream for t in chunk.token_ids]
        with pytest.raises(Refused):
            poison.result()
        got_b: list[SequenceState] = fut_b.result()
        assert got_a == want[0]
        assert got_b[0].output_ids == want[2]
        assert len(bad.output_ids) < MAX_TOKENS if from_pos else bad.output_ids == []  # it never ran on
        settle(eng)
        assert free_blocks(eng) == baseline
        # the engine keeps serving: a fresh request is exact
        assert eng.generate([PROMPTS[0]], greedy(MAX_TOKENS))[0].token_ids == want[0]
    finally:
        eng.close()


def test_one_sample_refused_fails_its_whole_request_only(zoo_tiny):
    """n = 3 where the worker refuses one sample: the request fails, its other
    samples leave the batch (their KV freed), a request beside it is exact."""
    eng = local_engine(zoo_tiny, "sd")
    try:
        want = eng.generate([PROMPTS[2]], greedy(MAX_TOKENS))[0].token_ids
        settle(eng)
        baseline = free_blocks(eng)
        samples = eng.frontend.make_sequences([PROMPTS[0]], greedy(MAX_TOKENS), n=3)
        refuse(eng, "verify", samples[1].seq_id, 5)
        with eng.scheduler._cv:
            fut = eng.scheduler.submit(samples)
            [other] = eng.frontend.make_sequences([PROMPTS[2]], greedy(MAX_TOKENS))
            fut_other = eng.scheduler.submit([other])
        with pytest.raises(Refused):
            fut.result()
        assert fut_other.result()[0].output_ids == want
        settle(eng)
        assert free_blocks(eng) == baseline
        assert all(len(s.output_ids) < MAX_TOKENS for s in samples)  # none decoded on to the end
    finally:
        eng.close()
