"""The OpenAI-compatible Ray Serve application, driven by the official ``openai`` client.

One local Ray instance and one Serve application serve the whole module, on
the built-in tiny model family (``zoo:tiny``; its tokenizer has a chat
template — the plain fallback is tested on a template-less tokenizer). The
application holds ONE engine, *attached by name* to an engine this module
launches itself (so the test can ask that very engine directly through its
:class:`EngineHandle` and compare), allowing several strategies: a request
names ``ar``, ``sd``, ``ssd`` or none (``auto``, the default), and every one
of them runs on that engine's one target worker. At temperature 0 each must give the handle's text
token for token (DESIGN §4, §6). API keys are on, so every client call
carries one. The pure helpers (chat template fallback, stop strings, config
validation) are tested without Ray at the bottom.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import openai
import pytest
from helpers import coordinator_pid, save_tiny_checkpoint

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.errors import ConfigError
from saguaro_ray.serve.chat import chat_prompt_ids, render_fallback
from saguaro_ray.serve.config import ServeAppConfig, parse_config

KEY = "sk-test-" + uuid.uuid4().hex[:8]
MODEL = "saguaro-test"
PROMPT = "def add(a, b):\n    return"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
TIMEOUT_S = 120.0
LONG = " ".join(f"w{i}" for i in range(3000))
# the deployment's strategies: one engine serves every one of them
SPECULATION = {"mode": "auto", "allow": ["auto", "ssd", "sd", "ar"], "k": 3, "max_k": 4, "budget": 4}


def bounded(fn: Callable[..., Any], *args: Any, timeout: float = TIMEOUT_S, **kwargs: Any) -> Any:
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args, **kwargs).result(timeout=timeout)
    finally:
        pool.shutdown(wait=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def models(zoo_tiny) -> dict[str, str]:
    """The built-in tiny family (its tokenizer carries a chat template)."""
    return {"target": str(zoo_tiny / "target"), "draft": str(zoo_tiny / "draft")}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    metrics_port = free_port()
    before = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # export metrics quickly (this instance only)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    try:
        yield {"metrics_port": metrics_port}
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = before


@pytest.fixture(scope="module")
def handle(ray_cluster, models):
    """The named engine: the Serve app attaches to it, the tests ask it directly."""
    from saguaro_ray import Engine, EngineConfig
    from saguaro_ray.serve.config import speculation_config

    name = f"serve-test-{uuid.uuid4().hex[:8]}"
    h = bounded(
        Engine.launch,
        EngineConfig(
            target=models["target"],
            draft=models["draft"],
            spec=speculation_config(SPECULATION),
            worker_cpus=0.25,
            name=name,
        ),
    )
    h.name = name
    try:
        yield h
    finally:
        h.shutdown()


@pytest.fixture(scope="module")
def server(ray_cluster, models, handle):
    from ray import serve

    from saguaro_ray.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {
            "model_name": MODEL,
            "target": models["target"],
            "draft": models["draft"],
            "speculation": SPECULATION,
            "connect": handle.name,
            "engine_options": {"worker_cpus": 0.25},
            "api_keys": [KEY],
            "max_n": 4,
            "metrics_interval_s": 1.0,
        }
    )
    bounded(serve.run, app, name="saguaro-test", route_prefix="/", blocking=False, timeout=300)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        bounded(serve.shutdown, timeout=60)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(models):
    from saguaro_ray.tokenizer import load_tokenizer

    return load_tokenizer(models["target"])


SHARED_FIXTURES = ("ray_cluster", "models", "handle", "server", "client", "tokenizer")


def share_fixtures(namespace: dict) -> None:
    """Make this module's Ray cluster, engine and Serve app fixtures of another
    test module (``share_fixtures(globals())``): pytest finds fixtures by name in
    the requesting module, and module-scoped ones are then built once per module."""
    for name in SHARED_FIXTURES:
        namespace[name] = globals()[name]


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def raw_post(server: str, path: str, body: Any = None, content: bytes | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(server + path, content=content, headers=headers, timeout=TIMEOUT_S)
    return httpx.post(server + path, json=body, headers=headers, timeout=TIMEOUT_S)


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = "?") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param, err
    return err


# ------------------------------------------------------------------ endpoints


def test_health_and_models(server, client):
    health = httpx.get(server + "/health", timeout=TIMEOUT_S)  # no key needed
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "engine": "ok", "data_plane": {"backend": "gloo", "error": None}}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    info = models.data[0].saguaro
    assert (info["default_mode"], info["allowed_modes"], info["k"], info["max_k"]) == ("auto", ["auto", "ssd", "sd", "ar"], 3, 4)
    assert info["attached"] is True and info["max_context"] == 2048


def live_worker_pids() -> set[int]:
    """The pids of every live worker actor of this Ray cluster (the GCS actor
    table: the public state API, ``ray.util.state``, needs the dashboard,
    which this cluster runs without)."""
    import ray._private.state

    workers = ("WorkerActor", "TargetLeaderActor")
    return {a["Pid"] for a in ray._private.state.actors().values() if a["State"] == "ALIVE" and a["ActorClassName"] in workers}


def test_every_strategy_runs_on_one_engine_with_one_target_worker(client, handle):
    """Requests naming ``ar``, ``sd``, ``ssd`` (an object, or the shorthand
    string) and none (``auto``) are all answered by the one engine — at
    once, so their sequences share rounds — each with the target's greedy
    text and the rounds its own strategy ran; and the whole cluster holds one
    target worker (runs before ``held`` starts an engine of its own)."""
    [ref] = handle.generate([PROMPT], greedy(12))
    asked = [("ar", {"mode": "ar"}), ("sd", {"mode": "sd", "k": 2}), ("ssd", "ssd"), ("auto", None)]
    calls = []
    with ThreadPoolExecutor(len(asked)) as pool:
        for mode, speculation in asked:
            extra = {"ignore_eos": True} | ({} if speculation is None else {"speculation": speculation})
            calls.append(pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra))
    for (mode, speculation), call in zip(asked, calls):
        resp = call.result(timeout=TIMEOUT_S)
        assert resp.choices[0].text == ref.text, speculation
        ext = resp.model_extra["saguaro"]
        assert (ext["mode"], ext["default_mode"]) == (mode, "auto"), speculation
        assert ext["k"] == {"ar": None, "sd": 2, "ssd": 3, "auto": 4}[mode]  # auto: the largest K it may pick
        assert 1 <= sum(ext["strategy"].values()) <= ext["rounds"]  # (rounds counts the prefill too)
        ran = set(ext["strategy"])
        assert ran <= {"ar", "sd", "ssd"} if mode == "auto" else ran == {mode}, ext
        if mode == "ar":
            assert ext["mean_k"] is None
        elif mode != "auto":
            assert 0 < ext["mean_k"] <= ext["k"]
    roles = {info["pid"]: role for role, info in handle.worker_info().items()}
    assert sorted(roles.values()) == ["draft0", "target"]
    assert live_worker_pids() == set(roles)  # no other worker anywhere: one target copy


def test_completion_equals_engine_output(client, handle, tokenizer):
    [ref] = handle.generate([PROMPT], greedy(16))
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True, "speculation": "ssd"})
    [choice] = resp.choices
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == ref.prompt_tokens
    assert resp.usage.completion_tokens == 16
    assert resp.usage.total_tokens == ref.prompt_tokens + 16
    ext = resp.model_extra["saguaro"]
    assert ext["mode"] == "ssd" and ext["k"] == 3 and ext["default_mode"] == "auto" and set(ext["strategy"]) == {"ssd"}
    assert ext["rounds"] >= 1 and ext["mean_accepted"] is not None and 0 <= ext["cache_hit_rate"] <= 1
    assert ext["lossy"] is False
    # another strategy, named per request, decodes the same tokens (exactness at T = 0)
    ar = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True, "speculation": {"mode": "ar"}}
    )
    assert ar.choices[0].text == ref.text
    assert ar.model_extra["saguaro"]["mode"] == "ar"
    # token-id prompts and several prompts in one request
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(ids) == ref.prompt_tokens
    both = client.completions.create(model=MODEL, prompt=[PROMPT, "x = 1"], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    refs = handle.generate([PROMPT, "x = 1"], greedy(8))
    assert [c.text for c in both.choices] == [r.text for r in refs]
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert as_ids.choices[0].text == refs[0].text


def test_chat_equals_engine_output(client, handle, tokenizer):
    assert tokenizer.chat_template  # the zoo tokenizer's own template is used
    ids = chat_prompt_ids(tokenizer, MESSAGES)
    assert tokenizer.decode(ids) == "<|system|>\nYou write Python.\n<|user|>\nSort a list.\n<|assistant|>\n"
    [ref] = handle.generate([ids], greedy(12))
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    [choice] = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 12
    assert resp.model_extra["saguaro"]["mode"] == "auto"


def test_streaming_completion_and_chat(client, handle, tokenizer):
    [ref] = handle.generate([PROMPT], greedy(20))
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2  # tokens arrive as rounds complete, not all at once
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    final_stats = text_chunks[-1].choices[0].model_extra["saguaro"]  # our stats ride on the last chunk
    assert final_stats["rounds"] >= 1 and set(final_stats) == {"rounds", "strategy", "mean_k", "mean_accepted", "cache_hit_rate", "lossy"}
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    summary = chunks[-1].model_extra["saguaro"]  # the include_usage chunk: the request's strategy, the rounds aggregated
    assert (summary["mode"], summary["k"], summary["default_mode"]) == ("auto", 4, "auto")
    assert summary["rounds"] == final_stats["rounds"] and summary["strategy"] == final_stats["strategy"]
    assert len({c.id for c in chunks}) == 1

    ids = chat_prompt_ids(tokenizer, MESSAGES)
    [cref] = handle.generate([ids], greedy(10))
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chat_chunks = list(stream)
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == cref.text
    assert chat_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chat_chunks)


def test_raw_sse_format(server):
    with httpx.stream(
        "POST", server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S,
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True},
    ) as resp:  # fmt: skip
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_client_disconnect_mid_stream(server, client):
    # the abandoned samples keep decoding in the engine for a while
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 1.0, "stream": True, "n": 2}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # one event, then hang up
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.choices[0].text is not None


def test_http_disconnect_aborts_the_engine_request(server, handle):
    """A client that hangs up mid-stream stops the decoding of its samples:
    the engine verifies a few rounds more at most (counted on its timeline),
    and every worker's KV returns to its baseline."""

    def idle() -> dict[str, int]:
        deadline = time.monotonic() + TIMEOUT_S
        while handle.metrics()["active"]:
            assert time.monotonic() < deadline, "the engine never went idle"
            time.sleep(0.05)
        return {role: info["free_kv_blocks"] for role, info in handle.worker_info().items()}

    def settled(baseline: dict[str, int]) -> bool:
        deadline = time.monotonic() + TIMEOUT_S
        while idle() != baseline:  # releases run asynchronously on the workers
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    baseline = idle()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True, "n": 2, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        at_hangup = len(handle.timeline())
    assert settled(baseline)
    after = handle.timeline()[at_hangup:]
    assert sum(sum(a + 1 for a in r["accepted"]) for r in after) < 300  # of the 2 x ~1500 tokens asked for


def test_n_samples_and_seeds(client, handle):
    # T = 0: every sample is the greedy text
    resp = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    [ref] = handle.generate([PROMPT], greedy(8))
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [ref.text] * 3
    assert resp.usage.completion_tokens == 24
    # T > 0 with a seed on the AR engine: reproducible, and streaming gives sample i seed + i too
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 10, "temperature": 1.0, "seed": 11}
    extra = {"ignore_eos": True, "speculation": {"mode": "ar"}}
    a = client.completions.create(**kw, extra_body=extra)
    b = client.completions.create(**kw, extra_body=extra)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # different seeds per sample
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(**kw, stream=True, extra_body=extra):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in a.choices]
    # a seed fixes the output in every strategy (issue 34): SD, SSD and auto give AR's samples
    for speculation in ({"mode": "sd", "k": 2}, "ssd", None):
        other = {"ignore_eos": True} | ({} if speculation is None else {"speculation": speculation})
        got = client.completions.create(**kw, extra_body=other)
        assert [c.text for c in got.choices] == [c.text for c in a.choices], speculation
    # chat n > 1, streamed: choices interleave and each ends once
    finishes: dict[int, int] = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_tokens=5, temperature=0.7, seed=3, stream=True
    ):
        for c in chunk.choices:
            if c.finish_reason:
                finishes[c.index] = finishes.get(c.index, 0) + 1
    assert finishes == {0: 1, 1: 1}


def test_stop_strings(client, handle):
    [ref] = handle.generate([PROMPT], greedy(24))
    stop = ref.text[5:7]
    cut = ref.text.index(stop)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@never@@"], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref.text[:cut]
    assert resp.choices[0].finish_reason == "stop"
    assert 0 < resp.usage.completion_tokens < 24
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True})
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ errors


def test_invalid_requests_are_400_with_openai_shape(server, client, tokenizer):
    assert len(tokenizer.encode(LONG, add_special_tokens=False)) > 2048  # beyond the zoo's context
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    err = assert_openai_error(raw_post(server, "/v1/completions", content=b'{"model": "x", "prompt": '), 400, None)
    assert "JSON" in err["message"]
    assert_openai_error(raw_post(server, "/v1/completions", content=b"[1, 2]"), 400, None)
    err = assert_openai_error(raw_post(server, "/v1/completions", {**base, "model": "gpt-4"}), 400, "model")
    assert err["code"] == "model_not_found"
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "max_tokens": 0}), 400, "max_tokens")
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "temperature": -0.5}), 400, "temperature")
    err = assert_openai_error(raw_post(server, "/v1/completions", {**base, "prompt": LONG}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    err = assert_openai_error(raw_post(server, "/v1/completions", {**base, "prompt": [5] * 2100}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    err = assert_openai_error(raw_post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    # strategies the deployment cannot run: the field is named
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "speculation": {"mode": "warp"}}), 400, "speculation.mode")
    err = assert_openai_error(raw_post(server, "/v1/completions", {**base, "speculation": {"mode": "ssd", "k": 7}}), 400, "speculation.k")
    assert "at most 4" in err["message"]  # the deployment's max_k
    err = assert_openai_error(raw_post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "speculation": "pyramid"}), 400, "speculation.mode")
    assert "qualifier" in err["message"]
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "speculation": {"mode": "ar", "k": 2}}), 400, "speculation.k")
    err = assert_openai_error(raw_post(server, "/v1/completions", {**base, "speculation": {"mode": "sd", "budget": 2}}), 400, "speculation")
    assert "unknown field" in err["message"]
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "n": 99}), 400, "n")
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "top_p": 0}), 400, "top_p")
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "logprobs": 21}), 400, "logprobs")
    assert_openai_error(raw_post(server, "/v1/completions", {"model": MODEL}), 400, "prompt")
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "stream": True, "max_tokens": -1}), 400, "max_tokens")
    assert_openai_error(raw_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
    assert_openai_error(raw_post(server, "/v1/nowhere", base), 404)
    # the official client raises its own typed error from our body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert info.value.body["param"] == "temperature"
    # nothing crashed: a valid request still works
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert httpx.get(server + "/health", timeout=TIMEOUT_S).status_code == 200


# bodies OpenAI refuses for their types or shape (they were answered 200): each a
# 400 naming the parameter as OpenAI spells it
LAX_BODIES = [
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/chat/completions", {"n": True}, "n"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [MESSAGES[0], {"role": "user", "content": None}]}, "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, "messages[0].tool_calls"),
]


def test_lax_types_and_messages_are_400_naming_the_parameter(server, client):
    bases = {
        "/v1/completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    }
    for path, fields, param in LAX_BODIES:
        err = assert_openai_error(raw_post(server, path, {**bases[path], **fields}), 400, param)
        assert param.split("[")[0].split(".")[0] in err["message"], err
    err = assert_openai_error(raw_post(server, "/v1/completions", {**bases["/v1/completions"], "stop": 5}), 400, "stop")
    assert "expected one of: str, list[str]" in err["message"]
    # the official client raises its typed error from these bodies
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)  # type: ignore[misc]
    assert info.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"n": True})
    assert info.value.body["param"] == "n"
    # what the OpenAI API accepts still runs: n: 2, stream: false, an integer
    # temperature, content as text parts, the developer role
    ok = raw_post(server, "/v1/completions", {**bases["/v1/completions"], "n": 2, "stream": False, "temperature": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "a list."}]}]
    as_parts = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4, temperature=0, stream=False)  # type: ignore[arg-type]
    as_text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Sort a list."}], max_tokens=4, temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    dev = raw_post(server, "/v1/chat/completions", {**bases["/v1/chat/completions"], "messages": [{"role": "developer", "content": "Be brief."}, MESSAGES[1]]})
    assert dev.status_code in (200, 400), dev.text  # 400 only if the template refuses the role, naming messages
    if dev.status_code == 400:
        assert dev.json()["error"]["param"] == "messages"


def test_api_keys(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    err = assert_openai_error(raw_post(server, "/v1/completions", body, key=None), 401)
    assert err["code"] == "invalid_api_key"
    assert_openai_error(raw_post(server, "/v1/completions", body, key="sk-wrong"), 401)
    assert httpx.get(server + "/v1/models", timeout=TIMEOUT_S).status_code == 401
    assert raw_post(server, "/v1/completions", body).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0).models.list()


# ------------------------------------------------------------------ isolation and overload

# request fields that used to pass validation and then fail the engine's
# admission round for every running request ("cannot encode: Integer value
# out of range" in other users' streams)
POISON = [
    ({"top_k": 2**64}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"n": 2**64}, "n"),
    ({"prompt": [PROMPT] * 3, "n": 2}, "prompt"),  # 6 samples > max_n
    ({"stop": ["x" * 5000]}, "stop"),
    ({"timeout": -1}, "timeout"),
    ({"speculation": {"mode": "ssd", "k": 2**64}}, "speculation.k"),
    ({"speculation": "pyramid"}, "speculation.mode"),
    ({"speculation": {"engine": "ssd"}}, "speculation"),
]


def open_stream(stack: ExitStack, server: str, body: dict[str, Any]) -> tuple[Iterator[str], list[str]]:
    """Start a streaming request and read its first event; returns the line
    iterator and the events read so far."""
    resp = stack.enter_context(
        httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    )
    assert resp.status_code == 200, resp.read()
    lines = resp.iter_lines()
    return lines, [next(line for line in lines if line)]


def sse_text(events: list[str]) -> str:
    """The text of choice 0 of an SSE body that ended with [DONE] and no error event."""
    data = [e.removeprefix("data: ") for e in events if e]
    assert data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_poison_next_to_running_streams_leaves_them_unchanged(server, client, handle):
    prompts = [PROMPT, "x = 1", "import os"]
    refs = handle.generate(prompts, greedy(1800))
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.5}
    strategies = [{}, {"speculation": "ar"}, {"speculation": {"mode": "sd", "k": 2}}]  # neighbours in one batch, each its own
    with ExitStack() as stack:
        streams = [
            open_stream(stack, server, {"model": MODEL, "prompt": p, "max_tokens": 1800, "temperature": 0, "ignore_eos": True, **strategy})
            for p, strategy in zip(prompts, strategies)
        ]
        for poison, param in POISON:
            for stream in (False, True):
                err = assert_openai_error(raw_post(server, "/v1/completions", {**base, **poison, "stream": stream}), 400, param)
                assert err["code"] != "EncodeError"
        chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "seed": 2**64}
        assert assert_openai_error(raw_post(server, "/v1/chat/completions", chat), 400, "seed")["code"] == "invalid_value"
        with pytest.raises(openai.BadRequestError) as info:  # the official client's view of it
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"top_k": 2**64})
        assert info.value.status_code == 400 and info.value.body["param"] == "top_k"
        for lines, events in streams:
            events += list(lines)
    assert [sse_text(events) for _, events in streams] == [r.text for r in refs]


def test_body_and_prompt_limits_refuse_before_parsing_and_tokenising(server, client, tokenizer):
    from saguaro_ray.serve.limits import max_token_bytes, prompt_byte_limit

    huge = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * 10_000_000 + b'"}'
    err = assert_openai_error(raw_post(server, "/v1/completions", content=huge), 413, None)
    assert err["code"] == "request_too_large"  # not context_length_exceeded: it was never parsed, let alone tokenised
    limit = prompt_byte_limit(max_token_bytes(tokenizer), 2048)
    assert limit + 1000 < 4 * 2**20  # under the body limit: this one is parsed, but not tokenised
    over = "x" * (limit + 1)
    err = assert_openai_error(raw_post(server, "/v1/completions", {"model": MODEL, "prompt": over, "max_tokens": 1}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "without tokenising" in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": over}], "max_tokens": 1}
    err = assert_openai_error(raw_post(server, "/v1/chat/completions", chat), 400, "messages")
    assert "without tokenising" in err["message"]
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.fixture(scope="module")
def held(ray_cluster, models, server):
    """A second application on the same Serve, attached to an AR engine this
    module launches with ``max_restarts=0``, taking at most HELD_LIMIT
    requests at once. Its coordinator can be stopped (SIGSTOP) to hold
    requests in flight for as long as a test needs — no timing involved —
    and its workers killed for good (the last test that uses it)."""
    from ray import serve

    from saguaro_ray import Engine, EngineConfig
    from saguaro_ray.serve import build_app

    name = f"held-{uuid.uuid4().hex[:8]}"
    spec = SpeculationConfig(mode="ar")
    h = bounded(Engine.launch, EngineConfig(target=models["target"], spec=spec, worker_cpus=0.25, name=name, max_restarts=0))
    app = build_app(
        {"model_name": "held", "target": models["target"], "speculation": {"mode": "ar"}, "connect": name, "max_ongoing_requests": HELD_LIMIT}
    )
    bounded(serve.run, app, name="held", route_prefix="/held", blocking=False, timeout=300)
    h.base = server + "/held"
    try:
        yield h
    finally:
        bounded(serve.delete, "held", timeout=120)
        h.shutdown()


HELD_LIMIT = 2
HELD_BODY = {"model": "held", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


@contextmanager
def coordinator_stopped(h: Any) -> Iterator[None]:
    """The engine's coordinator process frozen: every request to it waits."""
    pid = coordinator_pid(h, TIMEOUT_S)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_past_the_replica_bound_requests_get_429_with_retry_after(held):
    client = openai.OpenAI(base_url=held.base + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)
    pool = ThreadPoolExecutor(HELD_LIMIT + 1)
    try:
        with coordinator_stopped(held):
            calls = [pool.submit(client.completions.create, **HELD_BODY) for _ in range(HELD_LIMIT + 1)]
            # HELD_LIMIT of them are admitted and wait on the frozen engine; the other is refused at once
            done, waiting = wait(calls, timeout=TIMEOUT_S, return_when=FIRST_COMPLETED)
            [refused] = done
            assert len(waiting) == HELD_LIMIT
            with pytest.raises(openai.RateLimitError) as info:
                refused.result()
            assert info.value.response.headers["retry-after"] == "1"
            assert info.value.body == {"message": info.value.body["message"], "type": "requests", "param": None, "code": "rate_limit_exceeded"}
            # what is not generation still answers while the replica is full
            assert [m.id for m in client.models.list().data] == ["held"]
        # the engine resumes: the admitted ones finish, and their slots come back
        assert all(c.result(timeout=TIMEOUT_S).choices[0].finish_reason in ("length", "stop") for c in waiting)
        assert client.completions.create(**HELD_BODY).choices[0].text is not None
    finally:
        pool.shutdown(wait=False)


def test_a_request_past_its_deadline_gets_504(held):
    with coordinator_stopped(held):  # nothing can finish: the deadline decides
        for stream in (False, True):
            resp = httpx.post(held.base + "/v1/completions", json={**HELD_BODY, "timeout": 1.0, "stream": stream}, timeout=TIMEOUT_S)
            assert resp.status_code == 504, resp.text
            assert resp.json()["error"]["type"] == "server_error" and resp.json()["error"]["code"] == "timeout"
    # the abandoned requests released their slots
    for _ in range(HELD_LIMIT + 1):
        assert httpx.post(held.base + "/v1/completions", json=HELD_BODY, timeout=TIMEOUT_S).status_code == 200


def test_a_non_ascii_bearer_token_gets_401_not_500(server):
    headers = {"Authorization": "Bearer sk-ünïcode".encode()}
    resp = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": PROMPT}, headers=headers, timeout=TIMEOUT_S)
    assert_openai_error(resp, 401)
    assert resp.json()["error"]["code"] == "invalid_api_key"


def test_strategies_the_deployment_does_not_allow_are_400_naming_the_field(held):
    """The ``held`` deployment allows AR alone (no draft): ``auto`` is not
    allowed, ``sd`` has no draft to run — each a 400 naming
    ``speculation.mode``, and the deployment still serves what it allows."""
    base = held.base + "/v1/completions"
    for speculation, needle in (("auto", "not allowed by this engine; allowed: ar"), ({"mode": "sd"}, "needs a draft")):
        resp = httpx.post(base, json={**HELD_BODY, "speculation": speculation}, timeout=TIMEOUT_S)
        assert needle in assert_openai_error(resp, 400, "speculation.mode")["message"]
    ok = httpx.post(base, json={**HELD_BODY, "speculation": "ar"}, timeout=TIMEOUT_S)
    assert ok.status_code == 200 and ok.json()["saguaro"]["mode"] == "ar"


def test_a_dead_engine_answers_503_and_health_says_so(held):
    """Restarts exhausted (max_restarts=0, the target killed), then the
    coordinator killed: /health is 503 naming why, requests are 503
    ``server_error`` (they were 400 ``invalid_request_error``, /health 200).
    Runs last of the tests on ``held``: it leaves that engine dead."""
    import ray

    base = held.base
    assert httpx.get(base + "/health", timeout=TIMEOUT_S).json()["engine"] == "ok"
    assert httpx.post(base + "/v1/completions", json=HELD_BODY, timeout=TIMEOUT_S).status_code == 200
    os.kill(held.worker_info()["target"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (health := httpx.get(base + "/health", timeout=TIMEOUT_S)).status_code == 200:
        assert time.monotonic() < deadline, "/health still says ok"
        time.sleep(0.5)
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert "target gone for good" in health.json()["engine"]
    assert held.health()[0] is False
    resp = httpx.post(base + "/v1/completions", json=HELD_BODY, timeout=TIMEOUT_S)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["type"] == "server_error" and resp.json()["error"]["code"] == "engine_unavailable"
    ray.kill(held.coordinator, no_restart=True)
    health = httpx.get(base + "/health", timeout=TIMEOUT_S)
    assert health.status_code == 503 and "coordinator unreachable" in health.json()["engine"]
    assert held.health() == (False, "coordinator unreachable (ActorDiedError)")


# ------------------------------------------------------------------ metrics


def test_metrics_recorded(server, client, ray_cluster):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    for speculation in ("ar", "ssd", {"mode": "sd", "k": 2}):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"speculation": speculation})
    list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True))
    assert raw_post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}).status_code == 400
    assert raw_post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT}, key=None).status_code == 401
    snap = httpx.get(server + "/v1/saguaro/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S).json()
    for name in (
        "saguaro_serve_requests", "saguaro_serve_generated_tokens", "saguaro_serve_time_to_first_token_s",
        "saguaro_serve_inter_token_latency_s", "saguaro_serve_mean_accepted", "saguaro_serve_cache_hit_rate",
        "saguaro_serve_dropped_frames", "saguaro_serve_ongoing_requests", "saguaro_serve_rounds", "saguaro_serve_mean_k",
    ):  # fmt: skip
        assert name in snap["metrics"]
    counters = snap["counters"]
    assert counters["requests_total"] >= 4
    assert counters["generated_tokens"] > 0
    assert any(k.startswith("requests{") and "status=400" in k for k in counters)
    assert any(k.startswith("requests{") and "status=401" in k for k in counters)
    hist = snap["histograms"]
    for name in ("time_to_first_token_s", "inter_token_latency_s", "mean_accepted", "mean_k", "cache_hit_rate", "request_latency_s"):
        assert hist[name]["count"] > 0, name
    assert any(k.startswith("dropped_frames{role=") for k in snap["gauges"])
    # tagged by the request's strategy (auto: the default), not by an engine; rounds by the mode each ran
    for strategy in ("auto", "ar", "ssd", "sd"):
        assert counters[f"requests{{route=completions,strategy={strategy},status=200}}"] >= 1
    for strategy in ("ar", "ssd", "sd"):
        assert counters[f"rounds{{strategy={strategy},mode={strategy}}}"] >= 1
    assert snap["gauges"]["ongoing_requests"] == 0  # every request above released its slot

    # and Ray exports them for Prometheus (bounded wait: metrics are pushed every second here)
    url = f"http://127.0.0.1:{ray_cluster['metrics_port']}/metrics"
    wanted = ("ray_saguaro_serve_requests_total", "ray_saguaro_serve_generated_tokens_total", "ray_saguaro_serve_time_to_first_token_s")
    deadline = time.monotonic() + 60
    seen: set[str] = set()
    while time.monotonic() < deadline:
        try:
            text = httpx.get(url, timeout=10).text
            seen = {w for w in wanted if w in text}
        except httpx.HTTPError:
            pass
        if len(seen) == len(wanted):
            break
        time.sleep(1)
    assert seen == set(wanted), f"exported: {seen}"


# ------------------------------------------------------------------ helpers, no Ray


def test_fallback_chat_template():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert render_fallback(msgs) == "System: Be brief.\nUser: Hi\nAssistant: Hello\nUser: Bye\nAssistant:"


def test_tokenizer_without_template_uses_the_fallback(tmp_path):
    from saguaro_ray.tokenizer import load_tokenizer

    tok = load_tokenizer(save_tiny_checkpoint(tmp_path, "llama"))  # character-level, no chat template
    assert not getattr(tok, "chat_template", None)
    ids = chat_prompt_ids(tok, MESSAGES)
    assert tok.decode(ids) == "System: You write Python.\nUser: Sort a list.\nAssistant:"
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "hi"}], template)
    assert tok.decode(ids) == "[user]hi[assistant]"
    tok.chat_template = template
    assert chat_prompt_ids(tok, [{"role": "user", "content": "hi"}]) == ids


def test_config_validation():
    cfg = parse_config({"target": "zoo:tiny/target", "draft": "zoo:tiny/draft", "speculation": {"mode": "ssd", "allow": ["ssd", "ar"], "k": 4, "fanout": [1, 2, 2, 1, 1]}})
    assert isinstance(cfg, ServeAppConfig)
    ec = cfg.engine_config()
    assert ec.spec == SpeculationConfig(mode="ssd", allow=("ssd", "ar"), k=4, fanout=(1, 2, 2, 1, 1))  # YAML lists become its tuples
    assert ec.draft == "zoo:tiny/draft" and ec.allowed_modes == ("ssd", "ar")
    # no speculation block: auto, and every strategy the given models run; a draft no strategy runs is left out
    assert parse_config({"target": "t", "draft": "d"}).engine_config().allowed_modes == ("auto", "ar", "sd", "ssd")
    assert parse_config({"target": "t", "draft": "d", "speculation": {"mode": "ar"}}).engine_config().draft is None
    for bad_cfg, needle in (
        ({"target": "t", "speculation": {"mode": "ssd"}}, "needs a draft"),
        ({"target": "t", "draft": "d", "speculation": {"mode": "ssd", "allow": ["sd"]}}, "speculation: the default mode 'ssd' must be one of allow"),
        ({"target": "t", "speculation": {"allow": ["warp"]}}, "speculation: allow must list"),
        ({"target": "t", "speculation": {"k": 0}}, "speculation: k must be"),
        ({"target": "t", "speculation": {"k": 4, "max_k": 2}}, "speculation: max_k must be"),
        ({"target": "t", "speculation": {"mode": "ar", "name": "x"}}, r"speculation: unknown field\(s\) \['name'\]"),
        ({"target": "t", "engine_options": {"gpus": 1}}, "unknown engine option"),
        ({"target": "t", "engine_options": {"worker_cpus": -1}}, "worker_cpus"),
        ({"target": "t", "engine_options": {"target_tp": 0}}, "target_tp"),
        ({"target": "t", "engine_options": {"name": "x"}}, "unknown engine option"),
        ({"target": "t", "bogus": 1}, "bogus"),
        ({}, "target"),
    ):
        with pytest.raises(ConfigError, match=needle):
            parse_config(bad_cfg)


def test_a_config_with_engines_is_refused_naming_what_replaced_it():
    """The engine-per-mode list is gone (each entry was a target copy): one
    line says what to write instead, with nothing half-read."""
    old = {"target": "t", "draft": "d", "engines": [{"mode": "ssd", "k": 4}, {"mode": "ar"}]}
    with pytest.raises(ConfigError) as info:
        parse_config(old)
    message = str(info.value)
    assert "\n" not in message and "`engines` was replaced by `speculation`" in message and "connect" in message


def test_target_tp_is_passed_to_the_engine():
    cfg = parse_config({"target": "t", "engine_options": {"target_tp": 4, "device": "cuda"}})
    assert cfg.launch_config().target_tp == 4
    assert parse_config({"target": "t"}).launch_config().target_tp == 1


def test_api_keys_from_config_and_environment(monkeypatch):
    monkeypatch.setenv("SAGUARO_TEST_KEYS", " k2, k3 ,,")
    cfg = parse_config({"target": "t", "api_keys": ["k1"], "api_keys_env": "SAGUARO_TEST_KEYS"})
    assert cfg.resolved_api_keys() == ["k1", "k2", "k3"]
    monkeypatch.delenv("SAGUARO_TEST_KEYS")
    assert parse_config({"target": "t", "api_keys_env": "SAGUARO_TEST_KEYS"}).resolved_api_keys() == []
    assert parse_config({"target": "t"}).resolved_api_keys() == []  # off by default
