"""The clients of the load test (:mod:`saguaro_ray.jobs.load_test`): what each
kind sends, and what it records.

Three kinds share one server. A *good* client streams ordinary requests —
both routes, every strategy the deployment allows (all on its one engine,
in one batch), mostly T = 0 (whose text must equal the
single-request reference), some seeded T > 0 — and must never see an error.
A *disconnecting* client asks for a long stream and hangs up after a few
chunks: the server must abort the work (the engine's KV comes back) without
the others noticing. A *poison* client sends the bodies that once broke other
users' requests (issue 20: integers past the wire's 64 bits, malformed JSON,
huge bodies, a non-ASCII bearer token, ...) and must get a 4xx OpenAI error
every time. Every request is one :class:`Outcome`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = ("def parse(", "import os\n", "class Stack:\n    def", "for i in range(", "# sort a list\ndef", "return {")
CHATS = ("Sort a list.", "Write a loop.", "What is a stack?")
STOP = "\n\n"


@dataclass(frozen=True)
class Spec:
    """One well-formed request: the body's fields, without ``stream``."""

    route: str  # "completions" | "chat"
    strategy: str  # the mode its `speculation` names
    text: str  # the prompt, or the user message
    max_tokens: int
    temperature: float
    seed: int | None = None
    n: int = 1
    stop: str | None = None
    ignore_eos: bool = False

    def body(self, model: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "n": self.n,
            "ignore_eos": self.ignore_eos,
            "speculation": self.strategy,
            "stream": stream,
        }
        if self.route == "chat":
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop is not None:
            body["stop"] = [self.stop]
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"


def good_specs(strategies: list[str]) -> list[Spec]:
    """The well-behaved requests: every base request with every strategy, at T = 0
    (``n`` 1 or 2: at T = 0 both samples are the reference) and seeded T > 0."""
    bases = []
    for i, text in enumerate(PROMPTS):
        bases.append(("completions", text, (8, 24, 48)[i % 3], STOP if i % 2 else None, i % 3 == 0))
    for i, text in enumerate(CHATS):
        bases.append(("chat", text, (16, 32)[i % 2], STOP if i % 2 == 0 else None, i == 1))
    specs = []
    for j, (route, text, max_tokens, stop, ignore_eos) in enumerate(bases):
        for strategy in strategies:
            specs.append(Spec(route, strategy, text, max_tokens, 0.0, n=1 + j % 2, stop=stop, ignore_eos=ignore_eos))
            specs.append(Spec(route, strategy, text, max_tokens, 0.8, seed=1000 + j, stop=stop, ignore_eos=ignore_eos))
    return specs


def disconnect_spec(rng: random.Random, strategies: list[str]) -> Spec:
    """A long stream (whoever hangs up on it leaves most of it undecoded)."""
    return Spec(
        rng.choice(("completions", "chat")),
        rng.choice(strategies),
        rng.choice(PROMPTS),
        768,
        rng.choice((0.0, 0.8)),
        seed=rng.randrange(2**31),
        n=rng.choice((1, 2)),
        ignore_eos=True,
    )


@dataclass
class Poison:
    """A body that must be refused with a 4xx OpenAI error, and leave the rest alone."""

    name: str
    path: str
    content: bytes
    headers: dict[str, str | bytes] = field(default_factory=dict)


def poisons(model: str, max_k: int, api_key: str | None, max_body_bytes: int) -> list[Poison]:
    """The issue's poison and its relatives. The non-ASCII bearer is poison
    only where the server checks keys (``api_key`` given)."""

    def completion(**fields: Any) -> bytes:
        body = {"model": model, "prompt": "def f(", "max_tokens": 8, "stream": True, **fields}
        return json.dumps(body).encode()

    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    out = [
        Poison("top_k=2**64", "/v1/completions", completion(top_k=2**64, temperature=0.8)),
        Poison("seed=2**64-1,n=2", "/v1/completions", completion(seed=2**64 - 1, n=2, temperature=0.8)),
        Poison("seed=2**64", "/v1/chat/completions", json.dumps({**chat, "seed": 2**64}).encode()),
        Poison("max_tokens=2**64", "/v1/completions", completion(max_tokens=2**64)),
        Poison("max_tokens=-1", "/v1/completions", completion(max_tokens=-1)),
        Poison("temperature=NaN", "/v1/completions", completion(temperature=float("nan"))),  # json.dumps writes NaN
        Poison("malformed JSON", "/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": "x", "max_tok'),
        Poison("body not an object", "/v1/chat/completions", b"[1, 2, 3]"),
        Poison("messages not a list", "/v1/chat/completions", json.dumps({**chat, "messages": "hi"}).encode()),
        Poison("token id out of vocab", "/v1/completions", completion(prompt=[5, 2**40])),
        Poison("K beyond max_k", "/v1/completions", completion(speculation={"mode": "sd", "k": max_k + 1})),
        Poison("unknown strategy field", "/v1/completions", completion(speculation={"engine": "ssd"})),
        Poison("unknown mode", "/v1/completions", completion(speculation="warp")),
        Poison("huge body", "/v1/completions", completion(prompt="x" * (max_body_bytes + 1024))),
    ]
    if api_key is not None:
        out.append(Poison("non-ASCII bearer", "/v1/completions", completion(), {"Authorization": "Bearer cl\u00e9-\u00fc".encode()}))
    return out


@dataclass
class Outcome:
    """One request as its client saw it."""

    kind: str  # "good" | "disconnect" | "poison"
    name: str  # the poison's name, else the route and strategy
    status: int | None = None
    error: str | None = None  # an error class, None when the request went as it should
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int | None = None
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between content chunks
    spec: Spec | None = None
    detail: str = ""
    started: float = 0.0  # time.monotonic() when it was sent and when it ended (set by the load test)
    ended: float = 0.0


def openai_error(resp_body: bytes) -> dict[str, Any] | None:
    """The ``error`` object of an OpenAI error body, or None when it is not one."""
    try:
        err = json.loads(resp_body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return err if isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) else None


async def stream_request(
    client: httpx.AsyncClient, base: str, model: str, spec: Spec, headers: dict[str, str], kind: str, hang_up_after: int | None = None
) -> Outcome:
    """Stream ``spec``; with ``hang_up_after``, close the connection after that many content chunks."""
    out = Outcome(kind, f"{spec.route}/{spec.strategy}", spec=spec)
    t0 = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", base + spec.path, json=spec.body(model, True), headers=headers) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                body = await resp.aread()
                err = openai_error(body)
                out.error = f"http {resp.status_code} {err['code'] if err else 'not-openai'}"
                out.detail = (err or {}).get("message", body[:200].decode(errors="replace"))
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"stream error {event['error'].get('code')}"
                    out.detail = event["error"].get("message", "")
                    return out
                if event.get("usage"):
                    out.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    i = choice["index"]
                    text = choice["delta"].get("content") if spec.route == "chat" else choice.get("text")
                    out.texts[i] = out.texts.get(i, "") + (text or "")
                    if choice.get("finish_reason") is not None:
                        out.finish[i] = choice["finish_reason"]
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            out.ttft_s = now - t0
                        else:
                            out.gaps_s.append(now - last)
                        last = now
                        chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return out  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.error = f"transport {type(exc).__name__}"
        out.detail = str(exc)[:200]
    if out.error is None and hang_up_after is None and len(out.finish) < spec.n:
        out.error = "stream ended without a finish"
    return out


async def poison_request(client: httpx.AsyncClient, base: str, poison: Poison, headers: dict[str, str]) -> Outcome:
    """Send ``poison``; anything but a 4xx OpenAI error body is an error."""
    out = Outcome("poison", poison.name)
    try:
        resp = await client.post(
            base + poison.path, content=poison.content, headers={**headers, "Content-Type": "application/json", **poison.headers}
        )
    except httpx.HTTPError as exc:
        out.error = f"transport {type(exc).__name__}"
        out.detail = str(exc)[:200]
        return out
    out.status = resp.status_code
    err = openai_error(resp.content)
    if not 400 <= resp.status_code < 500 or resp.status_code == 429 or err is None:
        out.error = f"http {resp.status_code} {'openai' if err else 'not-openai'}"
        out.detail = resp.text[:200]
    return out


async def client_loop(stop_at: float, send: Callable[[int], Any], record: Callable[[Outcome], None]) -> None:
    """Send requests one after another until ``stop_at`` (monotonic): a bounded loop."""
    i = 0
    while time.monotonic() < stop_at:
        record(await send(i))
        i += 1
        await asyncio.sleep(0)
