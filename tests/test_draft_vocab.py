"""A draft's reduced-vocabulary LM head (``EngineConfig(draft_vocab=N)``, issue 17).

The subset head computes the rows of N ids (the tokenizer's special ids and
the lowest others) and leaves -inf everywhere else, so the draft's law is 0
outside the subset and every mode stays exact. The tests: the subset head's
logits are the full head's on its ids (fp32, int8 and int4, tied head too)
and -inf elsewhere; T = 0 tokens equal AR's in SD, SSD and PyramidSD with a
float draft and with ``self:int8``; the law at T = 1 in SD and SSD, on a
target whose law puts mass outside the subset; a grammar that allows no
subset token on most rows (the full head's fallback: without it the row's law
is NaN) gives AR's tokens at T = 0 and the masked target law at T = 1; bad
values are one-line ConfigErrors naming ``draft_vocab`` (Python, CLI, Serve).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import save_tiny_checkpoint
from test_exactness_sampling import assert_law, exact_law
from test_structured_output import JSON_OBJECT, grammar_law

from saguaro_ray.cli import main as cli_main
from saguaro_ray.config import SamplingParams, SpeculationConfig, Strategy
from saguaro_ray.engine import LocalEngine
from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels.subset_head import subset_ids
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.serve.config import ServeAppConfig
from saguaro_ray.tokenizer import load_tokenizer
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.logit_adjust import RowContext
from saguaro_ray.workers.messages import SeqStep
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.target import RunnerLogic

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

N_ZOO = 512  # of the tiny zoo's 2048 ids
PROMPTS = ["def f(x):\n    return ", "import os\n", "for i in range(10):\n    "]
MAX_TOKENS = 24
STRATEGIES = {"sd": Strategy("sd", 3), "ssd": Strategy("ssd", 3), "pyramid": Strategy("pyramid")}


def greedy(mode: str, **kw) -> SamplingParams:
    """T = 0, ``MAX_TOKENS`` tokens (EOS ignored unless ``kw`` says otherwise: a grammar ends on it)."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "speculation": STRATEGIES.get(mode, mode)} | kw)


# ------------------------------------------------------------------ the head


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tied"), "llama", seed=5, tie_word_embeddings=True)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("model", ["zoo", "tied"])
def test_the_subset_heads_logits_are_the_full_heads_on_its_ids_and_minus_inf_elsewhere(zoo_tiny, tied, model, quantize):
    path, n = (zoo_tiny / "target", N_ZOO) if model == "zoo" else (tied, 64)
    full = ModelRunner(path, quantize=quantize)
    sub = ModelRunner(path, quantize=quantize, head_vocab=n)
    special = {i for i, t in load_tokenizer(path).added_tokens_decoder.items() if t.special}
    ids = sub.head_ids.tolist()
    assert len(ids) == n and special <= set(ids) and ids == sorted(special | set(range(n)))[:n]
    tokens = [5, 6, 7, 50, 60, 70, 80, 90]  # 8 rows: the int kernels' and oneDNN's row counts both
    for rows in (1, 4, 8):
        for r in (full, sub):
            r.add_sequence(rows)
        a = full.forward([rows], [tokens[:rows]], all_logits=True)
        b = sub.forward([rows], [tokens[:rows]], all_logits=True)
        torch.testing.assert_close(b[:, ids], a[:, ids], rtol=0, atol=0)  # the same rows, kernels and rounding
        outside = torch.ones(a.shape[-1], dtype=torch.bool)
        outside[ids] = False
        assert torch.isneginf(b[:, outside]).all() and torch.isfinite(b[:, ids]).all()
        # the fallback: the full head's logits of chosen rows of the latest forward
        torch.testing.assert_close(sub.full_head_logits(torch.arange(rows)), a, rtol=0, atol=0)


def test_the_subset_keeps_every_special_id_and_refuses_fewer_ids_than_those():
    assert subset_ids(100, 5, [0, 2, 90]).tolist() == [0, 1, 2, 3, 90]
    with pytest.raises(ConfigError, match=r"^draft_vocab=2 cannot hold the tokenizer's 3 special token ids"):
        subset_ids(100, 2, [0, 2, 90])


# ------------------------------------------------------------------ T = 0


@pytest.fixture(scope="module")
def ar_tokens(zoo_tiny):
    eng = LocalEngine(EngineConfig(target=str(zoo_tiny / "target"), spec=SpeculationConfig(mode="ar"), threads_per_worker=1))
    try:
        yield {
            "plain": [r.token_ids for r in eng.generate(PROMPTS, greedy("ar"))],
            "json": [r.token_ids for r in eng.generate(PROMPTS, greedy("ar", response_format=JSON_OBJECT, ignore_eos=False))],
        }
    finally:
        eng.close()


@pytest.fixture(scope="module", params=["zoo:draft", "self:int8"])
def engine(request, zoo_tiny):
    draft = str(zoo_tiny / "draft") if request.param == "zoo:draft" else request.param
    eng = LocalEngine(
        EngineConfig(
            target=str(zoo_tiny / "target"), draft=draft, qualifier=str(zoo_tiny / "qualifier"), draft_vocab=N_ZOO,
            spec=SpeculationConfig(mode="sd", allow=tuple(STRATEGIES)), threads_per_worker=1,
        )
    )  # fmt: skip
    yield eng
    eng.close()


@pytest.mark.parametrize("mode", list(STRATEGIES))
def test_every_mode_emits_ar_tokens_with_a_reduced_draft_head(engine, ar_tokens, mode):
    assert len(engine.workers["draft"].logic.runner.head_ids) == N_ZOO
    assert engine.workers["target"].logic.runner.head_ids is None
    assert engine.workers["qualifier"].logic.runner.head_ids is None  # drafts only
    res = engine.generate(PROMPTS, greedy(mode))
    assert [r.token_ids for r in res] == ar_tokens["plain"]
    accepted = [r.stats["mean_accepted"] for r in res if r.stats["mean_accepted"] is not None]
    assert accepted and max(accepted) > 0, "the reduced draft never had a token accepted"


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_grammar_that_allows_no_subset_token_falls_back_to_the_full_head(zoo_tiny, ar_tokens, mode, monkeypatch):
    """With 8 ids (the 4 specials and 4 more) the JSON grammar forbids the
    whole subset on almost every row: those rows take the full head, and the
    tokens are AR's."""
    eng = LocalEngine(EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), draft_vocab=8,
                                   spec=SpeculationConfig(mode=mode), threads_per_worker=1))  # fmt: skip
    calls = []
    runner = eng.workers["draft"].logic.runner
    original = runner.full_head_logits
    monkeypatch.setattr(runner, "full_head_logits", lambda rows: calls.append(len(rows)) or original(rows))
    try:
        res = eng.generate(PROMPTS, greedy(mode, response_format=JSON_OBJECT, ignore_eos=False))
    finally:
        eng.close()
    assert [r.token_ids for r in res] == ar_tokens["json"]
    assert sum(calls) > len(PROMPTS), calls


def test_the_fallback_gives_a_row_the_grammar_empties_the_full_heads_law(zoo_tiny):
    """The defect the fallback fixes: a row whose every subset logit the
    grammar masks is all -inf (a NaN law) without it."""
    runner = ModelRunner(zoo_tiny / "target", head_vocab=8)
    logic = DraftLogic(runner)
    params = SamplingParams(temperature=1.0, response_format=JSON_OBJECT)
    step = SeqStep(seq_id=0, start=0, new_tokens=[5, 6, 7], params=params, seed=0, output_pos=0, prompt_len=3)
    raw = logic.feed([step], [[]], [1])
    rows = [RowContext(0, params, logic.history.tokens(0), 3, (), 3)]
    assert torch.isneginf(RunnerLogic.adjust_rows(logic, raw.clone(), rows)).all()  # what a draft got before the fix
    got = logic.adjust_rows(raw.clone(), rows)
    want = logic.adjuster.adjust(runner.full_head_logits(torch.tensor([0])), rows)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(got).any() and not torch.isfinite(got[:, runner.head_ids]).any()
    # a proposal drawn from such rows carries (asked for a fuzzy stage) the proper law it was drawn from (without the fix: NaN rows)
    [prop] = logic.propose([SeqStep(seq_id=1, start=0, new_tokens=[5, 6, 7], params=params, seed=0, output_pos=0, prompt_len=3)], [3], with_laws=True)
    assert prop.q is not None and torch.isfinite(prop.q).all()
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(3))
    assert all(prop.q[j, t] > 0 for j, t in enumerate(prop.tokens))


# ------------------------------------------------------------------ T > 0: the law

LAW_PROMPT = [5, 6, 7]
LAW_M, LAW_TOP_K, LAW_N, LAW_SEED = 6, 2, 3000, 90_000
N_LAW = 40  # of the random model's 128 ids: its law has mass outside


@pytest.fixture(scope="module")
def law_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_vocab_law")
    target = save_tiny_checkpoint(root, "llama", seed=3)
    from helpers import perturbed_checkpoint

    return {"target": target, "draft": perturbed_checkpoint(target, root / "draft", 0.1, seed=7)}


def law_samples(models: dict[str, Path], mode: str, prompt: list[int], draft_vocab: int, **params) -> list:
    eng = LocalEngine(
        EngineConfig(
            target=str(models["target"]), draft=str(models["draft"]), draft_vocab=draft_vocab, spec=SpeculationConfig(mode=mode, k=2),
            threads_per_worker=1, max_batch_size=LAW_N, max_kv_tokens=(len(prompt) + 16) * LAW_N, build_ahead=False,
        )
    )  # fmt: skip
    try:
        res = eng.generate([prompt], SamplingParams(temperature=1.0, top_k=LAW_TOP_K, max_tokens=LAW_M, ignore_eos=True, seed=LAW_SEED, **params), n=LAW_N)
    finally:
        eng.close()
    assert all(len(r.token_ids) == LAW_M for r in res)
    return res


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_law_at_t1_is_the_targets_with_a_reduced_draft_head(law_models, mode):
    law = exact_law(law_models["target"], LAW_M, 1.0, LAW_TOP_K, LAW_PROMPT)
    outside = sum(p for x, p in law.items() if any(t >= N_LAW for t in x))
    assert outside > 0.3, outside  # the target often writes what the draft cannot propose
    res = law_samples(law_models, mode, LAW_PROMPT, N_LAW)
    accepted = [r.stats["mean_accepted"] for r in res if r.stats["mean_accepted"] is not None]
    assert 0.1 < sum(accepted) / len(accepted) < 1.9  # rejections and acceptances both
    assert_law(res, law, f"{mode} draft_vocab={N_LAW}")


def test_the_law_at_t1_under_a_grammar_that_empties_the_subset(zoo_tiny):
    tok = load_tokenizer(zoo_tiny / "target")
    prompt = tok.encode("CONFIG = ", add_special_tokens=False)
    law = grammar_law(zoo_tiny, tok, JSON_OBJECT, prompt)
    res = law_samples({"target": zoo_tiny / "target", "draft": zoo_tiny / "draft"}, "sd", prompt, 8, response_format=JSON_OBJECT)
    assert_law(res, law, "sd draft_vocab=8 under the JSON grammar")


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize("bad", [0, -3, 2.5, "512", True])
def test_a_bad_draft_vocab_is_a_config_error_naming_it(zoo_tiny, bad):
    with pytest.raises(ConfigError, match=r"^draft_vocab must be a positive integer") as e:
        EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), draft_vocab=bad)
    assert "\n" not in str(e.value)


def test_draft_vocab_without_a_draft_is_refused(zoo_tiny):
    with pytest.raises(ConfigError, match="^draft_vocab sets the draft's LM head; this engine has no draft"):
        EngineConfig(target=str(zoo_tiny / "target"), spec=SpeculationConfig(mode="ar"), draft_vocab=64)


def test_the_cli_and_serve_refuse_a_bad_draft_vocab_in_one_line(zoo_tiny, capsys):
    base = ["generate", "--in-process", "--target", str(zoo_tiny / "target"), "--draft", str(zoo_tiny / "draft"),
            "--mode", "sd", "--prompt", "x", "--max-tokens", "2", "--temperature", "0"]  # fmt: skip
    for value, message in (("0", "draft_vocab must be a positive integer"), ("2", "draft_vocab=2 cannot hold the tokenizer's 4 special token ids")):
        assert cli_main([*base, "--draft-vocab", value]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err
    assert cli_main(["bench", "--draft-vocab", "0", "--target", str(zoo_tiny / "target")]) == 2
    assert "draft_vocab must be a positive integer" in capsys.readouterr().err
    assert cli_main([*base, "--draft-vocab", "300", "--json"]) == 0  # and a good one runs
    with pytest.raises(ValueError, match="draft_vocab must be a positive integer"):
        ServeAppConfig(model_name="m", target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), engine_options={"draft_vocab": 0})


# ------------------------------------------------------------------ through Ray


def mean_accepted(results) -> float:
    vals = [r.stats["mean_accepted"] for r in results if r.stats["mean_accepted"] is not None]
    return sum(vals) / len(vals)


def test_the_option_reaches_the_ray_draft_workers(ray_instance, zoo_tiny, ar_tokens):
    """Through Ray the draft actors load the reduced head too: with 8 ids
    (specials and punctuation) SD still emits AR's tokens, and the draft's
    acceptance collapses against the full head's in process."""
    from saguaro_ray.runtime.engine import Engine

    full = LocalEngine(EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), spec=SpeculationConfig(mode="sd", k=3), threads_per_worker=1))
    try:
        baseline = mean_accepted(full.generate(PROMPTS, greedy("sd")))
    finally:
        full.close()
    handle = Engine.launch(EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), draft_vocab=8, spec=SpeculationConfig(mode="sd", k=3)))
    try:
        res = handle.generate(PROMPTS, greedy("sd"))
    finally:
        handle.shutdown()
    assert [r.token_ids for r in res] == ar_tokens["plain"]
    assert mean_accepted(res) < baseline / 2, (mean_accepted(res), baseline)
