"""Presence, frequency and repetition penalties and logit bias (issue 21,
item 2), exact in every mode.

The definitions, written here independently of the engine (and checked
against transformers' processors where it has them):

* repetition penalty (Keskar et al., transformers'
  ``RepetitionPenaltyLogitsProcessor``): every token id that occurs in the
  prompt or the generated tokens has its logit divided by ``r`` when
  positive, multiplied by ``r`` otherwise;
* presence / frequency penalty (OpenAI): ``logit -= frequency * count +
  presence * (count > 0)``, counts over the generated tokens only;
* ``logit_bias``: ``logit += bias``;

applied in that order to the raw logits, before temperature, top-k and top-p,
the history of a logit row being everything before the token it predicts —
a proposal's earlier tokens included (the bug vLLM and SGLang shipped was to
count the committed tokens only).

The tests: the engine's adjuster against the reference on random rows; AR
at T = 0 under each penalty equals transformers' ``generate`` with the
reference as its logits processor, and differs from plain decoding on these
repetition-prone prompts (so every test below can fail); every mode's T = 0
tokens equal AR's under each penalty, also in a batch mixing penalised and
plain sequences of every strategy; the law at T > 0 with all of them on (SD,
SSD) by chi-square against the enumerated penalised law, with the power to
reject the plain law; a ``logit_bias`` id past the vocabulary refused at the
Frontend (Python, CLI, Serve) losing nothing for the requests running; the
Ray runtime; the Serve app through the official ``openai`` client.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from helpers import load_hf_model, perturbed_checkpoint, save_tiny_checkpoint
from test_exactness_sampling import ALPHA, REJECT, chi_square, counts_of, exact_law
import test_serve
from test_serve import MODEL, assert_openai_error, bounded, raw_post
from test_strategy_per_sequence import Cycling
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from saguaro_ray.cli import main as cli_main
from saguaro_ray.config import SamplingParams, SpeculationConfig, Strategy
from saguaro_ray.engine import LocalEngine
from saguaro_ray.errors import ConfigError
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.serve.chat import chat_prompt_ids
from saguaro_ray.workers.logit_adjust import LogitAdjuster, RowContext
from saguaro_ray.workers.token_history import TokenHistory

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

test_serve.share_fixtures(globals())  # the Serve tests' Ray cluster, engine and app, as fixtures here too

MAX_TOKENS = 24
# prompts the tiny zoo's target repeats itself on at T = 0 (a run of "d", blank lines, a recursion)
PROMPTS = ["the the the", "for i in range(10):\n    for i in range(10):\n", "def f(x):\n    return f(", "import os\nimport os\nimport"]
NEWLINE, D = 202, 71  # zoo tokens the plain outputs repeat
SETTINGS: dict[str, dict[str, Any]] = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.7},
    "repetition": {"repetition_penalty": 1.6},
    "logit_bias": {"logit_bias": {NEWLINE: -100, D: -100, 283: 2.5}},
    "all": {"presence_penalty": 0.4, "frequency_penalty": 0.6, "repetition_penalty": 1.2, "logit_bias": {NEWLINE: -3, 283: 1.5}},
}
STRATEGIES = {"sd": Strategy("sd", 3), "ssd": Strategy("ssd", 3), "pyramid": Strategy("pyramid"), "auto": Strategy("auto", 3)}


def greedy(setting: str | None = None, strategy: Strategy | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, speculation=strategy, **SETTINGS.get(setting or "", {}))


# ------------------------------------------------------------------ the reference


def reference_adjust(logits: torch.Tensor, history: list[int], prompt_len: int, p: SamplingParams) -> torch.Tensor:
    """The definitions above on one row ``[V]`` whose history is ``history``
    (prompt first, ``prompt_len`` tokens of it)."""
    out = logits.clone()
    if p.repetition_penalty != 1 and history:
        seen = torch.tensor(sorted(set(history)))
        x = out[seen]
        out[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    counts = Counter(history[prompt_len:])
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, b in p.logit_bias:
        out[t] += b
    return out


class ReferencePenalties(LogitsProcessor):
    """The reference as a transformers logits processor (one sequence, prompt of ``prompt_len``)."""

    def __init__(self, prompt_len: int, params: SamplingParams) -> None:
        self.prompt_len, self.params = prompt_len, params

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return torch.stack([reference_adjust(s, ids.tolist(), self.prompt_len, self.params) for ids, s in zip(input_ids, scores)])


def test_the_reference_repetition_penalty_is_transformers():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 40, generator=gen) * 3
    ids = torch.randint(0, 40, (3, 12), generator=gen)
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, scores.clone())
    got = torch.stack([reference_adjust(s, row.tolist(), 12, SamplingParams(repetition_penalty=1.7)) for row, s in zip(ids, scores)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def history_of(row: RowContext) -> list[int]:
    """The history a row predicts after."""
    return list(row.tokens[: row.upto]) + list(row.extra)


@pytest.mark.parametrize("seed", range(4))
def test_the_engines_penalties_are_the_reference_on_every_row(seed):
    """``apply_penalties`` through the workers' ``LogitAdjuster`` on rows as
    verification and SSD trees make them: several rows per sequence sharing
    one history list (row j after ``upto`` held ids, some inside the prompt),
    branch tokens beyond it (``extra``), sequences with other settings, one
    plain — each row equals the reference on its own history (and, with the
    repetition penalty alone, transformers' processor)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 300  # past the settings' biased ids
    rows: list[RowContext] = []
    settings = [SamplingParams(**SETTINGS[s]) for s in ("presence", "frequency", "repetition", "all")]
    settings.append(SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=0.7, logit_bias={3: 5, 299: -2}))
    settings.append(SamplingParams())  # plain: left alone
    for seq, params in enumerate(settings):
        prompt_len = int(torch.randint(1, 6, (), generator=gen))
        tokens = torch.randint(0, 12, (prompt_len + int(torch.randint(0, 10, (), generator=gen)),), generator=gen).tolist()  # repeats
        for upto in range(max(1, len(tokens) - 4), len(tokens) + 1):
            rows.append(RowContext(seq, params, tokens, upto, (), prompt_len))
        for _ in range(3):  # SSD branches after the held tokens
            extra = torch.randint(0, 16, (int(torch.randint(1, 4, (), generator=gen)),), generator=gen).tolist()
            rows.append(RowContext(seq, params, tokens, len(tokens), extra, prompt_len))
    rows.append(RowContext(99, settings[-1], [1, 2, 3], 2, (4,), 1))
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    before = logits.clone()
    got = LogitAdjuster(TokenHistory()).adjust(logits, rows)
    assert torch.equal(logits, before)  # a new tensor: the raw rows stay for raw logprobs
    for r, h in enumerate(rows):
        want = reference_adjust(logits[r], history_of(h), h.prompt_len, h.params)
        torch.testing.assert_close(got[r], want, rtol=1e-6, atol=1e-5, msg=lambda m: f"row {r} ({h}): {m}")
        if not h.params.adjusts_logits:
            assert torch.equal(got[r], logits[r])
        if h.params == settings[2]:  # repetition alone: transformers' processor on the same history
            hf = RepetitionPenaltyLogitsProcessor(h.params.repetition_penalty)(torch.tensor([history_of(h)]), logits[r : r + 1].clone())
            torch.testing.assert_close(got[r], hf[0], rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------ T = 0


@pytest.fixture(scope="module")
def zoo(zoo_tiny) -> Path:
    return zoo_tiny


@pytest.fixture(scope="module")
def ar_engine(zoo):
    eng = LocalEngine(EngineConfig(target=str(zoo / "target"), spec=SpeculationConfig(mode="ar"), threads_per_worker=1))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ar_tokens(ar_engine):
    """AR's T = 0 tokens of every prompt under every setting (None: plain)."""
    return {s: [r.token_ids for r in ar_engine.generate(PROMPTS, greedy(s))] for s in [None, *SETTINGS]}


@pytest.fixture(scope="module")
def engine(zoo):
    """One engine for every strategy (target, draft and qualifier of the tiny zoo; ``auto`` by default)."""
    eng = LocalEngine(
        EngineConfig(target=str(zoo / "target"), draft=str(zoo / "draft"), qualifier=str(zoo / "qualifier"), threads_per_worker=1)
    )
    eng.loop.assigner.policy = Cycling()  # auto sequences run AR, SD and SSD with K = 1..3 in turn
    yield eng
    eng.close()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_ar_applies_each_penalty_as_defined(zoo, ar_engine, ar_tokens, setting):
    """Penalised AR is transformers' greedy ``generate`` with the reference as
    its logits processor, and these prompts make every setting matter."""
    hf = load_hf_model(zoo / "target")
    hf.generation_config.eos_token_id = None  # ignore_eos: run MAX_TOKENS tokens
    params = greedy(setting)
    for prompt, got in zip(PROMPTS, ar_tokens[setting]):
        ids = torch.tensor([ar_engine.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                logits_processor=LogitsProcessorList([ReferencePenalties(ids.shape[1], params)]),
            )
        assert got == ref[0, ids.shape[1] :].tolist(), (setting, prompt)
    changed = sum(a != b for a, b in zip(ar_tokens[setting], ar_tokens[None]))
    assert changed >= 2, f"{setting} changed {changed} of {len(PROMPTS)} outputs"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", list(STRATEGIES))
def test_every_mode_equals_ar_under_each_penalty(engine, ar_tokens, mode, setting):
    res = engine.generate(PROMPTS, greedy(setting, STRATEGIES[mode]))
    assert [r.token_ids for r in res] == ar_tokens[setting]
    speculated = sum(n for m, n in res[0].stats["strategy"].items() if m != "ar")
    assert speculated > 0, res[0].stats["strategy"]


def test_a_batch_mixing_penalised_and_plain_sequences_of_every_strategy_equals_ar(engine, ar_tokens):
    """Every prompt under every setting and none, each with its own strategy,
    all verified together: each sequence's tokens are AR's under its own setting."""
    settings = [None, *SETTINGS]
    modes = list(STRATEGIES)
    cases = [(i, s, modes[(i + j) % len(modes)]) for j, s in enumerate(settings) for i in range(len(PROMPTS))]
    rounds_before = len(engine.timeline)
    res = engine.generate([PROMPTS[i] for i, _, _ in cases], [greedy(s, STRATEGIES[m]) for _, s, m in cases])
    for (i, s, m), r in zip(cases, res):
        assert r.token_ids == ar_tokens[s][i], (PROMPTS[i], s, m)
    mixed = [rec for rec in engine.timeline[rounds_before:] if not rec.prefill and len(rec.modes) >= 3]
    assert mixed, "no round verified sequences of three strategies at once"


def test_a_logit_bias_past_the_vocabulary_is_refused_losing_nothing(engine, ar_tokens):
    running = engine.frontend.stream(PROMPTS[0], greedy("all", STRATEGIES["ssd"]))
    first = next(running)  # a request is in the batch while the bad one arrives
    vocab = engine.frontend.vocab_size
    with pytest.raises(ConfigError, match=rf"logit_bias token ids must be in \[0, {vocab}\), got {vocab}") as e:
        engine.generate([PROMPTS[1]], SamplingParams(temperature=0, logit_bias={5: 1, vocab: 2}))
    assert "\n" not in str(e.value)
    rest = [c for c in running]
    assert first.token_ids + [t for c in rest for t in c.token_ids] == ar_tokens["all"][0]


def test_cli_flags_set_the_penalties(zoo, ar_tokens, capsys):
    argv = ["generate", "--in-process", "--target", str(zoo / "target"), "--mode", "ar", "--temperature", "0", "--ignore-eos",
            "--max-tokens", str(MAX_TOKENS), "--prompt", PROMPTS[1], "--json",
            "--presence-penalty", "0.4", "--frequency-penalty", "0.6", "--repetition-penalty", "1.2",
            "--logit-bias", json.dumps({str(NEWLINE): -3, "283": 1.5})]  # fmt: skip
    assert cli_main(argv) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert row["token_ids"] == ar_tokens["all"][1]
    assert cli_main([*argv[:-1], json.dumps({"99999": 1})]) == 2
    err = capsys.readouterr().err.strip()
    assert "logit_bias token ids must be in [0, " in err and "\n" not in err


# ------------------------------------------------------------------ T > 0: the law

LAW_PROMPT = [5, 6, 7]
M, TOP_K, N, N_POWER, SEED = 6, 2, 3000, 1500, 70_000
LAW = SamplingParams(
    temperature=1.0, top_k=TOP_K, max_tokens=M, ignore_eos=True, seed=SEED,
    presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={40: 1.0, 41: -0.5},
)  # fmt: skip


@pytest.fixture(scope="module")
def law_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random target (logits O(1), so the penalties move the law a lot) and a draft near it."""
    root = tmp_path_factory.mktemp("penalty_law_models")
    target = save_tiny_checkpoint(root, "llama", seed=3)
    return {"target": target, "draft": perturbed_checkpoint(target, root / "draft", 0.1, seed=7)}


def penalised_law(path: Path, params: SamplingParams, prompt: list[int] = LAW_PROMPT, m: int = M) -> dict[tuple[int, ...], float]:
    """P(first m generated tokens = x) under ``params``, by enumeration: the
    reference penalties on transformers' logits, then temperature and top-k."""
    return exact_law(
        path, m, params.temperature, params.top_k, prompt, adjust=lambda logits, history: reference_adjust(logits[0], history, len(prompt), params)[None]
    )


def sample(models: dict[str, Path], mode: str, params: SamplingParams, n: int = N, **spec: Any) -> list:
    eng = LocalEngine(
        EngineConfig(
            target=str(models["target"]), draft=str(models["draft"]), spec=SpeculationConfig(mode=mode, **spec),
            threads_per_worker=1, max_batch_size=n, max_kv_tokens=32 * n, build_ahead=False,
        )
    )  # fmt: skip
    try:
        res = eng.generate([LAW_PROMPT], params, n=n)
    finally:
        eng.close()
    assert all(len(r.token_ids) == M for r in res)
    return res


def assert_law(results: list, law: dict[tuple[int, ...], float], what: str) -> None:
    stat, df, pval, outside = chi_square(counts_of(results), law)
    assert outside == 0, f"{what}: {outside} samples have probability 0 under the penalised law"
    assert pval >= ALPHA, f"{what}: chi-square {stat:.1f} on {df} df, p = {pval:.2e} < {ALPHA}"


@pytest.fixture(scope="module")
def law(law_models):
    return penalised_law(law_models["target"], LAW)


@pytest.fixture(scope="module")
def sd_samples(law_models):
    return sample(law_models, "sd", LAW, k=2)


def test_sd_with_penalties_matches_the_penalised_law(sd_samples, law):
    accepted = [r.stats["mean_accepted"] for r in sd_samples if r.stats["mean_accepted"] is not None]
    assert 0.3 < sum(accepted) / len(accepted) < 1.9  # rejections and acceptances both
    assert_law(sd_samples, law, "sd k=2, penalties and bias on")


def test_ssd_with_penalties_matches_the_penalised_law(law_models, law):
    res = sample(law_models, "ssd", LAW, k=2, fanout="auto", budget=4, backup="neural")
    hits = [r.stats["cache_hit_rate"] for r in res if r.stats["cache_hit_rate"] is not None]
    assert sum(hits) / len(hits) > 0.3  # cached speculations, built with the branch histories, feed the measured tokens
    assert_law(res, law, "ssd k=2 auto budget 4, penalties and bias on")


def test_the_statistic_rejects_the_unpenalised_law(law_models, sd_samples, law):
    plain = penalised_law(law_models["target"], SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=M))
    assert chi_square(counts_of(sd_samples), plain)[2] < REJECT
    assert chi_square(counts_of(sd_samples), law)[2] >= ALPHA  # the control, on the same counts


def adjust_with_the_committed_history_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug vLLM and SGLang shipped, as a mutant of every worker's adjuster:
    every row of a proposal adjusted (penalised, masked) with the committed
    history alone — the proposal's earlier tokens and a branch's not counted."""
    real = LogitAdjuster.adjust

    def committed_only(self: LogitAdjuster, logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
        committed: dict[int, int] = {}
        for r in rows:
            committed[r.seq_id] = min(committed.get(r.seq_id, r.upto), r.upto)
        return real(self, logits, [replace(r, upto=committed[r.seq_id], extra=()) for r in rows])

    monkeypatch.setattr(LogitAdjuster, "adjust", committed_only)


def test_the_statistic_rejects_penalties_that_miss_the_proposed_prefix(law_models, law, monkeypatch):
    adjust_with_the_committed_history_only(monkeypatch)
    res = sample(law_models, "sd", LAW, n=N_POWER, k=2)
    assert chi_square(counts_of(res), law)[2] < REJECT


# ------------------------------------------------------------------ Ray and Serve


def test_the_ray_runtime_applies_them_in_every_mode(handle, ar_tokens):
    """The Serve tests' engine (Ray actors, a draft; ar, sd, ssd and auto allowed, K <= 4)."""
    for mode in ("ar", "sd", "ssd", "auto"):
        res = bounded(handle.generate, PROMPTS, greedy("all", Strategy(mode)))
        assert [r.token_ids for r in res] == ar_tokens["all"], mode


def test_serve_takes_the_penalties_from_the_openai_client(client, handle, server, tokenizer):
    body = dict(presence_penalty=0.4, frequency_penalty=0.6, logit_bias={str(NEWLINE): -3, "283": 1.5})
    extra = {"repetition_penalty": 1.2, "ignore_eos": True}
    for mode in ("sd", "ssd", "auto"):
        want = bounded(handle.generate, [PROMPTS[1]], greedy("all", Strategy(mode), 16))[0].text
        got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, extra_body={**extra, "speculation": mode}, **body)
        assert got.choices[0].text == want, mode
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True, extra_body=extra, **body)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    messages = [{"role": "user", "content": PROMPTS[0]}]
    with_penalties, plain = (
        bounded(handle.generate, [chat_prompt_ids(tokenizer, messages)], greedy(s, Strategy("ssd"), 16))[0].text for s in ("all", None)
    )
    assert with_penalties != plain
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={**extra, "speculation": "ssd"}, **body)
    assert chat.choices[0].message.content == with_penalties
    base = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"5": 101}), ("logit_bias", {"99999": 1})]:  # fmt: skip
        err = assert_openai_error(raw_post(server, "/v1/completions", {**base, field: value}), 400, field)
        assert field in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logit_bias={"99999": 1})
    assert info.value.body["param"] == "logit_bias"

