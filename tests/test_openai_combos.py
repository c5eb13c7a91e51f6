"""The OpenAI surface's combinations (issue 21) no other module tests together.

* A tensor-parallel target (two gloo ranks on CPU, Ray actors) under a
  grammar, penalties, a bias and logprobs at once: T = 0 tokens equal an
  unsharded engine's, logprobs within 1e-4, outputs validate.
* PyramidSD's law at T > 0 under a grammar and under penalties (chi-square
  against the enumerated masked / penalised target law), and ``auto``
  switching strategy and K every round under a grammar at T = 0 equal to AR.
* Logprobs under a grammar: processed ones are the masked law's (a masked
  token's is -9999.0 and never in a top list), raw ones the unmasked model's
  (transformers' log-softmax within 1e-4).

The helpers (laws, chi-square, grammar references, the Cycling policy) are
the other modules'; nothing is copied here.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import test_exactness_greedy
import test_logprobs
import test_penalties
import test_structured_output
import torch
from helpers import perturbed_checkpoint
from test_exactness_sampling import REJECT, assert_law, chi_square, counts_of
from test_logprobs import TOL, assert_matches, assert_same, processed_law, reference_rows
from test_penalties import LAW, LAW_PROMPT, N, N_POWER, adjust_with_the_committed_history_only, penalised_law
from test_strategy_per_sequence import Cycling
from test_structured_output import (
    BOUNDED_PERSON, FORMATS, JSON_OBJECT, LAW_M, LAW_N, LAW_SEED, MAX_TOKENS, PROMPTS, allowed, check_output, grammar_law, structured,
)  # fmt: skip

from saguaro_ray.algorithms.grammar import GrammarCompiler
from saguaro_ray.algorithms.logprobs import IMPOSSIBLE, row_logprobs, token_logprobs
from saguaro_ray.config import ResponseFormat, SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.workers.grammar_masks import GrammarMasks
from saguaro_ray.workers.logit_adjust import LogitAdjuster, RowContext
from saguaro_ray.workers.token_history import TokenHistory

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

SCHEMA = FORMATS["json_schema"]
SCHEMA_FORMAT = ResponseFormat.of(SCHEMA)
N_LOGPROBS = 5
PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.2}


# one torch thread; the structured-output tests' engine (every strategy, auto by default) and tokenizer; transformers' target
engine = test_structured_output.engine
tokenizer = test_structured_output.tokenizer
hf = test_logprobs.hf
law_models = test_penalties.law_models  # a random target whose law the penalties move a lot, and a draft near it


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


# ------------------------------------------------------------------ 1. a tensor-parallel target


def test_a_tensor_parallel_target_under_grammar_penalties_and_logprobs_equals_tp1(ray_instance, zoo_tiny, engine, tokenizer):
    """Two gloo ranks of the target (the grammar masks are built on rank 0's
    proxy) give the unsharded engine's tokens and logprobs for every prompt in
    AR, SD and SSD, raw and processed, under a schema, penalties and a bias at
    once (which change the output the schema alone gives); every output validates."""
    from saguaro_ray import Engine

    quote = tokenizer.encode(' "', add_special_tokens=False)[0]
    extra = {**PENALTIES, "logit_bias": {quote: 2.0}, "logprobs": N_LOGPROBS}
    cases = [(p, m, lp) for p in PROMPTS for m, lp in (("ar", "raw"), ("sd", "processed"), ("ssd", "raw"), ("ssd", "processed"))]
    prompts = [p for p, _, _ in cases]
    params = [structured(SCHEMA, m, logprobs_mode=lp, **extra) for _, m, lp in cases]
    want = engine.generate(prompts, params)
    assert [r.token_ids for r in want] != [r.token_ids for r in engine.generate(prompts, [structured(SCHEMA, m) for _, m, _ in cases])]
    h = Engine.launch(
        EngineConfig(
            target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), spec=SpeculationConfig(mode="auto", k=3, budget=4),
            target_tp=2, address="local", worker_cpus=0.25,
        )
    )  # fmt: skip
    try:
        ranks = h.worker_info()["target"]["ranks"]
        assert [r["tp_rank"] for r in ranks] == [0, 1]
        assert ranks[1]["rss_bytes"] > 0 and ranks[1]["pid"] != ranks[0]["pid"]  # rank 1 reports its own memory (the soak samples it)
        got = h.generate(prompts, params)
    finally:
        h.shutdown()
    for g, w, (_, m, _) in zip(got, want, cases):
        assert g.mode == m and g.token_ids == w.token_ids, m
        assert len(g.logprobs) == len(g.token_ids)
        assert_same(g.logprobs, w.logprobs)
        assert g.finish_reason == "stop", g.text
        jsonschema.validate(json.loads(g.text), BOUNDED_PERSON)
    assert any(len(g.text) > 12 for g in got)
    assert any((g.stats.get("mean_accepted") or 0) > 0 for g in got)  # proposals were accepted: rows past a proposal's first were masked


# ------------------------------------------------------------------ 2. PyramidSD's law, auto switching


def pyramid_samples(target: Path, draft: Path, qualifier: Path, prompt: list[int], params: SamplingParams, n: int) -> list:
    """``n`` seeded PyramidSD samples (lq 3, ld 2, exact stages) of ``prompt``;
    each proposal was both accepted and rejected somewhere, so the law test
    covers both paths."""
    eng = LocalEngine(
        EngineConfig(
            target=str(target), draft=str(draft), qualifier=str(qualifier), spec=SpeculationConfig(mode="pyramid", lq=3, ld=2),
            threads_per_worker=1, max_batch_size=n, max_kv_tokens=(len(prompt) + 16) * n, build_ahead=False,
        )
    )  # fmt: skip
    try:
        res = eng.generate([prompt], params, n=n)
    finally:
        eng.close()
    assert all(len(r.token_ids) == params.max_tokens and r.mode == "pyramid" and r.stats["lossy"] is False for r in res)
    accepted = [r.stats["mean_accepted"] for r in res if r.stats["mean_accepted"] is not None]
    # both paths taken: some request had a proposal rejected (mean below lq = 3), some had tokens accepted;
    # how often depends on the zoo's weights, which a fresh machine builds anew
    assert accepted and min(accepted) < 3 and max(accepted) > 0, (min(accepted, default=None), max(accepted, default=None))
    return res


GRAMMAR_LAW = SamplingParams(temperature=1.0, top_k=2, max_tokens=LAW_M, ignore_eos=True, seed=LAW_SEED, response_format=JSON_OBJECT)


@pytest.fixture(scope="module")
def grammar_prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPTS[0], add_special_tokens=False)


@pytest.fixture(scope="module")
def masked_law(zoo_tiny, tokenizer, grammar_prompt):
    return grammar_law(zoo_tiny, tokenizer, JSON_OBJECT, grammar_prompt)


def test_pyramid_under_a_grammar_keeps_the_masked_target_law(zoo_tiny, grammar_prompt, masked_law):
    res = pyramid_samples(zoo_tiny / "target", zoo_tiny / "draft", zoo_tiny / "qualifier", grammar_prompt, GRAMMAR_LAW, LAW_N)
    assert_law(res, masked_law, "pyramid lq=3 ld=2 under json_object")


def test_the_grammar_law_rejects_masks_that_miss_the_proposed_prefix(zoo_tiny, grammar_prompt, masked_law, monkeypatch):
    """The statistic's power: every worker masking a proposal's rows with the
    grammar state of the committed history alone is rejected."""
    adjust_with_the_committed_history_only(monkeypatch)
    res = pyramid_samples(zoo_tiny / "target", zoo_tiny / "draft", zoo_tiny / "qualifier", grammar_prompt, GRAMMAR_LAW, N_POWER)
    assert chi_square(counts_of(res), masked_law)[2] < REJECT


def test_pyramid_with_penalties_keeps_the_penalised_law(law_models, tmp_path):
    weak = perturbed_checkpoint(law_models["target"], tmp_path / "weak", 0.3, seed=8)  # the draft; the penalty tests' draft qualifies
    res = pyramid_samples(law_models["target"], weak, law_models["draft"], LAW_PROMPT, LAW, N)
    assert_law(res, penalised_law(law_models["target"], LAW), "pyramid lq=3 ld=2, penalties and bias on")


def test_auto_switching_every_round_under_a_grammar_equals_ar(zoo_tiny, engine, compiler):
    """Each auto sequence runs AR, SD and SSD with K = 1..3 in turn (one
    round's batch mixes them), its grammar state following every switch."""
    ar = engine.generate(PROMPTS, structured(SCHEMA, "ar", **PENALTIES))
    cyc = LocalEngine(EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), threads_per_worker=1))
    cyc.loop.assigner.policy = policy = Cycling()
    try:
        got = cyc.generate(PROMPTS, structured(SCHEMA, "auto", **PENALTIES))
    finally:
        cyc.close()
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    for r in got:
        check_output(compiler, SCHEMA, r)
    used = {m for r in got for m, n in r.stats["strategy"].items() if n}
    assert used >= {"ar", "sd", "ssd"}, used
    assert policy.rounds >= 3


# ------------------------------------------------------------------ 3. logprobs under a grammar


def masked_reference(hf, engine, compiler, prompt: str, generated: list[int]) -> torch.Tensor:
    """transformers' logits at the rows that predict ``generated``, each masked
    (-inf) by a fresh grammar state of its own prefix."""
    rows = reference_rows(hf, engine, prompt, generated).clone()
    for j in range(len(generated)):
        banned = torch.ones(rows.shape[1], dtype=torch.bool)
        banned[sorted(allowed(compiler, SCHEMA_FORMAT, generated[:j]))] = False
        rows[j, banned] = float("-inf")
    return rows


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "pyramid", "auto"])
def test_logprobs_under_a_grammar_processed_are_masked_raw_are_the_models(engine, hf, compiler, mode):
    """At T > 0: processed logprobs are the masked law's (every top entry a
    token the grammar allows; once the document is complete, EOS alone at
    0.0), raw ones transformers' unmasked log-softmax (their top lists hold
    tokens the grammar forbids)."""
    temperature, [eos] = 0.9, engine.frontend.eos_ids
    outs = {}
    for lp in ("processed", "raw"):
        params = [structured(SCHEMA, mode, temperature=temperature, seed=11 + i, ignore_eos=True, logprobs=N_LOGPROBS, logprobs_mode=lp)
                  for i in range(len(PROMPTS))]  # fmt: skip
        outs[lp] = engine.generate(PROMPTS, params)
    forbidden_in_raw_top = 0
    for prompt, p, r in zip(PROMPTS, outs["processed"], outs["raw"]):
        if mode != "auto":  # auto picks strategies by measured cost, and each draws its own (exact) samples
            assert p.token_ids == r.token_ids  # the logprobs mode changes what is reported, never what is drawn
        assert len(p.logprobs) == len(p.token_ids) == MAX_TOKENS
        masked = masked_reference(hf, engine, compiler, prompt, p.token_ids)
        assert_matches(p.logprobs, p.token_ids, processed_law(masked, temperature, 0, 1.0), N_LOGPROBS)
        for j, e in enumerate(p.logprobs):
            ok = allowed(compiler, SCHEMA_FORMAT, p.token_ids[:j])
            assert e.logprob > IMPOSSIBLE and {t for t, _ in e.top} <= ok
            if ok == {eos}:
                assert e.token == eos and e.top == [(eos, 0.0)] and e.logprob == 0.0
        assert p.token_ids[-1] == r.token_ids[-1] == eos  # the document completed inside MAX_TOKENS, the tail is EOS alone
        assert_matches(r.logprobs, r.token_ids, torch.log_softmax(reference_rows(hf, engine, prompt, r.token_ids), -1), N_LOGPROBS)
        forbidden_in_raw_top += sum(
            bool({t for t, _ in e.top} - allowed(compiler, SCHEMA_FORMAT, r.token_ids[:j])) for j, e in enumerate(r.logprobs)
        )
    assert forbidden_in_raw_top > 0  # raw is the unmasked model: the grammar did mask something the model liked


def test_a_masked_tokens_processed_logprob_is_impossible(zoo_tiny, tokenizer, compiler):
    """Through the workers' own adjuster and logprob rows: a token the grammar
    masks scores -9999.0 in ``processed`` mode (its raw logprob is finite) and
    no top list names it."""
    adjuster = LogitAdjuster(TokenHistory(), GrammarMasks(str(zoo_tiny / "target"), len(tokenizer), (tokenizer.eos_token_id,)))
    doc = tokenizer.encode(json.dumps({"name": "Ada", "age": 3, "ok": True, "kind": "a"}), add_special_tokens=False)
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0.7, response_format=SCHEMA_FORMAT, logprobs=N_LOGPROBS, logprobs_mode="processed")
    tokens = prompt + doc
    rows = [RowContext(0, params, tokens, len(prompt) + j, (), len(prompt)) for j in range(len(doc) + 1)]
    raw = torch.randn(len(rows), len(tokenizer), generator=torch.Generator().manual_seed(0))
    adjusted = adjuster.adjust(raw, rows)
    logp = row_logprobs(raw, adjusted, "processed", 0.7, 0, 1.0)
    raw_logp = row_logprobs(raw, adjusted, "raw", 0.7, 0, 1.0)
    for j in range(len(rows)):
        ok = allowed(compiler, SCHEMA_FORMAT, doc[:j])
        masked = next(t for t in range(len(tokenizer)) if t not in ok)
        [own, banned] = token_logprobs(logp[j : j + 1].expand(2, -1), [doc[j] if j < len(doc) else tokenizer.eos_token_id, masked], N_LOGPROBS)
        assert own.logprob > IMPOSSIBLE and banned.logprob == IMPOSSIBLE
        assert {t for t, _ in banned.top} <= ok and len(banned.top) == min(N_LOGPROBS, len(ok))
        [raw_banned] = token_logprobs(raw_logp[j : j + 1], [masked], N_LOGPROBS)
        assert abs(raw_banned.logprob - float(torch.log_softmax(raw[j], -1)[masked])) <= TOL
