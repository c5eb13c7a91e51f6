"""Abandoned requests stop decoding (issue 20, item 2), in process.

A stream generator closed early, a cancelled ``agenerate``/``astream`` task
and an explicit ``abort(request_id)`` each drop the request at the next
round boundary: at most the round in flight still runs (counted on the
timeline, not timed), every worker's KV returns to its baseline, and a
request decoding beside the aborted one keeps its exact T = 0 tokens.
Through Ray: test_engine_requests_ray.py.
"""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import free_blocks, greedy, local_engine, settle, wait_until

from saguaro_ray.errors import RequestAbortedError

LONG = 1500  # tokens a request would decode if nobody stopped it
PROMPT = "def main("


@pytest.fixture(scope="module", params=["ar", "ssd"])
def engine(request, zoo_tiny):
    eng = local_engine(zoo_tiny, request.param)
    settle(eng)
    eng.baseline = free_blocks(eng)  # type: ignore[attr-defined]
    yield eng
    eng.close()


def rounds(eng) -> int:
    return len(eng.loop.timeline)


def test_closing_a_stream_early_aborts_it(engine):
    stream = engine.stream(PROMPT, greedy(LONG))
    for _ in range(3):
        next(stream)
    at_close = rounds(engine)
    stream.close()
    settle(engine)
    assert rounds(engine) - at_close <= 1  # the round in flight, no more
    assert rounds(engine) < LONG // 10
    assert free_blocks(engine) == engine.baseline


def test_cancelling_agenerate_aborts_it(engine):
    async def main() -> int:
        task = asyncio.ensure_future(engine.agenerate([PROMPT], greedy(LONG)))
        start = rounds(engine)
        while rounds(engine) < start + 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the abort is registered before the cancellation reaches us; counted from task.cancel()
        # instead, the event loop's own latency (rounds the engine ran before the task woke)
        # would be charged to the engine
        return rounds(engine)

    at_abort = asyncio.run(main())
    settle(engine)
    assert rounds(engine) - at_abort <= 1  # the round in flight, no more
    assert rounds(engine) < LONG // 10
    assert free_blocks(engine) == engine.baseline


def test_leaving_an_astream_aborts_it(engine):
    async def main() -> int:
        seen = 0
        async for chunk in engine.astream(PROMPT, greedy(LONG)):
            seen += len(chunk.token_ids)
            if seen >= 3:
                break  # the async generator is closed when the loop ends
        return rounds(engine)

    at_break = asyncio.run(main())
    settle(engine)
    assert rounds(engine) - at_break <= 1
    assert free_blocks(engine) == engine.baseline


def test_abort_by_id_leaves_the_neighbour_exact(engine):
    want = engine.generate(["import os"], greedy(60))[0].token_ids

    async def main() -> tuple[list[int], BaseException | None]:
        doomed = asyncio.ensure_future(engine.agenerate([PROMPT, "class Foo:"], greedy(LONG), n=3, request_id="doomed"))
        neighbour = asyncio.ensure_future(engine.agenerate(["import os"], greedy(60)))
        start = rounds(engine)
        while rounds(engine) < start + 2:
            await asyncio.sleep(0.005)
        engine.abort("doomed")
        got = await neighbour
        try:
            await doomed
        except RequestAbortedError as exc:
            return got[0].token_ids, exc
        return got[0].token_ids, None

    got, err = asyncio.run(main())
    assert isinstance(err, RequestAbortedError)
    assert got == want
    settle(engine)
    assert free_blocks(engine) == engine.baseline


def test_abort_of_a_queued_request_never_admits_it(zoo_tiny):
    eng = local_engine(zoo_tiny, "ar", max_batch_size=1)
    try:
        settle(eng)
        baseline = free_blocks(eng)
        [first] = eng.frontend.make_sequences([PROMPT], greedy(200))
        [queued] = eng.frontend.make_sequences(["import os"], greedy(200))
        with eng.scheduler._cv:  # both submitted before any admission: the batch of one takes the first only
            fut_first = eng.scheduler.submit([first])
            fut_queued = eng.scheduler.submit([queued], request_id="queued")
            eng.scheduler.abort("queued")
        with pytest.raises(RequestAbortedError):
            fut_queued.result()
        assert fut_first.result()[0].finish_reason == "length"
        assert queued.output_ids == []
        wait_until(lambda: eng.scheduler.active == 0, "the engine to go idle")
        settle(eng)
        assert free_blocks(eng) == baseline
    finally:
        eng.close()
