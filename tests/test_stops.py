"""Stop strings and stop token ids, evaluated by the engine (issue 20, item 2).

In every mode at T = 0 a stop ends decoding in the round that meets it (a
few rounds, not max_tokens' worth), the text is the AR text cut before the
earliest stop string, the token ids are AR's up to the token that completed
the stop (the ones a speculative round emitted past it are dropped), and
the finish reason is "stop". Streams show the same text and never a stop
string, even one that spans chunks.
"""

from __future__ import annotations

import pytest
from engine_helpers import greedy, local_engine, settle

from saguaro_ray.config import SamplingParams
from saguaro_ray.engine.stops import StopChecker, first_stop
from saguaro_ray.errors import ConfigError
from saguaro_ray.tokenizer import load_tokenizer

PROMPT = "for i in range("  # the tiny target's text for it varies early on
MAX_TOKENS = 200
MODES = ["ar", "sd", "ssd", "pyramid"]


@pytest.fixture(scope="module")
def ar_run(zoo_tiny):
    """AR's tokens for PROMPT (no stop), and its text after each token."""
    eng = local_engine(zoo_tiny, "ar")
    try:
        [r] = eng.generate([PROMPT], greedy(MAX_TOKENS))
        tok = eng.tokenizer
        texts = [tok.decode(r.token_ids[: i + 1], skip_special_tokens=True) for i in range(len(r.token_ids))]
        return r, texts
    finally:
        eng.close()


def expected(ar_run, stops: tuple[str, ...]) -> tuple[list[int], str]:
    """AR with stops, token by token: the first token whose text holds a stop ends it."""
    r, texts = ar_run
    for i, text in enumerate(texts):
        cut = first_stop(text, stops)
        if cut is not None:
            return r.token_ids[: i + 1], text[:cut]
    raise AssertionError(f"no stop of {stops} in the AR text")


def stop_early(ar_run) -> tuple[str, ...]:
    """A stop string (two of them, overlapping) that first completes a few tokens in."""
    r, texts = ar_run
    text = texts[6]
    return (text[-3:], text[-2:])


@pytest.mark.parametrize("mode", MODES)
def test_stop_string_ends_decoding_in_the_round_that_meets_it(zoo_tiny, ar_run, mode):
    stops = stop_early(ar_run)
    want_ids, want_text = expected(ar_run, stops)
    assert len(want_ids) < 10  # the stop is early; without it AR runs MAX_TOKENS tokens
    eng = local_engine(zoo_tiny, mode)
    try:
        [r] = eng.generate([PROMPT], greedy(MAX_TOKENS, stop=stops))
        assert (r.token_ids, r.text, r.finish_reason) == (want_ids, want_text, "stop")
        assert stops[0] not in r.text and stops[1] not in r.text
        rounds = len(eng.timeline)
        assert rounds <= len(want_ids) + 1  # the prefill round plus at most one per token, not MAX_TOKENS' worth
        assert r.stats["rounds"] <= len(want_ids) + 1
        # the stream shows the same text, the stop string never
        chunks = list(eng.frontend.stream(PROMPT, greedy(MAX_TOKENS, stop=stops)))
        assert "".join(c.text for c in chunks) == want_text
        assert [t for c in chunks for t in c.token_ids] == want_ids
        assert chunks[-1].finish_reason == "stop"
        settle(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_stop_spanning_rounds_and_tokens(zoo_tiny, ar_run, mode):
    """A long stop string over several tokens (so over several AR rounds),
    beside one that never matches and a shorter one completing with it: the
    earliest-starting match wins."""
    r, texts = ar_run
    # a text from token 19 on whose last 12 characters (and last 6) occur nowhere before its end
    # and span at least three tokens: which token that is depends on the model's text, not the engine
    late = next(
        t
        for i, t in enumerate(texts)
        if i >= 19 and t.find(t[-12:]) == len(t) - 12 and t.find(t[-6:]) == len(t) - 6 and len(texts[i - 2]) > len(t) - 12
    )
    stops = ("\x00never", late[-6:], late[-12:])
    want_ids, want_text = expected(ar_run, stops)
    spanned = [i for i, t in enumerate(texts) if len(t) > len(want_text)]
    assert len(want_ids) - spanned[0] >= 3  # the match runs over at least three tokens
    assert want_text == late[:-12]
    eng = local_engine(zoo_tiny, mode)
    try:
        [got] = eng.generate([PROMPT], greedy(MAX_TOKENS, stop=stops))
        assert (got.token_ids, got.text, got.finish_reason) == (want_ids, want_text, "stop")
        chunks = list(eng.frontend.stream(PROMPT, greedy(MAX_TOKENS, stop=stops)))
        assert "".join(c.text for c in chunks) == want_text
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_stop_token_id_is_kept_and_its_text_left_out(zoo_tiny, ar_run, mode):
    r, texts = ar_run
    stop_id = r.token_ids[4]
    first = r.token_ids.index(stop_id)
    eng = local_engine(zoo_tiny, mode)
    try:
        [got] = eng.generate([PROMPT], greedy(MAX_TOKENS, stop_token_ids=(stop_id,)))
        assert got.token_ids == r.token_ids[: first + 1]
        assert got.text == (texts[first - 1] if first else "")
        assert got.finish_reason == "stop"
        assert len(eng.timeline) <= first + 2
    finally:
        eng.close()


def test_stop_checker_holds_back_a_possible_stop(zoo_tiny):
    tok = load_tokenizer(zoo_tiny / "target")
    ids = tok.encode("abc END def", add_special_tokens=False)
    checker = StopChecker(tok, ["END"], [])
    shown = ""
    for t in ids:
        if checker.accept(t):
            break
        shown += checker.release(False)
        assert "abc ".startswith(shown)  # never a character of the stop string, nor what follows it
    shown += checker.release(True)
    assert checker.stopped and shown == "abc " and checker.final_text() == "abc "


def test_first_stop_is_the_earliest_start():
    assert first_stop("hello world", ["o w", "l"]) == 2 and first_stop("abc", ["x"]) is None


def test_stop_values_are_validated():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)
    for bad in (dict(stop=[""]), dict(stop=["x"] * 17), dict(stop=["x" * 257]), dict(stop=[3]), dict(stop_token_ids=[-1]), dict(stop_token_ids=[2**64]), dict(stop_token_ids=[True])):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_stop_token_id_outside_the_vocabulary_is_refused(zoo_tiny):
    eng = local_engine(zoo_tiny, "ar")
    try:
        with pytest.raises(ConfigError, match="stop_token_ids"):
            eng.generate([PROMPT], greedy(8, stop_token_ids=(10**6,)))
    finally:
        eng.close()
