"""One engine, a strategy per sequence (issue 19, DESIGN §5).

A batch mixing AR, SD, SSD and PyramidSD sequences is verified in one call
per round; each sequence's T = 0 tokens must equal AR's whatever its
neighbours run. ``auto`` sequences switch strategy and K between rounds
(forced here by a test policy that cycles them) and stay exact. A request
for a strategy the engine does not offer is refused with a message naming
the field, and nothing else in the batch is affected. The law at T > 0 is
tested in ``test_exactness_sampling.py``, the same over Ray in
``test_runtime.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import test_exactness_greedy

from saguaro_ray.algorithms.strategy_views import Choice, RoundCosts, SeqView
from saguaro_ray.config import SamplingParams, SpeculationConfig, Strategy
from saguaro_ray.engine import LocalEngine
from saguaro_ray.errors import ConfigError
from saguaro_ray.runtime.engine_config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

MAX_TOKENS = 20
PROMPTS: list[list[int]] = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [3], [44, 45, 46, 47, 48], [90, 12, 77, 31], [8, 9]]
STRATEGIES = [Strategy("ar"), Strategy("sd", 2), Strategy("ssd", 3), Strategy("pyramid"), Strategy("auto"), Strategy("sd", 5)]


class Cycling:
    """A test policy: every ``auto`` sequence runs AR, SD and SSD in turn
    with K = 1, 2, 3, each sequence in its own phase, so one round's batch
    mixes them and each sequence changes strategy every round. ``ar_first``
    rounds of AR come first (a draft that sat out many rounds must catch up)."""

    def __init__(self, ar_first: int = 0) -> None:
        self.rounds = 0
        self.ar_first = ar_first
        self.observed: list[RoundCosts] = []

    def choose(self, auto: list[SeqView], fixed: list[tuple[SeqView, Choice]] = ()) -> list[Choice]:  # type: ignore[assignment]
        self.rounds += 1
        out = []
        for v in auto:
            j = self.rounds + v.seq_id
            mode = "ar" if self.rounds <= self.ar_first else ("ar", "sd", "ssd")[j % 3]
            out.append(Choice(mode, 0 if mode == "ar" else 1 + (j // 3) % 3))
        return out

    def observe(self, costs: RoundCosts) -> None:
        self.observed.append(costs)


models = test_exactness_greedy.models


def greedy(strategy: Strategy | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, speculation=strategy)


@pytest.fixture(scope="module")
def ar_tokens(models) -> list[list[int]]:
    eng = LocalEngine(EngineConfig(target=str(models["target"]), spec=SpeculationConfig(mode="ar"), threads_per_worker=1))
    try:
        return [r.token_ids for r in eng.generate(PROMPTS, greedy())]
    finally:
        eng.close()


@pytest.fixture(scope="module")
def engine(models):
    """One engine for every strategy: target, draft and qualifier, ``auto`` by default."""
    eng = LocalEngine(
        EngineConfig(target=str(models["target"]), draft=str(models["good"]), qualifier=str(models["fair"]), threads_per_worker=1)
    )
    yield eng
    eng.close()


def test_a_batch_mixing_every_strategy_equals_ar_per_sequence(engine, ar_tokens):
    rounds_before = len(engine.timeline)
    res = engine.generate(PROMPTS, [greedy(s) for s in STRATEGIES])
    assert [r.token_ids for r in res] == ar_tokens
    assert [r.mode for r in res] == [s.mode for s in STRATEGIES]
    fixed = [(r, s) for r, s in zip(res, STRATEGIES) if s.mode != "auto"]
    for r, s in fixed:  # a fixed strategy ran every decode round in its own mode, with its K
        assert set(r.stats["strategy"]) == {s.mode}
        if s.k is not None:
            assert r.stats["mean_k"] == pytest.approx(s.k, abs=s.k)  # K, clipped near max_tokens
    mixed = [rec for rec in engine.timeline[rounds_before:] if not rec.prefill and len(rec.modes) >= 3]
    assert mixed, "no round verified sequences of three strategies at once"
    assert all(rec.batch == len(rec.accepted) for rec in mixed)  # one verification for the whole batch


def test_auto_switching_strategy_and_k_every_round_equals_ar(engine, ar_tokens):
    from saguaro_ray.engine.round_loop import CATCH_UP_TOKENS

    # AR rounds first: the drafts sit out more than RECENT_TOKENS (4) tokens, then catch up from
    # the next step's recent tokens — fewer than CATCH_UP_TOKENS, so no catch-up is sent ahead
    # (that path, whose timing is the draft's, is tested below)
    policy = Cycling(ar_first=CATCH_UP_TOKENS - 2)
    starts: list[tuple[int, int, int]] = []  # (seq, step start, output_pos) of every step the draft got
    draft = engine.workers["draft"].logic
    real_propose = draft.propose

    def spying_propose(steps, *args, **kw):
        starts.extend((st.seq_id, st.start, st.output_pos) for st in steps)
        return real_propose(steps, *args, **kw)

    assigner = engine.loop.assigner
    told: list[tuple[object, RoundCosts]] = []  # (round record, what the policy was told of it)
    real_observe = assigner.observe

    def spying_observe(running, rec):
        before = len(policy.observed)
        real_observe(running, rec)
        if len(policy.observed) > before:
            told.append((rec, policy.observed[-1]))

    assigner.policy, saved = policy, assigner.policy
    assigner.observe = spying_observe
    draft.propose = spying_propose
    try:
        res = engine.generate(PROMPTS, greedy(Strategy("auto", 3)))
    finally:
        assigner.policy = saved
        del assigner.observe
        draft.propose = real_propose
    assert [r.token_ids for r in res] == ar_tokens
    for r in res:
        assert set(r.stats["strategy"]) == {"ar", "sd", "ssd"}, r.stats["strategy"]
        assert 1 <= r.stats["mean_k"] <= 3
    # the draft caught up from the steps' recent tokens: never re-sent a history from 0
    assert starts and all(start > 0 for _, start, pos in starts if pos > 0)
    assert policy.observed and all(c.batch == len(c.seqs) for c in policy.observed)
    # an SSD round's lookup is on its critical path (a miss's backup is drafted in it): the
    # policy is told it as SSD's exposure, not as control plane
    looked_up = [(rec, c) for rec, c in told if c.ssd_batch and rec.lookup is not None]
    assert looked_up
    for rec, c in looked_up:
        assert c.ssd_exposed_s >= rec.lookup[1] - rec.lookup[0]
    assert all(c.ssd_exposed_s == 0.0 for _, c in told if not c.ssd_batch)
    # and when the build ended, from verification's start: what its overrun is predicted from
    built = [(rec, c) for rec, c in told if c.ssd_batch and rec.build is not None]
    assert built and all(c.ssd_build_s == pytest.approx(rec.build[1] - rec.verify[0]) for rec, c in built)
    assert all(math.isnan(c.ssd_build_s) for _, c in told if not c.ssd_batch)
    # each sequence's context is the tokens it held when the round started: its prompt and
    # what it had emitted, so a round's grows by what the round before emitted
    prompt_of = {}
    last: dict[int, object] = {}
    for _, c in told:
        for r in c.seqs:
            prompt_of.setdefault(r.seq_id, r.context)
            if r.seq_id in last:
                assert r.context == last[r.seq_id].context + last[r.seq_id].accepted + 1
            last[r.seq_id] = r
    assert sorted(prompt_of.values()) == sorted(len(p) + 1 for p in PROMPTS)  # the prefill's token held too


def test_requests_for_strategies_the_engine_does_not_offer_are_refused(models, ar_tokens):
    eng = LocalEngine(
        EngineConfig(
            target=str(models["target"]),
            draft=str(models["good"]),
            spec=SpeculationConfig(mode="auto", allow=("auto", "ar", "sd"), k=3, max_k=6),
            threads_per_worker=1,
        )
    )
    try:
        running = eng.frontend.stream(PROMPTS[0], greedy(Strategy("sd")))
        first = next(running)  # a request is in the batch while the bad ones arrive
        bad = {
            "speculation.mode": Strategy("ssd"),  # not allowed by this engine
            "speculation.k": Strategy("sd", 7),  # beyond max_k
        }
        for field, strategy in bad.items():
            with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
                eng.generate([PROMPTS[1]], greedy(strategy))
        with pytest.raises(ConfigError, match=r"speculation\.mode 'pyramid' needs a qualifier"):
            eng.generate([PROMPTS[1]], greedy(Strategy("pyramid")))
        rest = [c for c in running]
        assert first.token_ids + [t for c in rest for t in c.token_ids] == ar_tokens[0]
        assert [r.token_ids for r in eng.generate(PROMPTS[1:3], greedy())] == ar_tokens[1:3]
    finally:
        eng.close()


def test_the_request_strategy_is_validated_when_it_is_made():
    assert SamplingParams(speculation="ssd").speculation == Strategy("ssd")
    assert SamplingParams(speculation={"mode": "sd", "k": 3}).speculation == Strategy("sd", 3)
    for bad, field in [("fast", "speculation.mode"), ({"mode": "sd", "k": 0}, "speculation.k"), ({"mode": "ar", "k": 2}, "speculation.k"), ({"kk": 1}, "unknown")]:
        with pytest.raises(ConfigError, match=field):
            SamplingParams(speculation=bad)


class AlwaysAR(Cycling):
    def choose(self, auto, fixed=()):  # type: ignore[override]
        return [Choice("ar", 0) for _ in auto]


class ARThen(Cycling):
    """AR for ``ar_first`` rounds, then ``then`` (SD with K = 2 unless told).
    Before each choice it waits for the drafts' catch-ups in flight on
    ``loop``: a tiny in-process model's rounds outpace the draft's thread, so
    without the wait when the sequence may speculate again would be the
    threads' timing."""

    def __init__(self, ar_first: int, loop, then: Choice = Choice("sd", 2)) -> None:
        super().__init__(ar_first)
        self.loop = loop
        self.then = then

    def choose(self, auto, fixed=()):  # type: ignore[override]
        for futures in list(self.loop._catching_up.values()):
            for f in futures:
                f.exception()  # waits; a failed catch-up is the engine's to handle
        self.rounds += 1
        return [Choice("ar", 0) if self.rounds <= self.ar_first else self.then for _ in auto]


class AlwaysSD(Cycling):
    def choose(self, auto, fixed=()):  # type: ignore[override]
        return [Choice("sd", 8) for _ in auto]


def test_tokens_the_drafts_drafted_themselves_are_no_lag_to_catch_up(models, ar_tokens):
    """After an SD round that accepted all of K = 8 (the draft is the target)
    the drafts hold every emitted token but the bonus one: the next round
    speculates again. (Counted as a lag, the 9 tokens of such a round sent
    the drafts a catch-up and ran the next round AR: on the real model at
    batch 1, T = 0, auto ran AR 47 % of its rounds, 0.77x SD K = 6.)"""
    eng = LocalEngine(EngineConfig(target=str(models["target"]), draft=str(models["target"]), threads_per_worker=1))
    eng.loop.assigner.policy = AlwaysSD()
    try:
        [r] = eng.generate([PROMPTS[1]], greedy(Strategy("auto", 8)))
    finally:
        eng.close()
    assert r.token_ids == ar_tokens[1]
    assert r.stats["strategy"] == {"sd": r.stats["rounds"] - 1} and r.stats["mean_accepted"] > 7  # every round drafted ...
    assert eng.loop.catch_ups == 0  # ... from what the drafts held


def _spy_catch_ups(engine) -> tuple[list[int], object]:
    """Record the position each draft catch-up (a K = 0 propose) brings the draft to."""
    catch_ups: list[int] = []
    draft = engine.workers["draft"].logic
    real_propose = draft.propose

    def spying_propose(steps, ks, *args, **kw):
        if ks and not any(ks):
            catch_ups.extend(st.start + len(st.new_tokens) for st in steps)
        return real_propose(steps, ks, *args, **kw)

    draft.propose = spying_propose
    return catch_ups, real_propose


def test_an_auto_sequence_running_ar_leaves_its_drafts_idle(engine, ar_tokens):
    """While ``auto`` runs a sequence AR and never picks speculation, its
    drafts are sent nothing: on a shared device they would slow every round."""
    catch_ups, real_propose = _spy_catch_ups(engine)
    engine.loop.assigner.policy, saved = AlwaysAR(), engine.loop.assigner.policy
    try:
        [r] = engine.generate([PROMPTS[1]], greedy(Strategy("auto")))
    finally:
        engine.loop.assigner.policy = saved
        engine.workers["draft"].logic.propose = real_propose
    assert r.token_ids == ar_tokens[1] and r.stats["strategy"] == {"ar": MAX_TOKENS - 1}
    assert catch_ups == []


def test_a_switch_into_speculation_first_lets_the_drafts_catch_up_off_the_critical_path(engine, ar_tokens):
    """The first pick of SD after CATCH_UP_TOKENS or more AR rounds sends the
    drafts every token they missed (a K = 0 propose, not waited for) and runs
    that round AR; the sequence speculates once they have taken it, exactly."""
    from saguaro_ray.engine.round_loop import CATCH_UP_TOKENS

    ar_rounds = CATCH_UP_TOKENS + 2
    catch_ups, real_propose = _spy_catch_ups(engine)
    engine.loop.assigner.policy, saved = ARThen(ar_rounds, engine.loop), engine.loop.assigner.policy
    before = engine.loop.timeline.appended
    try:
        [r] = engine.generate([PROMPTS[1]], greedy(Strategy("auto", 2)))
    finally:
        engine.loop.assigner.policy = saved
        engine.workers["draft"].logic.propose = real_propose
    assert r.token_ids == ar_tokens[1]
    # the drafts took the prompt at prefill: the first SD pick sends them the prefill's token and ar_rounds more
    assert catch_ups and catch_ups[0] == len(PROMPTS[1]) + 1 + ar_rounds
    rounds = list(engine.loop.timeline)[-(engine.loop.timeline.appended - before) :]
    assert [rec.catch_up_sent for rec in rounds if rec.catch_up_sent] == [1 + ar_rounds]  # the round record says so
    assert r.stats["strategy"]["ar"] == ar_rounds + 1  # the pick that sent the catch-up ran AR, then SD ran
    assert r.stats["strategy"].get("sd", 0) > 0 and sum(r.stats["strategy"].values()) == r.stats["rounds"] - 1


def test_an_ssd_entry_after_a_few_ar_rounds_sends_the_drafts_what_they_missed(models, ar_tokens):
    """Fewer than CATCH_UP_TOKENS AR rounds leave the drafts a few tokens behind, to be
    sent with the next draft call; with a point-mass backup that call is the entry's
    build. The round's steps are made once and the build carries them: made again, a
    step holds only the last RECENT_TOKENS of what the drafts missed, the draft refuses
    it and the build is re-sent self-contained — the whole history re-prefilled on the
    round's critical path (SmolLM2 at batch 4 after 50 AR rounds: a 2.5 s build where
    one with a neural backup took 0.23)."""
    from saguaro_ray.engine.round_loop import CATCH_UP_TOKENS
    from saguaro_ray.workers.messages import RECENT_TOKENS, NeedsPrefillError

    ar_rounds = CATCH_UP_TOKENS - 1
    assert ar_rounds > RECENT_TOKENS + 1
    eng = LocalEngine(
        EngineConfig(target=str(models["target"]), draft=str(models["good"]), spec=SpeculationConfig(backup="fast"), threads_per_worker=1)
    )
    draft = eng.workers["draft"].logic
    refused: list[int] = []
    real_build = draft.build

    def build(items, *args, **kw):
        try:
            return real_build(items, *args, **kw)
        except NeedsPrefillError:
            refused.append(len(items))
            raise

    draft.build = build
    eng.loop.assigner.policy = ARThen(ar_rounds, eng.loop, Choice("ssd", 2))
    try:
        [r] = eng.generate([PROMPTS[1]], greedy(Strategy("auto", 2)))
    finally:
        eng.close()
    assert r.token_ids == ar_tokens[1]
    assert r.stats["strategy"]["ar"] == ar_rounds and r.stats["strategy"]["ssd"] > 0
    assert refused == []


class SSDCyclingK(Cycling):
    """SSD every round, K going 3, 1, 4, 2, 3, 1, ... (down as often as up)."""

    def choose(self, auto, fixed=()):  # type: ignore[override]
        self.rounds += 1
        return [Choice("ssd", (3, 1, 4, 2)[self.rounds % 4]) for _ in auto]


def test_an_ssd_sequence_whose_k_changes_is_built_for_what_is_verified(models, ar_tokens):
    """The speculation a lookup serves was built for the K its round planned;
    when ``auto`` verifies fewer of its tokens, the next build must branch
    off the tokens verified, not the ones planned. (Built for the planned
    ones, the likeliest outcome — all K accepted, then the speculation's own
    next token — is not in the tree: on the real model at batch 8 every
    lookup after a K decrease missed.) The draft is the target, so at T = 0
    every outcome is the one the tree covers first: every lookup hits."""
    eng = LocalEngine(EngineConfig(target=str(models["target"]), draft=str(models["target"]), threads_per_worker=1))
    eng.loop.assigner.policy = SSDCyclingK()
    try:
        [r] = eng.generate([PROMPTS[1]], greedy(Strategy("auto", 4)))
        rounds = [rec for rec in eng.timeline if not rec.prefill and rec.hits + rec.misses]
    finally:
        eng.close()
    assert r.token_ids == ar_tokens[1]
    assert r.stats["strategy"] == {"ssd": r.stats["rounds"] - 1}
    assert len({p for rec in rounds for p in rec.proposed}) >= 2  # what was verified changed length
    assert rounds and sum(rec.misses for rec in rounds) == 0, [(rec.proposed, rec.hits, rec.misses) for rec in rounds]


class AlwaysSSD(Cycling):
    """SSD at K = 3 for every auto sequence, every round."""

    def choose(self, auto, fixed=()):  # type: ignore[override]
        self.rounds += 1
        return [Choice("ssd", 3) for _ in auto]


def test_an_ssd_rounds_acceptance_is_told_with_what_served_its_proposal(engine, ar_tokens):
    """SSD looks up after verification, keyed on the round's outcome: a round's
    ``hit`` is that lookup's (it serves the next round), ``source`` what served the
    proposal the round verified — the last round's lookup (a hit: the cache), or a
    backup (a miss, an entry). Read as one, a round whose own lookup hit (mostly one
    that accepted every draft token) was filed as a hit's acceptance, and SD priced
    from that table looked better than it ran (docs/auto.md, session 30)."""
    policy = AlwaysSSD()
    engine.loop.assigner.policy, saved = policy, engine.loop.assigner.policy
    try:
        res = engine.generate(PROMPTS[:3], greedy(Strategy("auto", 3)))
    finally:
        engine.loop.assigner.policy = saved
    assert [r.token_ids for r in res] == ar_tokens[:3]
    last: dict[int, bool | None] = {}  # each sequence's last lookup
    pairs = []
    for c in policy.observed:
        for r in c.seqs:
            assert r.mode == "ssd" and r.source in ("cache", "neural", "fast")
            pairs.append((last.get(r.seq_id, False), r.source))
            last[r.seq_id] = r.hit
    assert all(before is None or before == (served == "cache") for before, served in pairs), pairs
    served = [s for _, s in pairs]
    assert "cache" in served and any(s != "cache" for s in served[len(res):]), pairs  # hits and misses both ran past the entries


class SSDStepsK(Cycling):
    """SSD every round at K 3, 3, 1, 1, 4, 4, 4, 2, 2, 4, 2, ... (held for a round or two between changes)."""

    KS = (3, 3, 1, 1, 4, 4, 4, 2, 2, 4, 2)

    def choose(self, auto, fixed=()):  # type: ignore[override]
        self.rounds += 1
        return [Choice("ssd", self.KS[(self.rounds - 1) % len(self.KS)]) for _ in auto]


def test_a_change_of_k_in_ssd_never_builds_the_tree_afresh(models, ar_tokens):
    """A build is made ahead, by the draft inside the lookup, for the K the round
    before chose; a round that verified fewer tokens than it assumed would lose the
    likeliest outcome and build the whole tree afresh on its critical path (the coder
    pair: 227 ms where a round took 240; docs/auto.md, session 31). So the K chosen
    goes into the round's plan, and what is verified is what the build made ahead
    assumed: a change of K shows a round or two late, costs no rebuild
    (``SeqResult.rebuilt`` stays False) and no miss — the draft is the target at
    T = 0, so every lookup the tree covers hits."""
    eng = LocalEngine(EngineConfig(target=str(models["target"]), draft=str(models["target"]), threads_per_worker=1))
    try:
        long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        [ar] = eng.generate([PROMPTS[1]], replace(long, speculation=Strategy("ar")))
        policy = SSDStepsK()
        eng.loop.assigner.policy = policy
        [r] = eng.generate([PROMPTS[1]], replace(long, speculation=Strategy("auto", 4)))
        rounds = [rec for rec in eng.timeline if not rec.prefill and rec.hits + rec.misses]
    finally:
        eng.close()
    assert r.token_ids == ar.token_ids
    seen = [(c.seqs[0].proposed, c.seqs[0].rebuilt) for c in policy.observed if c.seqs]
    assert not any(rebuilt for _, rebuilt in seen), seen
    assert rounds and all(rec.misses == 0 for rec in rounds), [(rec.proposed, rec.hits, rec.misses) for rec in rounds]
    # round i verifies the K of the tree made ahead in round i - 1 (the plan of round i - 2)
    # clipped to the plan of round i - 1: a lowered K a round late, a raised one two
    chosen = [SSDStepsK.KS[i % len(SSDStepsK.KS)] for i in range(len(seen))]
    verified = [k for k, _ in seen]
    expect = [min(chosen[i - 1], chosen[i - 2]) for i in range(2, len(seen) - 2)]  # the last rounds meet max_tokens
    assert verified[2:-2] == expect, (chosen, verified)
    # what the engine reports it built: the K chosen the round before (the plan the build was made from)
    built = [c.seqs[0].built for c in policy.observed if c.seqs]
    assert built[2:-2] == chosen[1:-3], (chosen, built)
    assert set(verified[:-2]) == {1, 2, 3, 4}  # K went 1 to 4 and back
