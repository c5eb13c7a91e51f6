"""A killed coordinator loses no Serve request (issue 36), seen through the official ``openai`` client.

The Serve tests' app (``test_serve``'s fixtures: one engine attached by name)
answers completions while its engine's coordinator is SIGKILLed mid-request;
the replica's engine handle resumes each from what it emitted once Ray has
restarted the coordinator. At T = 0 every choice's text (streamed and not,
n > 1, AR and SSD) equals an unkilled run's and usage counts the original
prompt; at T > 0 every request completes with its whole budget.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_serve
from helpers import in_thread, kill_coordinator, wait_until_back, wait_until_progress
from test_serve import MODEL, PROMPT

test_serve.share_fixtures(globals())  # the Serve tests' Ray cluster, engine and app, as fixtures here too

MAX_TOKENS = 150


def body(mode: str, temperature: float = 0.0) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": temperature,
        "n": 2,
        "extra_body": {"ignore_eos": True, "speculation": mode},
    }


def streamed(client: Any, **kw: Any) -> tuple[list[str], list[str | None]]:
    texts, finishes = ["", ""], [None, None]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    return texts, finishes


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_completions_outlive_a_killed_coordinator(client, handle, mode):
    """One kill per mode (the shared engine's max_restarts is 2): T = 0 and
    T > 0, streamed and not, n = 2, all in flight when it dies."""
    ref = client.completions.create(**body(mode))
    plain = in_thread(lambda: client.completions.create(**body(mode)))
    stream = in_thread(lambda: streamed(client, **body(mode)))
    sampled = [in_thread(lambda: client.completions.create(**body(mode, 1.0))), in_thread(lambda: streamed(client, **body(mode, 1.0)))]
    wait_until_progress(handle)
    kill_coordinator(handle)
    assert plain[0].is_alive() and stream[0].is_alive()  # killed mid-request
    for thread, out in (plain, stream, *sampled):
        thread.join(300)
        assert "error" not in out, out.get("error")
    got = plain[1]["value"]
    assert [c.text for c in got.choices] == [c.text for c in ref.choices]
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens  # the original prompt, not prompt + emitted
    assert got.usage.completion_tokens == 2 * MAX_TOKENS
    texts, finishes = stream[1]["value"]
    assert texts == [c.text for c in ref.choices]
    assert finishes == ["length", "length"]
    # T > 0: every request completes with its whole budget
    assert sampled[0][1]["value"].usage.completion_tokens == 2 * MAX_TOKENS
    assert [c.finish_reason for c in sampled[0][1]["value"].choices] == ["length", "length"]
    assert sampled[1][1]["value"][1] == ["length", "length"]
    wait_until_back(handle)  # before the next test's requests
