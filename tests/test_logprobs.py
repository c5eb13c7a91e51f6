"""Logprobs (issue 21, item 1): the target's log-probabilities of every emitted
token, read off the verification pass, exact in every mode.

One in-process engine on the tiny zoo family (target, draft, qualifier)
serves every strategy — AR, SD, SSD, PyramidSD and auto — each request naming
its own, so one batch mixes them. The reference is ``transformers`` (fp32,
loaded from the same checkpoint) run over prompt + generated tokens from
scratch: ``raw`` logprobs must equal its ``log_softmax`` at the emitted
positions within 1e-4 and the top-N its ranking (ties to the lower id);
``processed`` ones must equal the log of the law temperature, top-k and top-p
make of its logits, computed here independently of the engine's code. The
same numbers cross the wire (a Ray engine) and reach streams; a token the
engine drops takes its logprob with it. The Serve shapes are tested in
``test_serve_logprobs.py``.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from helpers import hf_logits, load_hf_model

from saguaro_ray.algorithms.logprobs import IMPOSSIBLE, TokenLogprobs, top_n
from saguaro_ray.config import SamplingParams, SpeculationConfig, Strategy
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.runtime.wire import FrameCodec
from saguaro_ray.workers.messages import Outcome

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

TOL = 1e-4
BOUNDARY = 1e-5  # a top-p cut this close to a token's preceding mass may fall on either side of it
N = 5
MAX_TOKENS = 16
PROMPTS = ["import os", "def main(", "for i in range(", "class Node:", "x = [", "return self."]
STRATEGIES = [Strategy("ar"), Strategy("sd", 3), Strategy("ssd", 3), Strategy("pyramid"), Strategy("auto"), Strategy("sd", 5)]
MODES = {"ar", "sd", "ssd", "pyramid", "auto"}


@pytest.fixture(scope="module")
def engine(zoo_tiny):
    """One engine for every strategy (auto by default)."""
    eng = LocalEngine(
        EngineConfig(
            target=str(zoo_tiny / "target"),
            draft=str(zoo_tiny / "draft"),
            qualifier=str(zoo_tiny / "qualifier"),
            spec=SpeculationConfig(mode="auto", k=3, budget=4),
            threads_per_worker=1,
        )
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf(zoo_tiny):
    return load_hf_model(zoo_tiny / "target")


def reference_rows(hf, engine, prompt: str, generated: list[int]) -> torch.Tensor:
    """transformers' logits of the rows that predict ``generated``: ``[len(generated), V]``."""
    ids = engine.frontend.encode(prompt)
    return hf_logits(hf, ids + generated)[len(ids) - 1 : len(ids) - 1 + len(generated)]


def processed_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, slack: float = 0.0) -> torch.Tensor:
    """log p of the processed law, row by row: temperature, the top_k highest
    (ties to the lower id), then the smallest prefix of them holding top_p
    (a token is kept while the mass ranked before it is below top_p + ``slack``)."""
    out = torch.full_like(logits, float("-inf"))
    for r, row in enumerate(logits.double() / temperature):
        order = sorted(range(len(row)), key=lambda t: (-float(row[t]), t))
        kept = order[:top_k] if top_k else order
        probs = torch.softmax(row[kept], dim=-1)
        mass, keep = 0.0, []
        for t, pr in zip(kept, probs.tolist()):
            if mass >= top_p + slack:
                break
            keep.append(t)
            mass += pr
        out[r, keep] = torch.log_softmax(row[keep], dim=-1).to(out)
    return out


def processed_laws(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[torch.Tensor]:
    """The processed law, and the laws a top-p boundary within BOUNDARY of the
    mass ranked before a token allows: there the reference (float64, from
    scratch) and the engine (float32, batched) may each keep or drop that
    token — both are the law within rounding. A row passes matching any."""
    return [processed_law(logits, temperature, top_k, top_p, slack) for slack in (0.0, -BOUNDARY, BOUNDARY)]


def _assert_row(e: TokenLogprobs, row: torch.Tensor, n: int) -> None:
    want = float(row[e.token])
    assert abs(e.logprob - (want if want > float("-inf") else IMPOSSIBLE)) <= TOL
    possible = int(torch.isfinite(row).sum())
    assert len(e.top) == min(n, possible)
    vals = torch.sort(row, descending=True, stable=True)
    for (t, v), rv in zip(e.top, vals.values[: len(e.top)].tolist()):
        assert abs(v - rv) <= TOL and abs(v - float(row[t])) <= TOL
    ids = [t for t, _ in e.top]
    gaps = vals.values[: len(e.top) + 1].diff().abs()
    if len(ids) and bool((gaps > TOL).all()):
        assert ids == vals.indices[: len(ids)].tolist()


def assert_matches(entries: list[TokenLogprobs], tokens: list[int], ref: torch.Tensor | list[torch.Tensor], n: int) -> None:
    """``entries`` score ``tokens`` as ``ref`` (log-probabilities, -inf for
    impossible tokens) does: each token's value, and a top-n list of the
    likeliest possible tokens in order — ids as ``ref``'s ranking (lower id
    first among ties) wherever no two candidates are within TOL. With a list
    of references (:func:`processed_laws`) each row must match one of them."""
    assert [e.token for e in entries] == tokens
    refs = [ref] if isinstance(ref, torch.Tensor) else ref
    for j, e in enumerate(entries):
        failures = []
        for r in refs:
            try:
                _assert_row(e, r[j], n)
                break
            except AssertionError as err:
                failures.append(err)
        else:
            raise failures[0]


def assert_same(got: list[TokenLogprobs], want: list[TokenLogprobs]) -> None:
    """The same tokens and alternatives, values within TOL (a batch of another
    shape sums in another order)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.token == b.token and abs(a.logprob - b.logprob) <= TOL
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) <= TOL for (_, x), (_, y) in zip(a.top, b.top))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_raw_logprobs_equal_transformers_in_every_mode(engine, hf, temperature):
    """Raw logprobs do not depend on the sampling settings: at T = 0 and
    T > 0, in every mode of one mixed batch, they are the target's log-softmax."""
    params = [
        SamplingParams(temperature=temperature, top_k=40, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7 + i, logprobs=N, speculation=s)
        for i, s in enumerate(STRATEGIES)
    ]
    results = engine.generate(PROMPTS, params)
    assert {r.mode for r in results} == MODES
    for prompt, r in zip(PROMPTS, results):
        assert len(r.logprobs) == len(r.token_ids) == MAX_TOKENS
        assert_matches(r.logprobs, r.token_ids, torch.log_softmax(reference_rows(hf, engine, prompt, r.token_ids), -1), N)
    if temperature == 0:  # speculation accepted something, so rows past the first of a proposal were read
        assert any((r.stats.get("mean_accepted") or 0) > 0 for r in results)


def test_processed_logprobs_are_the_law_sampled_from(engine, hf):
    """``processed`` at T > 0: the log of the temperature / top-k / top-p law
    of the target's logits; every emitted token is possible under it."""
    temperature, top_k, top_p = 0.8, 12, 0.9
    params = [
        SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3 + i,
            logprobs=N, logprobs_mode="processed", speculation=s,
        )
        for i, s in enumerate(STRATEGIES)
    ]
    for prompt, r in zip(PROMPTS, engine.generate(PROMPTS, params)):
        laws = processed_laws(reference_rows(hf, engine, prompt, r.token_ids), temperature, top_k, top_p)
        assert_matches(r.logprobs, r.token_ids, laws, N)
        assert all(e.logprob > IMPOSSIBLE for e in r.logprobs)


def adjusted_by_hand(logits: torch.Tensor, prompt_ids: list[int], generated: list[int], params: SamplingParams) -> torch.Tensor:
    """Row j of ``logits`` with the penalties and bias of its history
    (prompt + ``generated[:j]``) applied as OpenAI / Hugging Face define them:
    repetition over the whole history, presence and frequency over the
    generated tokens, then the bias."""
    out = logits.clone()
    for j, row in enumerate(out):
        r = params.repetition_penalty
        for t in set(prompt_ids + generated[:j]):
            row[t] = row[t] / r if row[t] > 0 else row[t] * r
        for t, c in Counter(generated[:j]).items():
            row[t] -= params.frequency_penalty * c + params.presence_penalty
        for t, b in params.logit_bias:
            row[t] += b
    return out


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_raw_logprobs_ignore_penalties_and_bias_processed_ones_include_them(engine, hf, mode):
    """With penalties and a logit bias on, ``raw`` is still the model's
    log-softmax; ``processed`` is the law of the adjusted logits."""
    favoured = engine.frontend.encode(" ")[0]
    params = [
        SamplingParams(
            temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=21 + i, logprobs=N, logprobs_mode=mode, speculation=s,
            presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={favoured: 2.5},
        )
        for i, s in enumerate(STRATEGIES)
    ]
    for prompt, p, r in zip(PROMPTS, params, engine.generate(PROMPTS, params)):
        logits = reference_rows(hf, engine, prompt, r.token_ids)
        if mode == "raw":
            ref = torch.log_softmax(logits, -1)
        else:
            ref = processed_laws(adjusted_by_hand(logits, engine.frontend.encode(prompt), r.token_ids, p), p.temperature, 0, p.top_p)
        assert_matches(r.logprobs, r.token_ids, ref, N)


def test_processed_logprobs_at_temperature_zero_are_one_hot(engine):
    """At T = 0 the law is a point mass: the token has logprob 0 and is its
    only possible alternative, in every mode."""
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, logprobs_mode="processed", speculation=s) for s in STRATEGIES]
    for r in engine.generate(PROMPTS, params):
        assert [(e.logprob, e.top) for e in r.logprobs] == [(0.0, [(t, 0.0)]) for t in r.token_ids]


def test_logprobs_zero_gives_the_tokens_own_and_none_gives_nothing(engine):
    both = engine.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=6, logprobs=0), SamplingParams(temperature=0, max_tokens=6)])
    assert [e.top for e in both[0].logprobs] == [[]] * len(both[0].token_ids)
    assert both[1].logprobs is None and both[1].to_json()["logprobs"] is None
    assert both[0].to_json()["logprobs"][0]["token"] == both[0].token_ids[0]


def test_a_dropped_token_drops_its_logprob(engine):
    """Stops cut inside a round: past a stop string, a stop token id or
    max_tokens nothing is kept, the logprobs of what is kept are unchanged."""
    base = dict(temperature=0, ignore_eos=True, logprobs=2, speculation=Strategy("sd", 5))
    [full] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, **base))
    stop_id = full.token_ids[5]
    cut = [
        SamplingParams(max_tokens=7, **base),
        SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop_id,), **base),
        SamplingParams(max_tokens=MAX_TOKENS, stop=(full.text[4:6],), **base),
    ]
    for r in engine.generate([PROMPTS[0]] * 3, cut):
        assert len(r.token_ids) < len(full.token_ids)
        assert r.token_ids == full.token_ids[: len(r.token_ids)]
        assert_same(r.logprobs, full.logprobs[: len(r.token_ids)])


def test_stream_chunks_carry_their_tokens_logprobs(engine):
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, speculation=Strategy("ssd", 3))
    [whole] = engine.generate([PROMPTS[1]], params)
    chunks = list(engine.stream(PROMPTS[1], params))
    for c in chunks:
        assert len(c.logprobs or []) == len(c.token_ids)
    assert_same([e for c in chunks for e in c.logprobs or []], whole.logprobs)


def test_top_n_ranks_ties_to_the_lower_id_and_leaves_out_impossible_tokens():
    rows = torch.tensor([[0.0, 2.0, float("-inf"), 2.0, 1.0, 2.0], [3.0, 2.0, 2.0, 1.0, 0.0, 2.5]]).log_softmax(-1)
    ids = lambda n: [[t for t, _ in row] for row in top_n(rows, n)]  # noqa: E731
    assert ids(2) == [[1, 3], [0, 5]]
    assert ids(3) == [[1, 3, 5], [0, 5, 1]]
    assert ids(4) == [[1, 3, 5, 4], [0, 5, 1, 2]]
    assert ids(10) == [[1, 3, 5, 4, 0], [0, 5, 1, 2, 3, 4]]
    assert top_n(rows, 0) == [[], []]
    one_hot = torch.tensor([[float("-inf"), 0.0, float("-inf")]])
    assert top_n(one_hot, 2) == [[(1, 0.0)]]


def test_outcome_logprobs_cross_the_wire():
    codec = FrameCodec(os.urandom(32))
    o = Outcome(3, 1, 7, 2, [TokenLogprobs(5, -0.5, [(5, -0.5), (9, -1.25)]), TokenLogprobs(7, IMPOSSIBLE, [])])
    assert codec.decode(codec.encode([o])) == [o]


def test_a_ray_engine_returns_the_same_logprobs(ray_instance, zoo_tiny, engine):
    """Outcomes with logprobs travel from the target actor to the coordinator,
    and results and streams from it to the caller, unchanged."""
    from saguaro_ray import Engine

    params = [
        SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=4, logprobs_mode=m, speculation=s)
        for m, s in (("raw", Strategy("ssd", 3)), ("processed", Strategy("sd", 3)))
    ]
    want = engine.generate(PROMPTS[:2], params)
    h = Engine.launch(
        EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), spec=SpeculationConfig(mode="auto", k=3, budget=4), worker_cpus=0.25)
    )
    try:
        got = h.generate(PROMPTS[:2], params)
        chunks = list(h.stream(PROMPTS[0], params[0]))
    finally:
        h.shutdown()
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert_same(g.logprobs, w.logprobs)
    assert_same([e for c in chunks for e in c.logprobs or []], got[0].logprobs)


def test_cli_prints_them_and_refuses_bad_values_in_one_line(zoo_tiny):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "saguaro_ray", "generate", "--in-process", "--target", str(zoo_tiny / "target"), "--prompt", PROMPTS[0]]
    run = lambda *flags: subprocess.run([*base, *flags], capture_output=True, text=True, timeout=300)  # noqa: E731
    out = run("--json", "--temperature", "0", "--max-tokens", "4", "--logprobs", "2", "--logprobs-mode", "processed")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert [(e["token"], e["logprob"], e["top"]) for e in row["logprobs"]] == [(t, 0.0, [[t, 0.0]]) for t in row["token_ids"]]
    text = run("--temperature", "0", "--max-tokens", "3", "--logprobs", "1")
    assert text.returncode == 0 and text.stdout.count(" logprob ") == 3
    bad = run("--logprobs", "21")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "logprobs" in bad.stderr


def test_bench_requests_ask_for_logprobs():
    from saguaro_ray.bench.plan import sampling_settings, temperature_settings
    from saguaro_ray.bench.run import request_params

    [setting] = temperature_settings([0.0], None)
    on, off = sampling_settings([{"logprobs": 5, "logprobs_mode": "processed"}, {}])
    assert {(p.logprobs, p.logprobs_mode) for p in request_params(3, setting, 8, 0, None, on)} == {(5, "processed")}
    assert {p.logprobs for p in request_params(3, setting, 8, 0, None, off)} == {None}
