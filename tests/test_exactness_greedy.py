"""Exactness at T = 0 (DESIGN §4, §8): SD, SSD and exact PyramidSD emit exactly
the tokens autoregressive decoding emits on the same target (fp32, CPU).

Every configuration is compared token for token with ``ar`` on the same
target, over ragged prompts, run both as one batch of several prompts and one
prompt at a time. The grid covers K, explicit and ``auto`` fan-outs (budgets
1, 4, 16; an all-zero fan-out that can never hit), Saguaro C, the three backup
policies, draft quality from useless (an unrelated random model) through
partial (the target with noise added to its weights) to perfect (the target
itself), PyramidSD's exact and assisted stage 1, a Qwen3 pair, EOS stops in
the middle of a round and lengths that are not a multiple of K + 1.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import perturbed_checkpoint, load_hf_model, save_tiny_checkpoint

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

MAX_TOKENS = 24
# ragged lengths 1 .. 40, distinct content
PROMPTS: list[list[int]] = [
    [5, 6, 7],
    [10, 20, 30, 40, 50, 60, 70],
    [3],
    [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54],
    [90, 12, 77, 31],
    [(17 * i + 4) % 120 + 3 for i in range(40)],
]
BATCH = PROMPTS[:5]  # the batch-size-5 call


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("greedy_models")
    target = save_tiny_checkpoint(root, "llama", seed=3)
    qwen = save_tiny_checkpoint(root, "qwen3", seed=3)
    return {
        "target": target,
        "perfect": target,  # the target as its own draft: every draft token is accepted
        "good": perturbed_checkpoint(target, root / "good", 0.05, seed=7),
        "fair": perturbed_checkpoint(target, root / "fair", 0.15, seed=8),
        "bad": save_tiny_checkpoint(root, "llama", seed=11),  # unrelated weights, same vocabulary
        "qwen_target": qwen,
        "qwen_draft": perturbed_checkpoint(qwen, root / "qwen_draft", 0.05, seed=9),
        "qwen_qualifier": perturbed_checkpoint(qwen, root / "qwen_qualifier", 0.02, seed=10),
    }


def greedy(max_tokens: int = MAX_TOKENS, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


class Reference:
    """AR outputs of one target, computed one prompt at a time and memoised."""

    def __init__(self, target: Path) -> None:
        self.engine = LocalEngine(EngineConfig(target=str(target), threads_per_worker=1))
        self._memo: dict[tuple, tuple[list[int], str]] = {}

    def __call__(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
        key = (tuple(prompt), params)
        if key not in self._memo:
            r = self.engine.generate([prompt], params)[0]
            self._memo[key] = (r.token_ids, r.finish_reason)
        return self._memo[key]


@pytest.fixture(scope="module")
def ref(models):
    refs = {"target": Reference(models["target"]), "qwen_target": Reference(models["qwen_target"])}
    yield refs
    for r in refs.values():
        r.engine.close()


def make_engine(
    models, mode: str, draft: str | None = None, qualifier: str | None = None, target: str = "target", num_drafts: int = 1, **spec
) -> LocalEngine:
    return LocalEngine(
        EngineConfig(
            target=str(models[target]),
            draft=None if draft is None else str(models[draft]),
            qualifier=None if qualifier is None else str(models[qualifier]),
            spec=SpeculationConfig(mode=mode, **spec),
            threads_per_worker=1,
            num_drafts=num_drafts,
        )
    )


def check_exact(engine: LocalEngine, reference: Reference, params: SamplingParams, prompts=BATCH, singles=True):
    """Batched call, then one call per prompt: both must reproduce AR exactly.
    Returns the batched results (for stats checks)."""
    where = f"mode={engine.mode} spec={engine.config.spec}"
    batched = engine.generate(prompts, params)
    assert len(batched) == len(prompts)
    for i, (prompt, res) in enumerate(zip(prompts, batched)):
        want, reason = reference(prompt, params)
        assert res.token_ids == want, f"{where}: batched prompt {i} {prompt[:8]}: got {res.token_ids}, AR {want}"
        assert res.finish_reason == reason, f"{where}: prompt {i} finish {res.finish_reason} vs AR {reason}"
        if params.ignore_eos:
            assert len(res.token_ids) == params.max_tokens
    if singles:
        for i, prompt in enumerate(prompts):
            res = engine.generate([prompt], params)[0]
            want, _ = reference(prompt, params)
            assert res.token_ids == want, f"{where}: alone prompt {i} {prompt[:8]}: got {res.token_ids}, AR {want}"
    return batched


def pooled_hit_rate(results) -> float:
    """Hit rate over all lookups of a batch (per-sequence rates weighted by lookups)."""
    rates = [r.stats["cache_hit_rate"] for r in results]
    assert all(x is not None for x in rates)
    return sum(rates) / len(rates)


# --------------------------------------------------------------------- AR itself


def test_ar_reference_is_transformers_greedy(models, ref):
    """Anchor: the AR reference equals transformers' greedy decoding."""
    hf = load_hf_model(models["target"])
    for prompt in (PROMPTS[0], PROMPTS[5]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
        assert ref["target"](prompt, greedy())[0] == out[0, len(prompt):].tolist()


def test_ar_batched_equals_alone(ref):
    eng = ref["target"].engine
    batched = eng.generate(PROMPTS, greedy())
    assert [r.token_ids for r in batched] == [ref["target"](p, greedy())[0] for p in PROMPTS]
    # the outputs are varied enough to be a real test (not one repeated token)
    assert all(len(set(r.token_ids)) >= 5 for r in batched)


# ----------------------------------------------------------------------------- SD


@pytest.mark.parametrize("draft", ["bad", "fair", "good", "perfect"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_sd_matches_ar(models, ref, k, draft):
    eng = make_engine(models, "sd", draft, k=k)
    try:
        res = check_exact(eng, ref["target"], greedy())
        if draft == "perfect":
            assert all(r.stats["mean_accepted"] >= k - 0.5 for r in res)
    finally:
        eng.close()


# ---------------------------------------------------------------------------- SSD


def fanouts(k: int) -> dict[str, dict]:
    """Named fan-out settings for speculation length ``k``."""
    mixed = {1: (3, 1), 3: (4, 2, 1, 1), 5: (4, 2, 1, 0, 1, 1)}[k]
    return {
        "budget1": dict(fanout=(1,) + (0,) * k),
        "mixed": dict(fanout=mixed),
        "last_only": dict(fanout=(0,) * k + (1,)),
        "auto1": dict(fanout="auto", budget=1),
        "auto4": dict(fanout="auto", budget=4),
        "auto16": dict(fanout="auto", budget=16),
    }


SSD_GRID = [
    (k, fo, backup, draft)
    for k in (1, 3, 5)
    for fo in ("budget1", "mixed", "last_only", "auto1", "auto4", "auto16")
    for backup, draft in (("neural", "good"), ("fast", "fair"), ("auto", "good"))
]


@pytest.mark.parametrize("k, fo, backup, draft", SSD_GRID)
def test_ssd_matches_ar(models, ref, k, fo, backup, draft):
    eng = make_engine(models, "ssd", draft, k=k, backup=backup, **fanouts(k)[fo])
    try:
        res = check_exact(eng, ref["target"], greedy(), singles=(fo in ("mixed", "auto4")))
        assert all(0.0 <= r.stats["cache_hit_rate"] <= 1.0 for r in res)
    finally:
        eng.close()


@pytest.mark.parametrize("num_drafts", [2, 3])
@pytest.mark.parametrize("k, fo, draft", [(1, "mixed", "good"), (3, "auto4", "fair"), (5, "mixed", "good"), (3, "budget1", "bad")])
def test_ssd_several_drafts_match_ar(models, ref, num_drafts, k, fo, draft):
    """D drafts deal the outcome set out between them and pass each hit's KV
    delta to the others: still exactly AR, at any speculation length."""
    eng = make_engine(models, "ssd", draft, k=k, backup="neural", num_drafts=num_drafts, **fanouts(k)[fo])
    try:
        check_exact(eng, ref["target"], greedy(), singles=False)
    finally:
        eng.close()


def test_several_drafts_raise_hit_rate_and_share_kv(models, ref):
    """Same per-draft budget: two drafts cover twice the outcomes, so more
    lookups hit; hits hand their KV delta to the peer, so the drafts forward
    far fewer glue tokens per build than without deltas."""
    rates, glue = {}, {}
    for d in (1, 2):
        # a fixed fan-out: the same budget per draft whatever the timing (D drafts deal D times as many)
        eng = make_engine(models, "ssd", "fair", k=3, backup="neural", fanout=(1, 0, 0, 1), num_drafts=d)
        try:
            res = check_exact(eng, ref["target"], greedy(), singles=False)
            rates[d] = pooled_hit_rate(res)
            drafts = [w.logic for role, w in eng.workers.items() if role.startswith("draft")]
            builds = sum(1 for r in eng.timeline if r.build is not None)
            glue[d] = sum(x.glue_tokens for x in drafts) / (builds * d * len(BATCH))
        finally:
            eng.close()
    assert rates[2] > rates[1] + 0.05, rates
    # without deltas every build forwards all k+1 = 4 glue tokens of a sequence;
    # after a hit (the owner's, or a peer's delta) it forwards at most one
    for d in (1, 2):
        assert glue[d] <= (1 - rates[d]) * 4 + rates[d] + 0.1, (d, rates, glue)


@pytest.mark.parametrize("backup", ["neural", "fast", "auto"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ssd_forced_all_miss(models, ref, k, backup):
    """Budget 1 with an unrelated draft: (almost) every lookup misses, every
    round is served by the backup — and the tokens are still AR's."""
    eng = make_engine(models, "ssd", "bad", k=k, backup=backup, fanout="auto", budget=1)
    try:
        res = check_exact(eng, ref["target"], greedy(), singles=False)
        assert pooled_hit_rate(res) <= 0.15, [r.stats for r in res]
    finally:
        eng.close()


@pytest.mark.parametrize("draft", ["perfect", "good"])
@pytest.mark.parametrize("k", [1, 3])
def test_ssd_zero_fanout_never_hits(models, ref, k, draft):
    """An all-zero fan-out builds nothing: every lookup misses (even with the
    target as draft), and the neural backup still reproduces AR."""
    eng = make_engine(models, "ssd", draft, k=k, fanout=(0,) * (k + 1), backup="neural")
    try:
        res = check_exact(eng, ref["target"], greedy(), singles=False)
        assert all(r.stats["cache_hit_rate"] == 0.0 for r in res)
        if draft == "perfect":
            assert all(r.stats["mean_accepted"] >= k - 0.5 for r in res)
        # the only draft drafts each miss's backup inside the lookup: a separate
        # propose call is left only for a newly admitted sequence's first round
        recs = list(eng.timeline)
        assert sum(1 for r in recs if not r.prefill and r.draft is not None) <= sum(r.prefill for r in recs)
        assert sum(1 for r in recs if r.backup == "neural" and r.draft is None) >= len(recs) // 2
    finally:
        eng.close()


def _perfect_mean_accepted(k: int, max_tokens: int) -> float:
    """Mean accepted length when every proposed token is accepted: the first
    round samples one token, then rounds propose min(K, tokens left - 1)."""
    out, accepted = 1, []
    while out < max_tokens:
        n = min(k, max_tokens - out - 1)
        if n > 0:
            accepted.append(n)
        out += n + 1
    return sum(accepted) / len(accepted)


@pytest.mark.parametrize(
    "fo, backup",
    # (an explicit last-only fan-out with fast backups would never hit: a fast
    # guess is rejected at k = 0, where that fan-out caches nothing)
    [("last_only", "neural"), ("auto4", "neural"), ("auto16", "neural"), ("auto4", "fast"), ("auto16", "fast")],
)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ssd_mostly_hit(models, ref, k, fo, backup):
    """Draft = target: the real outcome (all K accepted, bonus = the draft's own
    argmax) is always cached, so lookups hit and every proposal is accepted."""
    # long enough that the forced miss of the first round (and, with fast
    # backups, the miss after a partly accepted point-mass guess) is diluted
    max_tokens = 64
    eng = make_engine(models, "ssd", "perfect", k=k, backup=backup, **fanouts(k)[fo])
    try:
        res = check_exact(eng, ref["target"], greedy(max_tokens), singles=False)
        for r in res:
            assert r.stats["cache_hit_rate"] >= 0.9, (k, fo, backup, r.stats)
            if backup == "neural":  # every speculation comes from the target itself
                assert r.stats["mean_accepted"] == pytest.approx(_perfect_mean_accepted(k, max_tokens)), r.stats
            assert r.stats["mean_accepted"] >= (k - 0.5 if backup == "neural" else k - 1.5), r.stats
    finally:
        eng.close()


# ------------------------------------------------------------------------ pyramid


PYRAMID_GRID = [
    (stage1, lq, ld, draft, qualifier)
    for stage1 in ("exact", "assisted")
    for lq, ld in ((4, 2), (3, 5), (1, 1), (5, 3))
    for draft, qualifier in (("bad", "good"), ("fair", "good"), ("good", "perfect"))
]


@pytest.mark.parametrize("stage1, lq, ld, draft, qualifier", PYRAMID_GRID)
def test_pyramid_matches_ar(models, ref, stage1, lq, ld, draft, qualifier):
    eng = make_engine(models, "pyramid", draft, qualifier, stage1=stage1, stage2="exact", lq=lq, ld=ld)
    try:
        res = check_exact(eng, ref["target"], greedy(), singles=(lq, ld) == (4, 2))
        assert all(r.stats["lossy"] is False for r in res)
    finally:
        eng.close()


# ----------------------------------------------------------- another architecture


@pytest.mark.parametrize(
    "mode, spec",
    [
        ("sd", dict(k=3)),
        ("ssd", dict(k=3, fanout="auto", budget=4, backup="neural")),
        ("ssd", dict(k=2, fanout=(2, 1, 1), backup="fast")),
        ("ssd", dict(k=4, fanout="auto", budget=16, backup="auto")),
        ("pyramid", dict(stage1="exact", lq=4, ld=2)),
        ("pyramid", dict(stage1="assisted", lq=3, ld=2)),
    ],
)
def test_qwen3_pair_matches_ar(models, ref, mode, spec):
    eng = make_engine(models, mode, "qwen_draft", "qwen_qualifier", target="qwen_target", **spec)
    try:
        res = check_exact(eng, ref["qwen_target"], greedy())
        if mode != "pyramid":
            assert any(r.stats["mean_accepted"] > 0 for r in res)  # the pair really speculates
    finally:
        eng.close()


# -------------------------------------------------------------------- lengths, EOS


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 17, 23])
@pytest.mark.parametrize(
    "mode, spec, draft",
    [
        ("sd", dict(k=3), "good"),
        ("ssd", dict(k=3, fanout=(4, 2, 1, 1)), "good"),
        ("ssd", dict(k=5, fanout="auto", budget=4, backup="fast"), "perfect"),
        ("ssd", dict(k=3, fanout="auto", budget=4), "perfect"),
        ("pyramid", dict(lq=4, ld=3), "fair"),
    ],
)
def test_lengths_not_multiple_of_k_plus_1(models, ref, mode, spec, draft, max_tokens):
    """With ignore_eos the output has exactly max_tokens tokens, also when a
    round's K + 1 would overshoot (speculation is clipped, not truncated late)."""
    eng = make_engine(models, mode, draft, "good", **spec)
    try:
        check_exact(eng, ref["target"], greedy(max_tokens), singles=False)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def eos_models(models, ref, tmp_path_factory):
    """The same target weights with a second EOS id: a token that AR emits in
    the middle of several outputs, so generation stops inside a round."""
    counts = Counter()
    for p in PROMPTS:
        counts.update(ref["target"](p, greedy())[0][2:-3])
    eos = next(t for t, _ in counts.most_common() if t != 2)
    root = tmp_path_factory.mktemp("eos_models")
    target = save_tiny_checkpoint(root, "llama", seed=3, eos_token_id=[2, eos])
    return {
        "target": target,
        "perfect": target,
        "good": perturbed_checkpoint(target, root / "good", 0.05, seed=7),
        "bad": save_tiny_checkpoint(root, "llama", seed=11, eos_token_id=[2, eos]),
        "eos": eos,
    }


@pytest.mark.parametrize(
    "mode, spec, draft",
    [
        ("sd", dict(k=3), "good"),
        ("sd", dict(k=5), "perfect"),
        ("ssd", dict(k=3, fanout=(4, 2, 1, 1)), "good"),
        ("ssd", dict(k=5, fanout="auto", budget=8), "perfect"),
        ("ssd", dict(k=3, fanout="auto", budget=1, backup="fast"), "bad"),
        ("pyramid", dict(lq=4, ld=2), "good"),
        ("pyramid", dict(lq=3, ld=3, stage1="assisted"), "bad"),
    ],
)
def test_stops_at_eos_like_ar(eos_models, mode, spec, draft):
    reference = Reference(eos_models["target"])
    eng = make_engine(eos_models, mode, draft, "good", **spec)
    try:
        params = greedy(ignore_eos=False)
        res = check_exact(eng, reference, params, prompts=PROMPTS)
        stopped = [r for r in res if r.finish_reason == "stop"]
        assert len(stopped) >= 2, "the EOS variant should stop several prompts early"
        for r in stopped:
            assert r.token_ids[-1] == eos_models["eos"] or r.token_ids[-1] == 2
            assert len(r.token_ids) < MAX_TOKENS
    finally:
        eng.close()
        reference.engine.close()


def test_engine_reuse_across_calls_stays_exact(models, ref):
    """Several generate calls on one SSD engine (stale cache entries and
    sequence ids from earlier calls must never leak into later ones)."""
    eng = make_engine(models, "ssd", "good", k=3, fanout="auto", budget=4)
    try:
        for _ in range(2):
            check_exact(eng, ref["target"], greedy(), prompts=PROMPTS)
            check_exact(eng, ref["target"], greedy(11), prompts=PROMPTS[::-1], singles=False)
    finally:
        eng.close()


def test_mixed_greedy_and_sampled_batch_in_ssd(tmp_path):
    """One batch holding T = 0 and T > 0 samples: every one equals AR's, the
    sampled one too (its seed fixes its tokens in every strategy and batch)."""
    from saguaro_ray.config import SamplingParams, SpeculationConfig
    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.engine_config import EngineConfig

    target = save_tiny_checkpoint(tmp_path, "llama", seed=0, max_position_embeddings=256)
    draft = perturbed_checkpoint(target, tmp_path / "draft", 0.1, seed=3)
    prompts = [[3, 5, 7], [9, 1], [4, 4, 2, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # the sampled one ends sooner, so its speculation shrinks while the greedy ones keep K
    sampled = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=4)
    ar = LocalEngine(EngineConfig(target=str(target), threads_per_worker=1))
    ssd = LocalEngine(EngineConfig(target=str(target), draft=str(draft), spec=SpeculationConfig(mode="ssd", k=3, budget=4), threads_per_worker=1))
    try:
        mixed = ssd.generate(prompts, [greedy, sampled, greedy])
        ref = ar.generate(prompts, greedy)
        assert mixed[0].token_ids == ref[0].token_ids and mixed[2].token_ids == ref[2].token_ids
        assert len(mixed[1].token_ids) == 7
        assert mixed[1].token_ids == ar.generate([prompts[1]], sampled)[0].token_ids
    finally:
        ar.close()
        ssd.close()


def test_draft_ships_laws_only_where_a_fuzzy_stage_reads_them(tmp_path):
    """The drafter-invariant rule compares tokens, so proposals and cached
    speculations carry no law; asked ``with_laws`` (a fuzzy PyramidSD stage 1),
    a sampled proposal carries one row per token, the law its race winner was
    drawn from, and a greedy one stays a point mass (q None) even when the
    batch drafts the two to different depths."""
    from saguaro_ray.config import SamplingParams
    from saguaro_ray.workers.draft import DraftLogic
    from saguaro_ray.workers.messages import BuildItem, Proposal, SeqStep
    from saguaro_ray.workers.runner import ModelRunner

    ckpt = save_tiny_checkpoint(tmp_path, "llama", seed=0, max_position_embeddings=256)
    draft = DraftLogic(ModelRunner(str(ckpt)))
    greedy = SamplingParams(temperature=0.0, max_tokens=50)
    sampled = SamplingParams(temperature=1.0, max_tokens=50, seed=1)
    steps = [SeqStep(1, 0, [3, 5, 7, 9], greedy, 0, 0), SeqStep(2, 0, [4, 6, 8], sampled, 1, 0)]
    proposals = draft.propose(steps, [3, 1])  # different depths: step 2 drafts only the greedy one
    assert [p.q for p in proposals] == [None, None] and [len(p.tokens) for p in proposals] == [3, 1]
    again = DraftLogic(ModelRunner(str(ckpt)))
    with_laws = again.propose(steps, [3, 1], with_laws=True)
    assert [p.tokens for p in with_laws] == [p.tokens for p in proposals]  # the same race winners
    assert with_laws[0].q is None and with_laws[1].q is not None and with_laws[1].q.shape[0] == 1
    draft.build([
        BuildItem(SeqStep(1, 4, [proposals[0].tokens[0]], greedy, 0, 1), Proposal(proposals[0].tokens[1:]), [2, 1, 1], 3),
        BuildItem(SeqStep(2, 3, [proposals[1].tokens[0]], sampled, 1, 1), Proposal([]), [2], 1),
    ])
    keys = [(1, k, t) for (k, t) in draft.cache.keys(1)] + [(2, k, t) for (k, t) in draft.cache.keys(2)]
    assert {s for s, _, _ in keys} == {1, 2}
    for seq, k, t in keys:  # a cached speculation is its tokens (Speculation has no law)
        assert len(draft.cache.lookup(seq, k, t).tokens) == (3 if seq == 1 else 1)


def test_lookup_for_another_round_than_the_built_one_misses(tmp_path):
    """The round loop sends a lookup without waiting for its build (the draft
    runs them in order); if a lookup ever reaches the draft before its round's
    build — a build re-sent after a restart, or one that failed — it must not
    serve the previous round's speculations: it answers misses, which are
    always exact, and commits nothing."""
    from saguaro_ray.config import SamplingParams
    from saguaro_ray.workers.draft import DraftLogic
    from saguaro_ray.workers.messages import BuildItem, Proposal, SeqStep
    from saguaro_ray.workers.runner import ModelRunner

    ckpt = save_tiny_checkpoint(tmp_path, "llama", seed=0, max_position_embeddings=256)
    draft = DraftLogic(ModelRunner(str(ckpt)))
    greedy = SamplingParams(temperature=0.0, max_tokens=50)
    draft.prefill([SeqStep(1, 0, [3, 5, 7, 9], greedy, 0, 0)])
    draft.build([BuildItem(SeqStep(1, 3, [9], greedy, 0, 1), Proposal([11, 12]), [2, 1, 1], 2)], round_id=7)
    keys = [(1, k, t) for (k, t) in draft.cache.keys(1)]
    assert keys
    stale = draft.lookup(keys[:1], round_id=6)
    assert stale[0].proposal is None and stale[0].rank is None
    assert 1 not in draft._own  # no hit's branch was committed
    served = draft.lookup(keys[:1], round_id=7)
    assert served[0].proposal is not None and served[0].proposal.source == "cache"
    assert 1 in draft._own  # the hit's branch is now part of the sequence


def test_draft_shards_build_disjoint_outcomes_that_cover_the_fan_out(tmp_path):
    """With D drafts each builds the candidates dealt to its shard: the outcome
    sets (k, t) are disjoint, together they are exactly what one draft builds
    for the whole fan-out, and each is the draft's j-th ranked token of row k
    (the drafted token left out) — every draft ranks a row the same way."""
    from saguaro_ray.algorithms.fanout import deal_candidates
    from saguaro_ray.config import SamplingParams
    from saguaro_ray.workers.draft import DraftLogic
    from saguaro_ray.workers.messages import BuildItem, Proposal, SeqStep
    from saguaro_ray.workers.runner import ModelRunner

    ckpt = save_tiny_checkpoint(tmp_path, "llama", seed=0, max_position_embeddings=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=50)
    fanout = [3, 2, 1, 2]
    built = []
    for shard, shards in [(0, 1), (0, 3), (1, 3), (2, 3)]:
        draft = DraftLogic(ModelRunner(str(ckpt)))
        draft.prefill([SeqStep(1, 0, [3, 5, 7, 9], greedy, 0, 0)])
        draft.build([BuildItem(SeqStep(1, 3, [9], greedy, 0, 1), Proposal([11, 12, 13]), fanout, 2, shard, shards)])
        built.append(set(draft.cache.keys(1)))
        if shards == 1:  # the glue rows the whole fan-out was ranked from
            rows = [row.source.clone() for row in draft._rankings[1]]
    whole, parts = built[0], built[1:]
    assert len(whole) == sum(fanout)
    assert all(not (a & b) for i, a in enumerate(parts) for b in parts[i + 1 :])
    assert set().union(*parts) == whole
    drafted = [11, 12, 13, None]
    for k, row in enumerate(rows):
        order = [t for t in torch.argsort(row, descending=True, stable=True).tolist() if t != drafted[k]]
        assert {t for kk, t in whole if kk == k} == set(order[: fanout[k]])
    assert len(deal_candidates(fanout, len(fanout), 0, 3)) == len(built[1])
