"""Logprobs through the Serve app, read by the official ``openai`` client
(issue 21): completions' legacy ``logprobs: N`` shape and chat's
``logprobs: true, top_logprobs: N``, streamed and not, in the modes one
engine serves, equal to what the engine itself returns; bad values are a 400
naming the parameter. The fixtures are ``test_serve.py``'s (one engine,
attached by the app)."""

from __future__ import annotations

import pytest
import test_serve
from test_serve import MESSAGES, MODEL, PROMPT, assert_openai_error, raw_post

from saguaro_ray.config import SamplingParams, Strategy

test_serve.share_fixtures(globals())  # the Serve tests' Ray cluster, engine and app, as fixtures here too

TOL = 1e-4
MAX_TOKENS = 10


def texts(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "auto"])
def test_completion_logprobs_equal_the_engines(client, handle, tokenizer, mode):
    strategy = None if mode == "auto" else Strategy(mode)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, speculation=strategy)
    [ref] = handle.generate([PROMPT], params)
    extra = {"ignore_eos": True} | ({} if strategy is None else {"speculation": {"mode": mode}})
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3, extra_body=extra)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text == ref.text and resp.usage.completion_tokens == len(ref.token_ids)
    assert lp.tokens == texts(tokenizer, ref.token_ids)
    assert all(abs(a - b.logprob) <= TOL for a, b in zip(lp.token_logprobs, ref.logprobs, strict=True))
    for got, want in zip(lp.top_logprobs, ref.logprobs, strict=True):
        assert list(got) == texts(tokenizer, [t for t, _ in want.top])
        assert all(abs(got[k] - v) <= TOL for k, (_, v) in zip(got, want.top))
    assert lp.text_offset == [len(tokenizer.decode(ref.token_ids[:i], skip_special_tokens=True)) for i in range(len(ref.token_ids))]


def test_chat_logprobs_raw_and_processed(client, handle, tokenizer):
    raw = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "speculation": "ssd"},
    )
    content = raw.choices[0].logprobs.content
    assert len(content) == raw.usage.completion_tokens == MAX_TOKENS
    for c in content:
        assert c.bytes == list(c.token.encode("utf-8")) and c.logprob <= 0
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token and abs(c.top_logprobs[0].logprob - c.logprob) <= TOL  # greedy: the likeliest
    processed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "logprobs_mode": "processed", "speculation": {"mode": "sd", "k": 3}},
    )
    assert processed.choices[0].message.content == raw.choices[0].message.content
    assert [(c.token, c.logprob, c.top_logprobs) for c in processed.choices[0].logprobs.content] == [(c.token, 0.0, []) for c in content]


def test_streams_carry_each_chunks_logprobs(client):
    common = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0.8, seed=4, extra_body={"ignore_eos": True, "speculation": "sd"})
    whole = client.completions.create(prompt=PROMPT, logprobs=2, **common)
    pieces = [c.choices[0] for c in client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **common) if c.choices]
    got = [(t, lp, off) for p in pieces if p.logprobs for t, lp, off in zip(p.logprobs.tokens, p.logprobs.token_logprobs, p.logprobs.text_offset)]
    want = whole.choices[0].logprobs
    assert [(t, off) for t, _, off in got] == list(zip(want.tokens, want.text_offset))
    assert all(abs(a - b) <= TOL for (_, a, _), b in zip(got, want.token_logprobs, strict=True))
    chat_whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=1, **common)
    chat_pieces = [c.choices[0] for c in client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=1, stream=True, **common) if c.choices]
    streamed = [e for p in chat_pieces if p.logprobs for e in p.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in chat_whole.choices[0].logprobs.content]
    assert "".join(p.delta.content or "" for p in chat_pieces) == chat_whole.choices[0].message.content


def test_bad_logprobs_values_are_400_naming_the_param(server):
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "logprobs": 21}), 400, "logprobs")
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "logprobs": True}), 400, "logprobs")
    assert_openai_error(raw_post(server, "/v1/completions", {**base, "logprobs": 1, "logprobs_mode": "sampled"}), 400, "logprobs_mode")
    assert_openai_error(raw_post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs")
    assert_openai_error(raw_post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "top_logprobs")
    assert_openai_error(raw_post(server, "/v1/chat/completions", {**chat, "logprobs": "yes"}), 400, "logprobs")
    ok = raw_post(server, "/v1/chat/completions", {**chat, "logprobs": False}).json()
    assert ok["choices"][0]["logprobs"] is None
