"""A seed fixes the output (issue 34): the drafter-invariant rule, end to end.

Every request is verified by the drafter-invariant rule, the engine's one
rule (:func:`saguaro_ray.algorithms.verification.invariant_outcomes`): every
emitted token is the race winner of the target's processed law under the
public noise of (seed, output position), so its tokens are those of plain
autoregressive sampling with that noise — in every strategy, at every K,
with SSD's cache hits and misses (fast or neural backups), PyramidSD's exact
stages, ``auto`` switching strategy and K every round, and beside other
requests in the batch. These tests compare token lists sample by sample on
the zoo's tiny family (T = 0.8, penalties and a logit bias on, a JSON schema
on), and check the law itself: AR's samples under the rule match the
target's exact law (chi-square, the harness of
``test_exactness_sampling``), and a noise keyed without the position, the
classic keying bug, is rejected.

A position's logits have the same bits in AR's decode and in a verification
of any K and batch (the runner's row invariance), so the equality is exact;
the assertions would say how many samples differ.

The rule replaced speculative sampling's (``verification="standard"``,
Saguaro sampling's ``saguaro_c``): a request, a config or a flag that still
names them is refused with one line.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_helpers import SPECS
from test_exactness_sampling import ALPHA, N_MUTANT, REJECT, chi_square, counts_of, run
from test_exactness_sampling import models, target_law  # noqa: F401  (fixtures)

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.errors import ConfigError
from saguaro_ray.runtime.engine_config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

PROMPTS = ["def main(", "import os"]
N = 3  # samples per prompt (sample i uses seed + i)
MAX_TOKENS = 24

MODES = {
    "ar": SPECS["ar"],
    "sd": SPECS["sd"],
    "ssd": SPECS["ssd"],
    # a fan-out of one candidate per k on a budget of 2 misses often: fast (n-gram) backups
    "ssd-misses": SpeculationConfig(mode="ssd", k=3, fanout=(1, 1, 0, 0), budget=2, backup="fast"),
    "ssd-neural": SpeculationConfig(mode="ssd", k=2, fanout="auto", budget=3, backup="neural"),
    "ssd-two-drafts": SpeculationConfig(mode="ssd", k=3, budget=6),  # the outcomes split, KV deltas shared
    "pyramid": SPECS["pyramid"],
    "auto": SpeculationConfig(mode="auto"),
}


def seeded(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": 1234, **kw})


PARAMS = {
    "plain": seeded(),
    "penalties+bias": seeded(presence_penalty=0.5, repetition_penalty=1.2, logit_bias={5: 2.0, 9: -3.0}, top_p=0.95),
    "json": seeded(temperature=1.0, ignore_eos=False, response_format={"type": "json_object"}),
}


def _engine(zoo, name: str):
    spec = MODES[name]
    return LocalEngine(
        EngineConfig(
            target=str(zoo / "target"),
            draft=None if spec.mode == "ar" else str(zoo / "draft"),
            qualifier=str(zoo / "qualifier") if spec.mode in ("pyramid", "auto") else None,
            spec=spec,
            threads_per_worker=1,
            num_drafts=2 if name == "ssd-two-drafts" else 1,
        )
    )


def tokens_of(zoo, name: str, params: SamplingParams, prompts=PROMPTS, n: int = N) -> tuple[list[list[int]], list]:
    eng = _engine(zoo, name)
    try:
        if name == "auto":
            from test_strategy_per_sequence import Cycling

            eng.loop.assigner.policy = Cycling()  # AR, SD and SSD with K = 1..3 in turn, every round
        res = eng.generate(prompts, params, n=n)
    finally:
        eng.close()
    return [r.token_ids for r in res], res


def differing(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


@pytest.fixture(scope="module")
def reference(zoo_tiny) -> dict[str, list[list[int]]]:
    """AR's tokens for every parameter set: what every strategy must emit."""
    return {k: tokens_of(zoo_tiny, "ar", p)[0] for k, p in PARAMS.items()}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("mode", [m for m in MODES if m != "ar"])
def test_a_seed_gives_ar_tokens_in_every_strategy(zoo_tiny, reference, mode, params):
    got, res = tokens_of(zoo_tiny, mode, PARAMS[params])
    bad = differing(got, reference[params])
    assert not bad, f"{mode}/{params}: {len(bad)} of {len(got)} samples differ from AR, e.g. {got[bad[0]]} vs {reference[params][bad[0]]}"
    if mode == "ssd-misses" and params == "plain":  # the forced misses really happened, beside hits
        rates = [r.stats["cache_hit_rate"] for r in res if r.stats["cache_hit_rate"] is not None]
        assert rates and min(rates) < 1.0 and max(rates) > 0.0, rates
    if mode == "auto":
        assert all(len(r.stats["strategy"]) >= 2 for r in res)


def test_samples_differ_and_repeat(zoo_tiny, reference):
    """Sample i of n uses its own stream (not n copies); the same request
    again gives the same tokens (here in SSD, whose hits depend on timing)."""
    plain = reference["plain"]
    assert len({tuple(t) for t in plain}) == len(plain)
    again, _ = tokens_of(zoo_tiny, "ssd", PARAMS["plain"])
    assert again == plain


def test_batch_composition_does_not_change_seeded_tokens(zoo_tiny, reference):
    """The seeded request beside unseeded ones of other strategies and
    temperatures, in one engine's rounds."""
    eng = _engine(zoo_tiny, "auto")
    try:
        others = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, ignore_eos=True, speculation=m) for t, m in ((1.0, "sd"), (0.0, "ssd"), (0.5, "ar"))]
        prompts = ["x = 1", *PROMPTS, "print("]
        params = [others[0], PARAMS["plain"], replace(PARAMS["plain"], speculation="ssd"), others[1]]
        res = eng.generate(prompts, params, n=N)
    finally:
        eng.close()
    got = [r.token_ids for r in res if r.prompt_index in (1, 2)]
    assert got == reference["plain"]


def test_the_removed_rule_is_refused_where_it_was_named():
    """``verification`` and ``saguaro_c`` are gone: a bench ``--sampling``
    object or a Serve YAML ``speculation`` block that names them is a
    ConfigError naming the field, a ``--saguaro-c`` flag an argparse error
    (exit 2, one line), and the Python API a TypeError (an unknown keyword)."""
    from saguaro_ray.bench.plan import sampling_settings
    from saguaro_ray.cli import main
    from saguaro_ray.serve.config import speculation_config

    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['verification'\]"):
        sampling_settings([{"verification": "standard"}])
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['saguaro_c'\]"):
        speculation_config({"mode": "ssd", "saguaro_c": 0.5})
    with pytest.raises(TypeError, match="verification"):
        SamplingParams(verification="standard")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="saguaro_c"):
        SpeculationConfig(saguaro_c=0.5)  # type: ignore[call-arg]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", "zoo:tiny", "--prompt", "x", "--saguaro-c", "0.5"])
    assert exit_.value.code == 2


def test_unseeded_requests_draw_fresh_seeds(zoo_tiny):
    params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    a, _ = tokens_of(zoo_tiny, "sd", params, PROMPTS[:1], 1)
    b, _ = tokens_of(zoo_tiny, "sd", params, PROMPTS[:1], 1)
    assert a != b


# ------------------------------------------------------------ the law


def test_invariant_rule_matches_exact_law(models, target_law):  # noqa: F811
    """AR under the rule samples the target's law (the race lemma, measured);
    SD and SSD (every hit and miss) emit the very same tokens, so their law is
    the same one."""
    ar = run(models, "ar")
    stat, df, pval, outside = chi_square(counts_of(ar), target_law)
    assert outside == 0 and pval >= ALPHA, f"chi-square {stat:.1f} on {df} df, p = {pval:.2e}"
    for mode, spec in (("sd", {"k": 2}), ("ssd", {"k": 2, "fanout": "auto", "budget": 4, "backup": "neural"})):
        other = run(models, mode, n=len(ar) // 3, **spec)
        bad = differing([r.token_ids for r in other], [r.token_ids for r in ar])
        assert not bad, f"{mode}: {len(bad)} samples differ from AR"


def test_statistic_rejects_noise_keyed_without_position(models, target_law, monkeypatch):  # noqa: F811
    """The keying bug: every position of a sample races with the same noise."""
    from saguaro_ray.algorithms import sampling

    real = sampling.position_keys
    monkeypatch.setattr(sampling, "position_keys", lambda seeds, positions: real(seeds, [0] * len(positions)))
    from saguaro_ray.workers import target

    monkeypatch.setattr(target, "position_keys", sampling.position_keys)
    res = run(models, "ar", n=N_MUTANT)
    assert chi_square(counts_of(res), target_law)[2] < REJECT


def test_proposals_carry_no_law_unless_a_fuzzy_stage_reads_it(zoo_tiny):
    """A draft's proposals are tokens alone (the rule compares tokens;
    nothing crosses the data plane), except PyramidSD's for a lossy fuzzy
    stage 1, which checks them by speculative sampling (a race winner is an
    exact draw from its law, independent of the qualifier's uniforms)."""
    from saguaro_ray.workers.draft import DraftLogic
    from saguaro_ray.workers.messages import SeqStep
    from saguaro_ray.workers.runner import ModelRunner

    draft = DraftLogic(ModelRunner(str(zoo_tiny / "draft")))
    params = seeded()
    step = lambda i: SeqStep(seq_id=i, start=0, new_tokens=[5, 6, 7], params=params, seed=9, output_pos=0, prompt_len=3)  # noqa: E731
    [plain] = draft.propose([step(1)], [3])
    [exact] = draft.propose_for_qualifier([step(2)], [3])
    [fuzzy] = draft.propose_for_qualifier([step(3)], [3], True)
    assert plain.q is None and exact.q is None and plain.tokens == exact.tokens == fuzzy.tokens
    assert fuzzy.q is not None and fuzzy.q.shape[0] == 3 and all(fuzzy.q[j, t] > 0 for j, t in enumerate(fuzzy.tokens))


def test_qualified_tokens_carry_the_qualifiers_rows_only_for_a_lossy_fuzzy_stage2(zoo_tiny):
    """An exact stage 1 qualifies by the drafter-invariant rule (tokens
    only); asked for ``laws`` (a lossy fuzzy stage 2 reads them as q, DESIGN
    §4) the same qualified tokens carry the qualifier's rows, and each token
    is the race winner of its row under the position's noise: the rows are
    the law it was drawn from."""
    import torch

    from saguaro_ray.algorithms.sampling import position_keys, race_token
    from saguaro_ray.workers.messages import Proposal, SeqStep, VerifyItem
    from saguaro_ray.workers.qualifier import QualifierLogic
    from saguaro_ray.workers.runner import ModelRunner

    params = seeded()
    step = lambda i: SeqStep(seq_id=i, start=0, new_tokens=[5, 6, 7], params=params, seed=9, output_pos=0, prompt_len=3)  # noqa: E731
    got = {}
    for laws in (False, True):
        qualifier = QualifierLogic(ModelRunner(str(zoo_tiny / "qualifier")))
        [got[laws]] = qualifier.qualify([VerifyItem(step(1), Proposal([11, 12, 13]), "exact", laws=laws)])
    plain, with_rows = got[False], got[True]
    assert plain.q is None and plain.tokens == with_rows.tokens
    rows = with_rows.q
    assert rows is not None and rows.shape[0] == len(with_rows.tokens)
    torch.testing.assert_close(rows.sum(-1).double(), torch.ones(len(rows), dtype=torch.float64))
    assert race_token(rows, position_keys([9] * len(rows), range(len(rows)))).tolist() == with_rows.tokens


def test_a_lossy_fuzzy_stage2_verifies_with_the_qualifiers_rows(zoo_tiny, monkeypatch):
    """End to end, in process: exact stage 1, fuzzy stage 2 at τ > 0 — the
    target's items carry the qualifier's rows (its q), the result says lossy,
    and a seed still fixes the (lossy) output."""
    from saguaro_ray.workers.target import TargetLogic

    seen: list[bool] = []
    real = TargetLogic.verify

    def recording(self, items):
        seen.extend(it.proposal.q is not None for it in items if it.rule == "fuzzy" and it.proposal.tokens)  # an empty block (at the length limit) has no rows
        return real(self, items)

    monkeypatch.setattr(TargetLogic, "verify", recording)
    spec = SpeculationConfig(mode="pyramid", stage1="exact", stage2="fuzzy", tau_t=0.3, allow_lossy=True, lq=3, ld=2)
    runs = []
    for _ in range(2):
        eng = LocalEngine(EngineConfig(target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), qualifier=str(zoo_tiny / "qualifier"), spec=spec, threads_per_worker=1))
        try:
            runs.append(eng.generate(PROMPTS[:1], PARAMS["plain"], n=2))
        finally:
            eng.close()
    assert seen and all(seen)
    assert all(r.stats["lossy"] for r in runs[0])
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
