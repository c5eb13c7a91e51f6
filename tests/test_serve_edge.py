"""The HTTP edge's limits and error classes, without Ray.

What a request may carry is decided before anything is queued: every value
that reaches a worker fits the wire (64-bit integers, finite floats), a body
over the limit is refused unparsed, a prompt whose bytes prove it cannot fit
is refused untokenised, a replica past its request bound answers 429, and
engine-side failures are 5xx — never a 4xx telling the client its request was
wrong. The end-to-end versions (poison next to running streams, a dead
engine's 503s) are in ``test_serve.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from saguaro_ray.algorithms.sampling import process_logits
from saguaro_ray.config import INT64_MAX, SamplingParams, SpeculationConfig, Strategy
from saguaro_ray.engine.frontend import Frontend
from saguaro_ray.engine.strategy_menu import StrategyMenu
from saguaro_ray.engine.transport import WorkerGone
from saguaro_ray.errors import ConfigError, OutOfKVBlocksError
from saguaro_ray.runtime.wire import EncodeError, pack_payload, unpack_payload
from saguaro_ray.serve.limits import Admission, BodyLimit, check_prompt_bytes, max_token_bytes, prompt_byte_limit
from saguaro_ray.serve.protocol import APIError, CompletionRequest, api_error_from

AR_MENU = StrategyMenu.of(SpeculationConfig(mode="ar"), has_draft=False, has_qualifier=False)


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**64),  # failed to encode after admission, failing every running sequence
        ("top_k", 2**63),  # encodes (uint64) but overflows the workers' int64 tensors
        ("seed", 2**64),
        ("seed", 2**63),
        ("max_tokens", 2**64),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("top_k", True),
    ],
)
def test_values_beyond_the_wire_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"^{field} must"):
        SamplingParams(**{field: value})


def test_the_largest_accepted_values_cross_the_wire_and_sample():
    params = SamplingParams(temperature=0.7, top_k=INT64_MAX, seed=INT64_MAX - 1, max_tokens=INT64_MAX)
    params.check_samples(2)  # seeds INT64_MAX - 1 and INT64_MAX
    assert unpack_payload(pack_payload(params)) == params
    assert unpack_payload(pack_payload(INT64_MAX)) == INT64_MAX
    with pytest.raises(EncodeError):  # what the bound keeps out
        pack_payload(2**64)
    probs = process_logits(torch.randn(2, 11), [0.7, 0.7], [INT64_MAX, 3], [1.0, 1.0])
    assert torch.allclose(probs.sum(-1), torch.ones(2)) and int((probs[1] > 0).sum()) == 3


def test_seed_plus_n_must_fit():
    """Sample i uses seed + i: ``seed = 2**64 - 1, n = 2`` reached the wire as 2**64."""
    SamplingParams(seed=INT64_MAX).check_samples(1)
    with pytest.raises(ConfigError, match=r"^seed must be at most 9223372036854775806 with n=2"):
        SamplingParams(seed=INT64_MAX).check_samples(2)
    with pytest.raises(ConfigError, match="^n must"):
        SamplingParams().check_samples(0)
    frontend = Frontend(None, 32, 64, AR_MENU, None)  # the Python API refuses it too, before any work
    with pytest.raises(ConfigError, match="^seed must"):
        frontend.make_sequences([[1, 2]], SamplingParams(seed=INT64_MAX - 2, max_tokens=4), 4)
    seqs = frontend.make_sequences([[1, 2]], SamplingParams(seed=INT64_MAX - 3, max_tokens=4), 4)
    assert [s.seed for s in seqs] == [INT64_MAX - 3, INT64_MAX - 2, INT64_MAX - 1, INT64_MAX]


def test_stop_and_timeout_sizes():
    req = CompletionRequest(model="m", prompt="p", stop=["ab", "x" * 9])
    assert req.stop_list(4, 9) == ["ab", "x" * 9]
    with pytest.raises(APIError, match="at most 8 characters") as info:
        req.stop_list(4, 8)
    assert info.value.param == "stop"
    with pytest.raises(APIError, match="at most 1 sequences"):
        req.stop_list(1, 9)
    assert CompletionRequest(model="m", prompt="p").timeout_s(600) == 600
    assert CompletionRequest(model="m", prompt="p", timeout=5).timeout_s(600) == 5
    assert CompletionRequest(model="m", prompt="p", timeout=5000).timeout_s(600) == 600
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(APIError) as info:
            CompletionRequest(model="m", prompt="p", timeout=bad).timeout_s(600)
        assert info.value.param == "timeout"


def test_engine_side_failures_are_5xx():
    import ray

    from saguaro_ray.runtime.control import ControlError

    gone = api_error_from(WorkerGone("worker target died and its restarts are exhausted"))
    assert (gone.status, gone.type, gone.code) == (503, "server_error", "engine_unavailable")  # was 400
    dead = api_error_from(ray.exceptions.ActorDiedError())
    assert (dead.status, dead.type) == (503, "server_error")
    for exc in (EncodeError("cannot encode: Integer value out of range"), ControlError("x"), RuntimeError("boom")):
        err = api_error_from(exc)
        assert (err.status, err.type, err.code) == (500, "server_error", "internal_error"), exc  # EncodeError was 400
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    bad = api_error_from(ConfigError("top_k must be an integer in [0, 9223372036854775807] (0 disables it), got 1"))
    assert (bad.status, bad.type, bad.param) == (400, "invalid_request_error", "top_k")
    assert api_error_from(OutOfKVBlocksError("no block")).status == 400  # this request can never fit


def test_admission_bounds_requests_and_drains():
    adm = Admission(2)
    a, b = adm.enter(), adm.enter()
    with pytest.raises(APIError) as info:
        adm.enter()
    err = info.value
    assert (err.status, err.type, err.code, err.headers) == (429, "requests", "rate_limit_exceeded", {"Retry-After": "1"})
    a()
    a()  # idempotent: a slot is released once
    assert adm.active == 1
    c = adm.enter()
    adm.draining = True
    with pytest.raises(APIError) as info:
        adm.enter()
    assert (info.value.status, info.value.type) == (503, "server_error")
    b(), c()
    assert adm.active == 0


def test_prompt_byte_bound_never_refuses_a_prompt_that_fits(zoo_tiny):
    """The bound rests on every token covering at most ``max_token_bytes``
    bytes of text: check it on text made to tokenise badly and well."""
    from saguaro_ray.tokenizer import load_tokenizer

    tok = load_tokenizer(zoo_tiny / "target")
    per_token = max_token_bytes(tok)
    rng = random.Random(0)
    vocab = list(tok.get_vocab())
    texts = [
        " " * 5000,
        "def f(x):\n    return x\n" * 200,
        "".join(rng.choice("aé漢🙂 \n") for _ in range(3000)),
        "".join(rng.choice(vocab) for _ in range(500)),
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) * per_token >= len(text.encode("utf-8")), text[:40]
    limit = prompt_byte_limit(per_token, 2048)
    check_prompt_bytes(["x" * limit], limit, "prompt")
    with pytest.raises(APIError, match="refused without tokenising") as info:
        check_prompt_bytes(["x" * (limit - 1), "é"], limit, "messages")
    assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", "messages")


def _echo_app(limit: int, seen: list[int]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen.append(len(body))
        return {"bytes": len(body)}

    app.add_middleware(BodyLimit, limit=limit)
    return app


def test_body_limit_refuses_before_the_route_reads_it():
    seen: list[int] = []
    client = TestClient(_echo_app(1000, seen))
    assert client.post("/echo", content=b"x" * 1000).json() == {"bytes": 1000}
    big = client.post("/echo", content=b"x" * 10_000_000)  # declared by Content-Length
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large" and big.json()["error"]["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(50):
            yield b"y" * 100

    assert client.post("/echo", content=chunks()).status_code == 413
    assert seen == [1000]  # the refused bodies never reached the route


def test_prompts_are_tokenised_off_the_event_loop(zoo_tiny):
    """The tokenizer here only returns once the event loop has run something
    else meanwhile — possible only if tokenising happens on another thread
    (a 10 MB prompt tokenised on the loop held /v1/models for 15 s)."""
    import asyncio
    import threading

    from saguaro_ray.serve.openai_routes import validate_prompts
    from saguaro_ray.serve.replica import ServedEngine
    from saguaro_ray.tokenizer import load_tokenizer

    real = load_tokenizer(zoo_tiny / "target")
    working, loop_ran = threading.Event(), threading.Event()

    class WaitsForTheLoop:
        def encode(self, text: str, **kwargs) -> list[int]:
            working.set()
            assert loop_ran.wait(60), "the event loop was blocked while the tokenizer worked"
            return real.encode(text, **kwargs)

    engine = ServedEngine(handle=None, owned=False, frontend=Frontend(WaitsForTheLoop(), len(real), 2048, AR_MENU, None), prompt_bytes=10**6)

    async def main() -> list[int]:
        task = asyncio.ensure_future(validate_prompts(engine, ["def f(x):"], SamplingParams(max_tokens=4), "prompt"))
        await asyncio.to_thread(working.wait, 60)
        loop_ran.set()  # runs on the loop
        return await task

    assert asyncio.run(main()) == [len(real.encode("def f(x):", add_special_tokens=False))]


def test_a_stream_closed_while_its_events_wait_counts_as_the_client_leaving():
    """A client that hangs up while the response is being sent leaves the
    event generator suspended at a ``yield``: it is closed (GeneratorExit),
    not cancelled, and was counted as a 200 (the load test: 71 of 72 hang-ups
    seen as 499)."""
    import asyncio
    import time

    from saguaro_ray.engine.frontend import StreamChunk
    from saguaro_ray.serve.metrics import ServeMetrics
    from saguaro_ray.serve.streaming import sse_events

    metrics = ServeMetrics("edge-test")
    body = CompletionRequest(model="m", prompt="x", stream=True)
    first = (0, StreamChunk(token_ids=[7], text="a"))

    async def main() -> None:
        events = sse_events(metrics, "completions", body, Strategy("ar"), "ar", asyncio.Queue(), 1, first, [1], time.perf_counter(), time.monotonic() + 60, None)
        assert (await events.__anext__()).startswith("data: ")
        await events.aclose()  # what the response does with it once its send failed

    asyncio.run(main())
    assert metrics.snapshot()["counters"] == {"requests{route=completions,strategy=ar,status=499}": 1.0, "requests_total": 1.0}


def test_each_replica_app_answers_with_its_own_replica():
    """The HTTP app is built per replica: its error handlers count in that
    replica's metrics and its body limit and keys are that replica's (they
    were read through a class-level "current replica": the last one started)."""
    from saguaro_ray.serve.app import build_api
    from saguaro_ray.serve.auth import APIKeys
    from saguaro_ray.serve.config import parse_config
    from saguaro_ray.serve.metrics import ServeMetrics
    from saguaro_ray.serve.replica import ReplicaCore, ServedEngine

    def replica(name: str, keys: list[str], max_body_bytes: int) -> ReplicaCore:
        core = ReplicaCore()  # not started: no engine runs, the routes' checks run before any
        core.cfg = parse_config({"target": "unused", "model_name": name, "api_keys": keys, "max_body_bytes": max_body_bytes})
        core.keys = APIKeys(core.cfg)
        core.metrics = ServeMetrics(name)
        core.admission = Admission(core.cfg.max_ongoing_requests)
        core.engine = ServedEngine(handle=None, owned=True, frontend=Frontend(None, 10, 2048, AR_MENU, None), prompt_bytes=10**6)
        return core

    locked, open_ = replica("locked", ["sk-a"], 100), replica("open", [], 10**6)
    locked_client, open_client = TestClient(build_api(locked)), TestClient(build_api(open_))
    assert locked_client.get("/v1/models").status_code == 401
    assert open_client.get("/v1/models").json()["data"][0]["id"] == "open"
    assert locked_client.post("/v1/completions", content=b"x" * 200).status_code == 413  # over 100 bytes
    assert open_client.post("/v1/completions", content=b"x" * 200).status_code == 400  # parsed: not JSON
    assert locked.metrics.snapshot()["counters"] == {"requests{route=other,strategy=-,status=401}": 1.0, "requests_total": 1.0}
    assert open_.metrics.snapshot()["counters"] == {
        "requests{route=models,strategy=-,status=200}": 1.0,
        "requests{route=completions,strategy=-,status=400}": 1.0,
        "requests_total": 2.0,
    }


def test_invalid_strategies_are_400_naming_the_field_before_any_work():
    """A request's strategy is checked by the engine's own ``StrategyMenu``
    before it takes an admission slot (no engine call is made here: the
    replica has none): a mode the deployment does not allow or cannot run,
    a K past ``max_k``, a K where none applies, an unknown field — each an
    OpenAI 400 whose ``param`` names the field."""
    from saguaro_ray.serve.app import build_api
    from saguaro_ray.serve.auth import APIKeys
    from saguaro_ray.serve.config import parse_config
    from saguaro_ray.serve.metrics import ServeMetrics
    from saguaro_ray.serve.replica import ReplicaCore, ServedEngine

    core = ReplicaCore()
    core.cfg = parse_config({"target": "unused", "model_name": "m"})
    core.keys, core.metrics, core.admission = APIKeys(core.cfg), ServeMetrics("edge-strategies"), Admission(4)
    menu = StrategyMenu.of(SpeculationConfig(mode="ssd", allow=("ssd", "ar"), k=3, max_k=4), has_draft=True, has_qualifier=False)
    core.engine = ServedEngine(handle=None, owned=True, frontend=Frontend(None, 10, 2048, menu, None), prompt_bytes=10**6)
    client = TestClient(build_api(core))
    for speculation, param, needle in (
        ("sd", "speculation.mode", "'sd' is not allowed by this engine; allowed: ssd, ar"),
        ("pyramid", "speculation.mode", "needs a qualifier"),
        ("warp", "speculation.mode", "must be one of"),
        ({"mode": "ssd", "k": 5}, "speculation.k", "at most 4"),
        ({"mode": "ar", "k": 2}, "speculation.k", "does not apply"),
        ({"mode": "ssd", "budget": 2}, "speculation", "unknown field"),
        (["ssd"], "speculation", "must be a mode name or an object"),
    ):
        for route, body in (("/v1/completions", {"prompt": [1, 2]}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            resp = client.post(route, json={"model": "m", "max_tokens": 2, "speculation": speculation, **body})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert (err["param"], err["type"]) == (param, "invalid_request_error") and needle in err["message"], (speculation, err)
    assert core.admission.active == 0 and core.metrics.snapshot()["counters"]["requests_total"] == 14
