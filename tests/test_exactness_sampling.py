"""Exactness at T > 0, end to end (DESIGN §8(b)).

For every exact mode the empirical law of the first M generated tokens over N
seeded samples (sample i uses seed + i) must match the target's exact law of
those M tokens, computed by enumerating every prefix in the support with the
target run through ``transformers`` and processed by
:func:`saguaro_ray.algorithms.sampling.process_logits` (temperature, top-k).
With ``top_k = 2`` and M = 6 the support has 2^6 = 64 sequences; cells with an
expected count below 5 are merged and a chi-square test at α = 0.001 decides.

M is long enough that several verification rounds (and, for SSD, rounds fed
from the speculation cache) contribute to the measured tokens. Seeds are
fixed, so every test is deterministic. Every mode is checked by the
drafter-invariant rule, whose emitted tokens are the race winners of the
target's law under the noise of (seed, position) whatever was proposed: so
besides its law, every mode's samples must equal AR's sample by sample (the
stronger statement; ``test_seed_invariance`` adds penalties, grammars and
repeats). The seed range used here puts AR (the ground truth sampler) at
p ≈ 0.4.

The sensitivity tests show the statistic has power: against a wrong law (the
target at another temperature, the draft's law) and against a deliberately
broken rule that keeps a proposal's first token where it differs from the
target's (``test_seed_invariance`` adds noise keyed without the position) it
rejects with p-values far below α.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import perturbed_checkpoint, load_hf_model, save_tiny_checkpoint
from scipy.stats import chi2

from saguaro_ray.algorithms.sampling import process_logits
from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

PROMPT = [5, 6, 7]
M = 6  # generated tokens whose joint law is tested
TOP_K = 2
TEMPERATURE = 1.0
N = 3000  # samples per law test
N_MUTANT = 1500  # samples per sensitivity run (their bias is gross)
SEED = 50_000  # samples use SEED .. SEED + N - 1
ALPHA = 1e-3
REJECT = 1e-6  # sensitivity checks must reject far below ALPHA


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sampling_models")
    target = save_tiny_checkpoint(root, "llama", seed=3)
    return {
        "target": target,
        "draft": perturbed_checkpoint(target, root / "draft", 0.1, seed=7),  # accepts ~half its tokens
        "weak": perturbed_checkpoint(target, root / "weak", 0.3, seed=8),  # PyramidSD's draft
    }


# ------------------------------------------------------------------ exact law


def exact_law(
    path: Path,
    m: int = M,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    prompt: list[int] = PROMPT,
    adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> dict[tuple[int, ...], float]:
    """P(first m generated tokens = x) for every x with positive probability,
    by enumeration: one forward per prefix in the support. ``adjust(logits
    [1, V], history)``: what is done to a row before temperature and top-k
    (penalties: ``test_penalties.py``), history = prompt + prefix."""
    hf = load_hf_model(path)
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(m):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, pr in law.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1:].float()
            if adjust is not None:
                logits = adjust(logits, prompt + list(prefix))
            p = process_logits(logits, [temperature], [top_k])[0].double()
            p = p / p.sum()  # fp32 softmax rows sum to 1 only within ~1e-7
            for tok in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (tok,)] = pr * float(p[tok])
        law = nxt
    assert abs(sum(law.values()) - 1.0) < 1e-9
    return law


@pytest.fixture(scope="module")
def target_law(models):
    law = exact_law(models["target"])
    assert len(law) == TOP_K**M
    return law


def chi_square(counts: Counter, law: dict[tuple[int, ...], float]) -> tuple[float, int, float, int]:
    """Pearson's statistic of ``counts`` against ``law``: (stat, df, p-value,
    number of samples outside the law's support). Cells are merged in order of
    increasing expected count until every merged cell expects at least 5."""
    n = sum(counts.values())
    outside = sum(c for x, c in counts.items() if x not in law)
    cells = sorted(law, key=lambda x: law[x])
    expected, observed = [], []
    acc_e, acc_o = 0.0, 0
    for x in cells:
        acc_e += law[x] * n
        acc_o += counts.get(x, 0)
        if acc_e >= 5:
            expected.append(acc_e)
            observed.append(acc_o)
            acc_e, acc_o = 0.0, 0
    if acc_e > 0:  # the leftover (largest cells come last, so this is rare)
        expected[-1] += acc_e
        observed[-1] += acc_o
    # samples outside the support count against the smallest cell (a wrong law
    # must be rejected, not silently ignored)
    observed[0] += outside
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(expected) - 1
    return stat, df, float(chi2.sf(stat, df)), outside


def run(
    models,
    mode: str,
    *,
    n: int = N,
    top_k: int = TOP_K,
    m: int = M,
    draft: str = "draft",
    qualifier: str | None = None,
    num_drafts: int = 1,
    timeline: list | None = None,
    build_ahead: bool = False,
    **spec,
):
    """``n`` samples of ``m`` tokens (``timeline``: receives the engine's rounds)."""
    eng = LocalEngine(
        EngineConfig(
            target=str(models["target"]),
            draft=str(models[draft]) if mode != "ar" else None,
            qualifier=str(models[qualifier]) if qualifier else None,
            spec=SpeculationConfig(mode=mode, **spec),
            threads_per_worker=1,
            max_batch_size=n,
            max_kv_tokens=32 * n,
            num_drafts=num_drafts,
            build_ahead=build_ahead,
        )
    )
    try:
        params = SamplingParams(temperature=TEMPERATURE, top_k=top_k, max_tokens=m, ignore_eos=True, seed=SEED)
        res = eng.generate([PROMPT], params, n=n)
        if timeline is not None:
            timeline.extend(eng.timeline)
    finally:
        eng.close()
    assert all(len(r.token_ids) == m for r in res)
    return res


def counts_of(results) -> Counter:
    return Counter(tuple(r.token_ids) for r in results)


def assert_law(results, law, what: str) -> None:
    stat, df, pval, outside = chi_square(counts_of(results), law)
    assert outside == 0, f"{what}: {outside} samples have probability 0 under the target's law"
    assert pval >= ALPHA, f"{what}: chi-square {stat:.1f} on {df} df, p = {pval:.2e} < {ALPHA}"


def assert_ar_tokens(results, ar, what: str) -> None:
    """Sample i equals AR's sample i (both drew seed SEED + i), so the law is AR's."""
    differ = [i for i, (a, b) in enumerate(zip(results, ar)) if a.token_ids != b.token_ids]
    assert len(results) <= len(ar) and not differ, (
        f"{what}: {len(differ)} samples differ from AR, e.g. seed {SEED + differ[0]}: {results[differ[0]].token_ids} vs {ar[differ[0]].token_ids}"
    )


def mean_stat(results, key: str) -> float:
    vals = [r.stats[key] for r in results if r.stats[key] is not None]
    return sum(vals) / len(vals)


# Results are shared between the law tests and the identity tests.
@pytest.fixture(scope="module")
def ar_results(models):
    return run(models, "ar")


@pytest.fixture(scope="module")
def sd_results(models):
    return run(models, "sd", k=2)


@pytest.fixture(scope="module")
def ssd_results(models):
    return run(models, "ssd", k=2, fanout="auto", budget=4, backup="neural")


# ------------------------------------------------------------------ the modes


def test_ar_matches_exact_law(ar_results, target_law):
    assert_law(ar_results, target_law, "ar")


def test_sd_matches_exact_law(sd_results, ar_results, target_law):
    assert 0.3 < mean_stat(sd_results, "mean_accepted") < 1.9  # a mix of acceptances and rejections
    assert_ar_tokens(sd_results, ar_results, "sd k=2")
    assert_law(sd_results, target_law, "sd k=2")


def test_ssd_matches_exact_law(ssd_results, ar_results, target_law):
    assert mean_stat(ssd_results, "cache_hit_rate") > 0.3  # cached speculations feed the measured tokens
    assert_ar_tokens(ssd_results, ar_results, "ssd k=2 auto budget 4")
    assert_law(ssd_results, target_law, "ssd k=2 auto budget 4")


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_separate_draft_quantised_at_load_matches_exact_law(models, ar_results, mode):
    """``int4:<draft>``: the draft model quantised when it is loaded proposes
    the race winners of its own quantised law; the rule keeps AR's tokens."""
    spec = {"fanout": "auto", "budget": 4, "backup": "neural"} if mode == "ssd" else {}
    res = run(dict(models, int4=f"int4:{models['draft']}"), mode, draft="int4", k=2, n=N // 3, **spec)
    assert 0.3 < mean_stat(res, "mean_accepted")  # its proposals are taken
    assert_ar_tokens(res, ar_results, f"{mode} k=2, int4 draft")


def test_ssd_two_drafts_matches_exact_law(models, ar_results):
    """Two drafts, each building half the outcome set (and taking the other's
    KV deltas): the tokens, hence the law, are unchanged."""
    res = run(models, "ssd", k=2, fanout="auto", budget=2, backup="neural", num_drafts=2, n=N // 3)
    assert mean_stat(res, "cache_hit_rate") > 0.3
    assert_ar_tokens(res, ar_results, "ssd k=2 auto budget 2x2 drafts")


def test_ssd_k1_mostly_cache_fed_matches_exact_law(models, ar_results):
    """K = 1: after the first (backup) round every round's proposal comes from
    the cache when it hits, so most of the M tokens follow cached speculations."""
    res = run(models, "ssd", k=1, fanout="auto", budget=2, backup="auto", n=N // 3)
    assert mean_stat(res, "cache_hit_rate") > 0.3
    assert_ar_tokens(res, ar_results, "ssd k=1 auto budget 2 backup auto")


def test_ssd_builds_started_ahead_match_exact_law(models, target_law):
    """The only draft starts each next build itself once its lookup is answered
    (hits and neural backups are all known to it) — for the whole batch, as
    long as no sequence is so near its length limit that its next K depends on
    the outcome. With 6 more tokens to go, the second and third rounds, which
    emit most of the measured M tokens, are served by builds started ahead;
    the first M tokens of a longer sample have the law of an M-token sample."""
    rounds: list = []
    res = run(models, "ssd", k=2, fanout="auto", budget=4, backup="neural", m=M + 6, timeline=rounds, build_ahead=True)
    spec_rounds = [r for r in rounds if r.build is not None]
    assert [r.ahead for r in spec_rounds[:3]] == [False, True, True], [r.ahead for r in spec_rounds]
    assert mean_stat(res, "cache_hit_rate") > 0.3
    first = [replace(r, token_ids=r.token_ids[:M]) for r in res]
    assert_law(first, target_law, "ssd k=2 auto budget 4, builds started ahead")


def test_ssd_all_miss_fast_backup_matches_exact_law(models, ar_results):
    """A zero fan-out caches nothing: every round verifies a point-mass guess
    from the fast backup (kept where it equals the target's race winner)."""
    res = run(models, "ssd", k=3, fanout=(0, 0, 0, 0), backup="fast", n=N // 3)
    assert all(r.stats["cache_hit_rate"] == 0.0 for r in res)
    assert_ar_tokens(res, ar_results, "ssd all-miss fast")


def test_ssd_bad_budget1_fast_matches_exact_law(models, ar_results):
    res = run(models, "ssd", k=2, fanout="auto", budget=1, backup="fast", draft="weak", n=N // 3)
    assert mean_stat(res, "cache_hit_rate") < 0.5
    assert_ar_tokens(res, ar_results, "ssd weak draft, budget 1, fast")


@pytest.mark.parametrize("stage1", ["exact", "assisted"])
def test_pyramid_exact_stage2_matches_exact_law(models, ar_results, target_law, stage1):
    res = run(models, "pyramid", draft="weak", qualifier="draft", stage1=stage1, stage2="exact", lq=3, ld=2)
    assert all(r.stats["lossy"] is False for r in res)
    assert_ar_tokens(res, ar_results, f"pyramid stage1={stage1}")
    assert_law(res, target_law, f"pyramid stage1={stage1}")


# ------------------------------------------------ a strategy per sequence

N_MIX = 1500  # samples per strategy when several share one batch


def _one_engine(models, n: int) -> LocalEngine:
    """One engine for every strategy (``auto`` by default): PyramidSD's models, as above."""
    return LocalEngine(
        EngineConfig(
            target=str(models["target"]),
            draft=str(models["weak"]),
            qualifier=str(models["draft"]),
            spec=SpeculationConfig(k=2, budget=4, backup="neural", lq=3, ld=2),
            threads_per_worker=1,
            max_batch_size=n,
            max_kv_tokens=32 * n,
            build_ahead=False,
        )
    )


def test_each_strategy_keeps_its_law_beside_other_strategies(models, target_law):
    """SSD, SD and PyramidSD samples verified in the same rounds as each other
    (and as AR's): each strategy's samples follow the target's law."""
    modes = ["ssd", "sd", "pyramid", "ar"]
    eng = _one_engine(models, N_MIX * len(modes))
    try:
        params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=M, ignore_eos=True, seed=SEED, speculation=m) for m in modes]
        res = eng.generate([PROMPT] * len(modes), params, n=N_MIX)
        rounds = [r for r in eng.timeline if not r.prefill]
    finally:
        eng.close()
    assert any(len(r.modes) == len(modes) for r in rounds)  # they did share rounds
    for i, mode in enumerate(modes[:3]):
        got = [r for r in res if r.prompt_index == i]
        assert all(r.mode == mode and set(r.stats["strategy"]) == {mode} for r in got)
        assert_law(got, target_law, f"{mode} beside other strategies")


def test_auto_switching_strategy_and_k_every_round_keeps_the_law(models, target_law):
    """``auto`` sequences forced through AR, SD and SSD with K = 1..3 in turn
    (a different phase per sequence, see ``Cycling``)."""
    from test_strategy_per_sequence import Cycling

    eng = _one_engine(models, N)
    eng.loop.assigner.policy = Cycling()
    try:
        res = eng.generate([PROMPT], SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=M, ignore_eos=True, seed=SEED), n=N)
    finally:
        eng.close()
    assert all(len(r.stats["strategy"]) >= 2 for r in res)
    assert_law(res, target_law, "auto, switching every round")


# ------------------------------------------------------------ sensitivity


def test_statistic_rejects_wrong_laws(models, sd_results, target_law):
    """Power against wrong laws: the target at another temperature, and the
    draft's own law."""
    counts = counts_of(sd_results)
    for temperature in (0.7, 2.0):
        _, _, pval, _ = chi_square(counts, exact_law(models["target"], temperature=temperature))
        assert pval < REJECT, f"T={temperature}: p = {pval:.2e}"
    _, _, pval, _ = chi_square(counts, exact_law(models["draft"]))
    assert pval < REJECT
    # and the right law on the same counts passes (the control)
    assert chi_square(counts, target_law)[2] >= ALPHA


def test_statistic_rejects_a_rule_that_keeps_a_mismatched_proposal(models, target_law, monkeypatch):
    """A classic bug (the reference engine's greedy acceptance on misses):
    keep a proposal's first token even where the target's race winner
    differs — the first token then follows the draft's law."""
    from saguaro_ray.algorithms import verification

    def keep_first(best, proposals):
        out, offset = [], 0
        for tokens in proposals:
            rows = best[offset : offset + len(tokens) + 1]
            offset += len(tokens) + 1
            k = 1 if tokens else 0
            while k < len(tokens) and tokens[k] == rows[k]:
                k += 1
            out.append((k, rows[k]))
        return out

    monkeypatch.setattr(verification, "match_outcomes", keep_first)
    res = run(models, "sd", k=2, n=N_MUTANT)
    assert chi_square(counts_of(res), target_law)[2] < REJECT
