"""Isolation, cancellation, stops and abandoned streams through Ray (issue 20,
items 1 and 2), on one SSD engine over the tiny zoo.

* a value that cannot be encoded for the workers fails its own request only;
* a stream closed early, a cancelled ``astream``/``agenerate`` task and
  many more abandoned streams than the coordinator once had threads are
  aborted: the target stops decoding them (tokens verified counted on the
  timeline, never timed), the workers' KV returns to its baseline, and a
  new request still completes, exactly;
* stops end decoding in the engine;
* a seed fixes the output (issue 34).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_helpers import greedy, local_engine, poisoned, wait_until
from test_runtime import bounded

from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig
from saguaro_ray.engine.stops import first_stop
from saguaro_ray.errors import SaguaroError

LONG = 1500
PROMPTS = ["def main(", "import os", "class Foo:"]


@pytest.fixture(scope="module")
def reference(zoo_tiny):
    eng = local_engine(zoo_tiny, "ar")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def engine(ray_instance, zoo_tiny):
    h = Engine.launch(
        EngineConfig(
            target=str(zoo_tiny / "target"),
            draft=str(zoo_tiny / "draft"),
            spec=SpeculationConfig(mode="ssd", k=4, budget=8),
            # every abandoned stream of test_many_abandoned_streams_cost_nothing is admitted at once
            max_batch_size=128,
            max_kv_tokens=80_000,
        )
    )
    wait_idle(h)
    h.baseline = free_blocks(h)  # type: ignore[attr-defined]
    yield h
    h.shutdown()


def free_blocks(h) -> dict[str, int]:
    return {role: info["free_kv_blocks"] for role, info in h.worker_info().items()}


def wait_idle(h) -> None:
    """Nothing queued or running, and the workers' KV back at its baseline (releases run asynchronously)."""
    wait_until(lambda: h.metrics()["active"] == 0, "the engine to go idle")
    if hasattr(h, "baseline"):
        wait_until(lambda: free_blocks(h) == h.baseline, "every worker's KV to return to its baseline")


def verified(h, after: int) -> int:
    """Tokens the target emitted in the rounds after the first ``after``."""
    return sum(sum(a + 1 for a in r["accepted"]) for r in h.timeline()[after:])


def test_unencodable_value_fails_its_request_only(engine, reference):
    """seed = 2^64 (past SamplingParams' own check, as a value slipped through
    an edge would arrive) fails that request alone — refused by the
    coordinator's frontend (``check_samples``), or, were it to get past that,
    by the encoder for the workers — while a stream already decoding and a
    request admitted with it are exact."""
    want = [reference.generate([p], greedy(60))[0].token_ids for p in PROMPTS]

    def run() -> tuple[list[int], list[int], BaseException | None]:
        stream = engine.stream(PROMPTS[0], greedy(60))
        got_a = list(next(stream).token_ids)
        with ThreadPoolExecutor(2) as pool:
            poison = pool.submit(engine.generate, [PROMPTS[1]], poisoned(greedy(60), seed=2**64))
            b = pool.submit(engine.generate, [PROMPTS[2]], greedy(60))
            got_a += [t for chunk in stream for t in chunk.token_ids]
            return got_a, b.result()[0].token_ids, poison.exception()

    got_a, got_b, err = bounded(run)
    assert isinstance(err, SaguaroError) and ("encode" in str(err) or "seed must be" in str(err))
    assert (got_a, got_b) == (want[0], want[2])
    wait_idle(engine)


def test_closing_a_stream_early_aborts_it(engine):
    def run() -> int:
        stream = engine.stream(PROMPTS[0], greedy(LONG))
        for _ in range(3):
            next(stream)
        at_close = len(engine.timeline())
        stream.close()
        return at_close

    at_close = bounded(run)
    wait_idle(engine)
    assert verified(engine, at_close) < LONG // 10


def test_cancelling_astream_and_agenerate_aborts_them(engine):
    async def main() -> int:
        async def read_stream() -> None:
            async for _ in engine.astream(PROMPTS[1], greedy(LONG)):
                pass

        tasks = [asyncio.ensure_future(read_stream()), asyncio.ensure_future(engine.agenerate([PROMPTS[2]], greedy(LONG)))]
        start = len(engine.timeline())
        while len(engine.timeline()) < start + 3:
            await asyncio.sleep(0.01)
        at_cancel = len(engine.timeline())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return at_cancel

    at_cancel = bounded(asyncio.run, main())
    wait_idle(engine)
    assert verified(engine, at_cancel) < 2 * LONG // 10


def test_many_abandoned_streams_cost_nothing(engine, reference):
    """More streams than the coordinator once had threads (64), each read for
    one chunk and then dropped: they are aborted, and a new request still
    gets its tokens — exactly. (Before, each stream held a coordinator thread
    until its sequence finished: the 65th stream's first chunk, and any new
    request, waited for 1000-token decodes.)"""
    count, tokens = 70, 1000  # every one fits the KV and the batch at once
    want = reference.generate([PROMPTS[0]], greedy(40))[0].token_ids

    def run() -> tuple[int, list[int]]:
        streams = [engine.stream(PROMPTS[i % 3], greedy(tokens)) for i in range(count)]
        for s in streams:
            next(s)
        at_drop = len(engine.timeline())
        for s in streams:
            s.close()
        fresh = [t for chunk in engine.stream(PROMPTS[0], greedy(40)) for t in chunk.token_ids]
        return at_drop, fresh

    at_drop, fresh = bounded(run)
    assert fresh == want
    wait_idle(engine)
    # what the dropped streams still cost: a few rounds at most, not their 70 x 999 tokens
    assert verified(engine, at_drop) < count * tokens // 10


def test_stops_end_decoding_over_ray(engine, reference):
    [r] = reference.generate([PROMPTS[2]], greedy(LONG))
    texts = [reference.tokenizer.decode(r.token_ids[: i + 1], skip_special_tokens=True) for i in range(12)]
    stop = texts[8][-3:]
    end = next(i for i, t in enumerate(texts) if first_stop(t, [stop]) is not None)
    start = len(engine.timeline())
    [got] = bounded(engine.generate, [PROMPTS[2]], greedy(LONG, stop=(stop,)))
    assert (got.token_ids, got.text, got.finish_reason) == (r.token_ids[: end + 1], texts[end][: first_stop(texts[end], [stop])], "stop")
    assert len(engine.timeline()) - start <= end + 2
    chunks = bounded(lambda: list(engine.stream(PROMPTS[2], greedy(LONG, stop=(stop,)))))
    assert "".join(c.text for c in chunks) == got.text
    wait_idle(engine)


def test_a_seed_gives_ar_tokens_over_ray(engine, reference):
    """Issue 34 through the actors: a seeded request at T = 0.8, three samples
    of each prompt, decoded by SSD (hits, misses and builds ahead as the
    timing falls), gives the in-process AR engine's tokens on every repeat;
    streamed too."""
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=77)
    want = [r.token_ids for r in reference.generate(PROMPTS, params, n=3)]
    assert len({tuple(t) for t in want}) == len(want)  # each sample its own stream
    for _ in range(2):
        assert [r.token_ids for r in bounded(engine.generate, PROMPTS, params, 3)] == want
    chunks = bounded(lambda: list(engine.stream(PROMPTS[0], params)))
    assert [t for c in chunks for t in c.token_ids] == want[0]
    wait_idle(engine)


def test_abort_of_an_unknown_request_is_harmless(engine, reference):
    engine.abort("no-such-request")
    want = reference.generate([PROMPTS[1]], greedy(20))[0].token_ids
    assert bounded(engine.generate, [PROMPTS[1]], greedy(20))[0].token_ids == want


def test_a_call_ray_cancelled_with_its_caller_ends_cancelled_not_failed():
    """Ray Serve cancels a request's task when its HTTP client hangs up, and
    Ray cancels the engine calls that task made with it: the handle's
    ``astream``/``agenerate`` then ended with Ray's TaskCancelledError, which
    the replica answered as a 500 for a client that had left (the load test:
    5 of 155 hang-ups). They end cancelled, and the request is aborted."""
    import ray

    from saguaro_ray.runtime.engine import EngineHandle

    cancelled = ray.exceptions.RayTaskError("stream", "", ray.exceptions.TaskCancelledError()).as_instanceof_cause()

    async def fails() -> None:
        raise cancelled

    class Stream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            return fails()

    aborted = []
    method = lambda result: type("M", (), {"remote": staticmethod(lambda *a: result(a))})()  # noqa: E731
    coordinator = type("C", (), {})()
    coordinator.stream = method(lambda a: Stream())
    coordinator.generate_progress = method(lambda a: Stream())  # agenerate reads generate's progress stream
    coordinator.abort = method(lambda a: aborted.append(a[0]))
    handle = EngineHandle(coordinator)

    async def consume() -> None:
        async for _ in handle.astream([5, 6], SamplingParams(max_tokens=4)):
            pass

    for call in (consume, lambda: handle.agenerate([[5, 6]], SamplingParams(max_tokens=4))):
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(call())
    assert len(aborted) == 2
