"""A killed coordinator loses no request (issue 36): the handle resumes each from what it emitted.

The coordinator is SIGKILLed mid-request (real Ray actors, real processes);
Ray restarts it, the :class:`EngineHandle` resubmits every request in flight
with the tokens it already has (``saguaro_ray.runtime.resumable``). At T = 0
the tokens, the text (stop strings cut across the seam) and the logprobs
equal an unkilled run's; at T > 0 every request completes with its full
budget; a second kill while requests resume is outlived the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import coordinator_pid, in_thread, kill_coordinator, save_tiny_checkpoint, wait_until_back, wait_until_progress

from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig

PROMPTS = [[3, 5, 7, 9], [1, 2]]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("loss"), "llama", seed=0, max_position_embeddings=512)


@pytest.fixture(scope="module", params=["ar", "ssd"])
def handle(request, ray_instance, target):
    spec = SpeculationConfig(mode=request.param, k=3, budget=4)
    h = Engine.launch(EngineConfig(target=str(target), draft=str(target), spec=spec, max_restarts=12, worker_cpus=0.5))
    try:
        yield h
    finally:
        h.shutdown()


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_a_stream_outlives_a_killed_coordinator_token_for_token(handle):
    params = greedy(logprobs=2)
    [ref] = handle.generate([PROMPTS[0]], params)
    tokens, text, logprobs, pid = [], "", [], None
    for i, chunk in enumerate(handle.stream(PROMPTS[0], params)):
        tokens += chunk.token_ids
        text += chunk.text
        logprobs += chunk.logprobs or []
        if i == 5:
            pid = kill_coordinator(handle)
    assert pid is not None and coordinator_pid(handle) != pid  # it was killed, and restarted
    assert tokens == ref.token_ids
    assert text == ref.text
    assert [lp.token for lp in logprobs] == [lp.token for lp in ref.logprobs]
    assert [[t for t, _ in lp.top] for lp in logprobs] == [[t for t, _ in lp.top] for lp in ref.logprobs]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(logprobs, ref.logprobs)) < 1e-3


def test_generate_with_several_samples_outlives_a_killed_coordinator(handle):
    ref = handle.generate(PROMPTS, greedy(), n=2)
    thread, out = in_thread(handle.generate, PROMPTS, greedy(), 2)
    wait_until_progress(handle)
    kill_coordinator(handle)
    assert thread.is_alive()  # killed mid-request
    thread.join(300)
    assert "error" not in out, out.get("error")
    got = out["value"]
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.text for r in got] == [r.text for r in ref]
    assert [r.prompt_tokens for r in got] == [len(PROMPTS[0])] * 2 + [len(PROMPTS[1])] * 2  # usage: the original prompt


def test_a_stop_string_across_the_seam_cuts_as_without_the_kill(handle):
    [free] = handle.generate([PROMPTS[0]], greedy())
    stop = free.text[len(free.text) * 3 // 4 :][:4]  # met late, after the kill
    assert stop
    params = greedy(stop=(stop,))
    [ref] = handle.generate([PROMPTS[0]], params)
    assert ref.finish_reason == "stop"
    text = ""
    for i, chunk in enumerate(handle.stream(PROMPTS[0], params)):
        text += chunk.text
        finish = chunk.finish_reason
        if i == 3:
            kill_coordinator(handle)
    assert (text, finish) == (ref.text, "stop")


def test_sampled_requests_all_complete_through_two_kills(handle):
    """T > 0: every request completes with its whole budget, through a kill
    and a second one while the requests resume."""
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    streams = [in_thread(lambda p=p: [c for c in handle.stream(p, params)]) for p in PROMPTS]
    gen = in_thread(handle.generate, PROMPTS, params, 2)
    wait_until_progress(handle)
    kill_coordinator(handle)
    wait_until_back(handle)  # and resuming
    kill_coordinator(handle)
    for thread, out in [*streams, gen]:
        thread.join(300)
        assert "error" not in out, out.get("error")
    for _, out in streams:
        chunks = out["value"]
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS
        assert chunks[-1].finish_reason == "length"
    assert [len(r.token_ids) for r in gen[1]["value"]] == [MAX_TOKENS] * 4


def test_a_seeded_sampled_stream_resumes_with_the_same_tokens(handle):
    """T > 0 with a seed: every token is the race winner under the noise of
    (seed, output position) (the drafter-invariant rule), and a resumed
    sample keeps its seed and its positions — so the kill changes nothing."""
    params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11)
    [ref] = handle.generate([PROMPTS[0]], params)
    tokens = []
    for i, chunk in enumerate(handle.stream(PROMPTS[0], params)):
        tokens += chunk.token_ids
        if i == 5:
            kill_coordinator(handle)
    assert tokens == ref.token_ids


def test_the_batch_jobs_prompts_outlive_a_killed_coordinator(handle, target, tmp_path):
    """``saguaro_ray.jobs.generate`` runs its prompts through the handle's
    ``agenerate``: prompts in flight when the coordinator dies resume, and the
    job writes every prompt's T = 0 output as an unkilled run does, no error line."""
    import asyncio
    import json
    import threading
    from types import SimpleNamespace

    from saguaro_ray.engine.frontend import Frontend
    from saguaro_ray.jobs.generate import _generate
    from saguaro_ray.model_set import ModelSet

    spec = SpeculationConfig(mode="ar")
    frontend = Frontend.for_models(ModelSet.open(str(target), modes=[spec]), spec)
    rows = [{"prompt": p} for p in [*PROMPTS, [4, 4, 2], [8]]]
    params = {i: greedy() for i in range(len(rows))}
    refs = [r.token_ids for r in handle.generate([r["prompt"] for r in rows], greedy())]
    lines: list[dict] = []
    out: dict = {}

    def job() -> None:
        try:
            out["failures"] = asyncio.run(_generate(handle, frontend, rows, params, list(range(len(rows))), SimpleNamespace(n=1, in_flight=2), lines.append))
        except BaseException as exc:  # noqa: BLE001 — handed to the test
            out["error"] = exc

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    wait_until_progress(handle)
    kill_coordinator(handle)
    assert thread.is_alive()  # killed mid-job
    thread.join(300)
    assert "error" not in out, out.get("error")
    assert out["failures"] == 0 and not [x for x in lines if "error" in x], json.dumps(lines)[:500]
    assert {x["index"]: x["token_ids"] for x in lines} == dict(enumerate(refs))
