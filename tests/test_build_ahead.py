"""The only draft starts the next round's build itself (DESIGN §4 SSD protocol).

Once its lookup has served the next proposal (a hit, or the neural backup it
drafted) and the lookup brought the next round's :class:`NextRound` plans,
a draft has everything the next build call will carry, so it runs that build
as soon as the lookup is answered. The build call still comes; it is answered
from the build already run only when its items are the same, field by field —
anything else is built as usual. These tests check that the build run ahead
is the very build the call asks for (same speculations, same q rows), that a
different call is built afresh, and that the engine uses it round after round
while staying token-exact.
"""

from __future__ import annotations

import pytest
import torch
from helpers import perturbed_checkpoint, save_tiny_checkpoint, torch_threads

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.engine.rounds import RoundLoop
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.messages import BuildItem, NextRound, Proposal, Timed, plan_for
from saguaro_ray.workers.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=50)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=50, seed=1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ahead_models")
    target = save_tiny_checkpoint(root, "llama", seed=3, max_position_embeddings=256)
    return {"target": target, "draft": perturbed_checkpoint(target, root / "draft", 0.1, seed=7)}


def _same_cache(a: DraftLogic, b: DraftLogic, seqs) -> None:
    """The two drafts hold the same speculations (tokens and q rows) for ``seqs``."""
    for s in seqs:
        keys = sorted(a.cache.keys(s))
        assert keys and keys == sorted(b.cache.keys(s))
        for k, t in keys:
            x, y = a.cache.lookup(s, k, t), b.cache.lookup(s, k, t)
            assert x.tokens == y.tokens
            assert (x.q is None) == (y.q is None) and (x.q is None or torch.equal(x.q, y.q))


def _round(a: DraftLogic, b: DraftLogic, items, round_id):
    """Build on both drafts; ``a`` may answer from a build started ahead.
    Returns both results and whether ``a``'s came from a build started ahead
    (it then reports the span that build ran as the call's :class:`Timed`)."""
    got_a, got_b = a.build(items, round_id), b.build(items, round_id)
    assert not isinstance(got_b, Timed)
    if isinstance(got_a, Timed):
        assert got_a.start <= got_a.end and got_a.value.pop("ahead") is True
        return got_a.value, got_b, True
    return got_a, got_b, False


def _admit(drafts, seqs: list[SequenceState]) -> None:
    """Prefill the prompts; the target's first token is ``seq_id + 20``."""
    for d in drafts:
        d.prefill([RoundLoop.step(s) for s in seqs])
    for s in seqs:
        s.output_ids.append(s.seq_id + 20)


def _item(s: SequenceState, proposal: Proposal, fanout: list[int], k_next: int) -> BuildItem:
    """The build item the round loop sends for ``s`` (its step, the proposal's tokens)."""
    return BuildItem(RoundLoop.step(s), Proposal(proposal.tokens, None, proposal.source), fanout, k_next)


def _outcome(s: SequenceState, proposal: list[int], k: int, t: int) -> tuple[int, int, int]:
    s.emit(proposal[:k] + [t], ())
    return (s.seq_id, k, t)


def test_a_build_started_ahead_is_the_build_the_call_asks_for(ckpts):
    """Both drafts get the same calls; ``a`` runs the follow-up work (the next
    build, once a lookup has been answered), ``b`` — like a worker host that
    ignores it — builds only when called. Same speculations and q rows; a call
    that differs from the plan (another fan-out) is built afresh, the same as
    ``b``'s."""
    a, b = (DraftLogic(ModelRunner(str(ckpts["draft"]))) for _ in range(2))
    seqs = [SequenceState(1, [3, 5, 7], GREEDY, 0), SequenceState(2, [4, 6, 8], SAMPLED, 1)]
    _admit((a, b), seqs)
    first = [Proposal([11, 12]), Proposal([13, 14])]
    got_a, got_b, ahead = _round(a, b, [_item(s, p, [2, 1, 1], 2) for s, p in zip(seqs, first)], 1)
    assert not ahead and got_a == got_b

    # round 1's outcomes: a hit for sequence 1, a miss (served by the neural backup) for sequence 2
    k1, t1 = sorted(a.cache.keys(1))[0]
    t2 = next(t for t in range(3, 200) if (0, t) not in a.cache.keys(2) and t != first[1].tokens[0])
    keys = [_outcome(seqs[0], first[0].tokens, k1, t1), _outcome(seqs[1], first[1].tokens, 0, t2)]
    plans = [NextRound(2, [2, 1, 1], "neural", [1, 1, 1]), NextRound(2, [1, 2, 1], "neural", [3, 0, 0])]
    res_a = a.lookup(keys, round_id=1, plans=plans)
    res_b = b.lookup(keys, round_id=1, plans=plans)
    work = a.follow_up()
    assert work is not None
    work()
    assert a.follow_up() is None
    hit, backup = res_a[0].proposal, res_a[1].backup
    assert hit is not None and hit.tokens == res_b[0].proposal.tokens
    assert res_a[1].proposal is None and backup is not None and backup.tokens == res_b[1].backup.tokens
    assert backup.q is not None  # the sampled sequence's backup carries its law

    second = [Proposal(hit.tokens[:2], None, "cache"), Proposal(backup.tokens, None, "neural")]
    got_a, got_b, ahead = _round(a, b, [_item(seqs[0], second[0], [2, 1, 1], 2), _item(seqs[1], second[1], [3, 0, 0], 2)], 2)
    assert ahead and got_a == got_b and got_a["branches"] > 0 and a.ahead_builds == a.ahead_started == 1
    _same_cache(a, b, (1, 2))

    # round 2: both hit; the lookup plans fan-out [1, 1], the call asks for [2, 1]
    found = [sorted(a.cache.keys(s.seq_id))[-1] for s in seqs]
    keys2 = [_outcome(s, p.tokens, k, t) for s, p, (k, t) in zip(seqs, second, found)]
    res_a = a.lookup(keys2, round_id=2, plans=[NextRound(1, [1, 1], "neural", [1, 1])] * 2)
    res_b = b.lookup(keys2, round_id=2, plans=[NextRound(1, [1, 1], "neural", [1, 1])] * 2)
    for x, y in zip(res_a, res_b):  # served from the build started ahead, q rows included
        assert x.proposal.tokens == y.proposal.tokens and x.rank == y.rank
        assert (x.proposal.q is None) == (y.proposal.q is None)
        assert x.proposal.q is None or torch.equal(x.proposal.q, y.proposal.q)
    a.follow_up()()
    third = [_item(s, Proposal(r.proposal.tokens[:1], None, "cache"), [2, 1], 1) for s, r in zip(seqs, res_a)]
    got_a, got_b, ahead = _round(a, b, third, 3)
    assert not ahead and got_a == got_b and a.ahead_builds == 1 and a.ahead_started == 2
    _same_cache(a, b, (1, 2))


def test_a_released_sequence_leaves_the_started_build_standing(ckpts):
    """A sequence that finished in the round leaves the next build call; the
    build started ahead still answers for the others."""
    a, b = (DraftLogic(ModelRunner(str(ckpts["draft"]))) for _ in range(2))
    seqs = [SequenceState(1, [3, 5, 7], GREEDY, 0), SequenceState(2, [4, 6, 8, 10], GREEDY, 1)]
    _admit((a, b), seqs)
    first = Proposal([11, 12])
    _round(a, b, [_item(s, first, [2, 1, 1], 2) for s in seqs], 1)
    keys = [_outcome(s, first.tokens, *sorted(a.cache.keys(s.seq_id))[0]) for s in seqs]
    res = a.lookup(keys, round_id=1, plans=[NextRound(2, [1, 1, 1], "neural", [1, 1, 1])] * 2)
    b.lookup(keys, round_id=1)
    assert all(r.proposal is not None for r in res)
    a.follow_up()()
    for d in (a, b):
        d.release([2])
    _, _, ahead = _round(a, b, [_item(seqs[0], Proposal(res[0].proposal.tokens[:2], None, "cache"), [1, 1, 1], 2)], 2)
    assert ahead  # (its branch count still includes the released sequence's)
    _same_cache(a, b, (1,))


def test_a_miss_gets_the_plans_backup_from_the_draft(ckpts):
    """With a plan, a miss is served in the lookup with the plan's backup: the
    fast one is the n-gram guess from the sequence's whole history — which
    the draft keeps from the calls it gets, so it is the guess the round loop
    would make from its own history — and K = 0 is an empty backup. The draft
    then builds ahead on it like on a hit."""
    from saguaro_ray.algorithms.ngram import ngram_guess

    draft = DraftLogic(ModelRunner(str(ckpts["draft"])))
    # repetitive prompts, so the guesses are not just the last token repeated
    seqs = [SequenceState(1, [3, 5, 7, 3, 5, 7, 3, 5], GREEDY, 0), SequenceState(2, [9, 8, 9, 8, 9], GREEDY, 1)]
    _admit([draft], seqs)
    proposals = [Proposal([40, 41]), Proposal([42, 43])]
    for round_id in (1, 2, 3):
        draft.build([_item(s, p, [1, 1, 1], 2) for s, p in zip(seqs, proposals)], round_id)
        # misses: t not cached for k = 1 (the first drafted token accepted)
        keys = []
        for s, p in zip(seqs, proposals):
            t = next(t for t in (5, 7, 8, 9, 3, 11, 12) if (1, t) not in draft.cache.keys(s.seq_id) and t != p.tokens[1])
            keys.append(_outcome(s, p.tokens, 1, t))
        k_next = [2, 0] if round_id == 3 else [2, 2]
        plans = [NextRound(k, [1] * (k + 1), "fast", [2] + [0] * k) for k in k_next]
        res = draft.lookup(keys, round_id=round_id, plans=plans)
        for s, r, k in zip(seqs, res, k_next):
            assert r.proposal is None and r.backup is not None and r.backup.source == "fast" and r.backup.q is None
            assert r.backup.tokens == ngram_guess(s.all_ids, k), (round_id, s.all_ids)
        assert draft.follow_up() is not None  # every next proposal is known: it builds ahead
        draft.follow_up()()
        proposals = [r.backup for r in res]
        got = draft.build([_item(s, p, [2] + [0] * k, k) for s, p, k in zip(seqs, proposals, k_next)], round_id + 1)
        assert isinstance(got, Timed)  # answered from the build started ahead


def test_a_plan_per_outcome_is_read_at_the_real_outcome(ckpts):
    """Near a length limit the next K depends on how many tokens the outcome
    emits: the lookup then carries one NextRound per outcome (entry k for k
    accepted) and the draft serves the miss, and builds ahead, with the real
    outcome's — here K = 1 after one accepted token, where another outcome
    would have left 2."""
    table = [NextRound(2, [1, 1, 1], "fast", [1, 1, 1]), NextRound(1, [1, 1], "fast", [2, 0]), NextRound(0, [1], "fast", [1])]
    assert [plan_for(table, k) for k in range(3)] == table and plan_for(table, 3) is None
    assert plan_for(table[0], 2) is table[0] and plan_for(None, 0) is None and plan_for(["junk"], 0) is None
    draft = DraftLogic(ModelRunner(str(ckpts["draft"])))
    s = SequenceState(1, [3, 5, 7, 3, 5, 7], GREEDY, 0)
    _admit([draft], [s])
    p = Proposal([40, 41])
    draft.build([_item(s, p, [1, 1, 1], 2)], 1)
    t = next(t for t in (5, 7, 9, 11) if (1, t) not in draft.cache.keys(1))
    [res] = draft.lookup([_outcome(s, p.tokens, 1, t)], round_id=1, plans=[table])
    assert res.proposal is None and len(res.backup.tokens) == 1
    draft.follow_up()()
    got = draft.build([_item(s, res.backup, [2, 0], 1)], 2)
    assert isinstance(got, Timed)  # the build started ahead with the chosen plan is the one asked for


def test_the_round_loop_plans_per_outcome_only_near_a_length_limit():
    """``_plans``: one NextRound where every outcome leaves the same K, one per
    outcome where it does not; the promise is narrowed to the real outcome's."""
    from saguaro_ray.workers.messages import Outcome

    loop = RoundLoop(SpeculationConfig(mode="ssd", k=3, fanout=(2, 1, 1, 1)), None, (), 1000)  # type: ignore[arg-type]
    far = SequenceState(1, [1, 2], SamplingParams(temperature=0.0, max_tokens=50), 0)
    near = SequenceState(2, [1, 2], SamplingParams(temperature=0.0, max_tokens=8), 0)
    far.output_ids, near.output_ids = [9] * 10, [9] * 2  # near: 6 left, and a round emits 1..4
    plans = loop._plans([far, near], [range(1, 5)] * 2, [3, 3], ["draft"], "fast")  # type: ignore[list-item]
    assert isinstance(plans[0], NextRound) and plans[0].k == 3
    assert isinstance(plans[1], list) and [n.k for n in plans[1]] == [3, 3, 2, 1]  # min(3, 8 - 2 - n - 1)
    assert [len(n.after_hit) for n in plans[1]] == [4, 4, 3, 2]
    loop._narrow_promised([far, near], [Outcome(1, 3, 5, 3), Outcome(2, 2, 5, 3)])
    assert loop._promised == {1: plans[0], 2: plans[1][2]}
    assert loop._plans([far], [range(1, 5)], [3], ["a", "b"], "fast") is None  # several drafts: no plans


def test_the_draft_keeps_each_sequence_history_from_its_calls(ckpts):
    """What the fast guess reads: a step rewrites what follows its start, a
    short gap is filled from its ``recent`` tokens, a longer one (or a first
    step that does not start at 0) leaves the history unknown — no guess —
    until the whole history is sent again."""
    from saguaro_ray.workers.messages import SeqStep

    draft = DraftLogic(ModelRunner(str(ckpts["draft"])))
    record = draft._record
    record([SeqStep(1, 0, [1, 2, 3], GREEDY, 0, 0)])
    record([SeqStep(1, 2, [7, 8], GREEDY, 0, 0, [1, 2])])  # rewrites position 2 on
    assert draft._history[1] == [1, 2, 7, 8]
    record([SeqStep(1, 6, [9], GREEDY, 0, 0, [8, 4, 5])])  # two tokens behind: taken from recent
    assert draft._history[1] == [1, 2, 7, 8, 4, 5, 9]
    record([SeqStep(1, 12, [9], GREEDY, 0, 0, [1, 2, 3, 4])])  # five behind: unknown
    assert 1 not in draft._history
    record([SeqStep(2, 4, [9], GREEDY, 0, 0, [1, 2, 3, 4])])  # never seen from its start
    assert 2 not in draft._history
    record([SeqStep(1, 0, [5, 6], GREEDY, 0, 0)])  # a full re-send
    assert draft._history[1] == [5, 6]


def _engine(ckpts, num_drafts: int = 1, build_ahead: bool = True, **spec) -> LocalEngine:
    return LocalEngine(
        EngineConfig(
            target=str(ckpts["target"]),
            draft=str(ckpts["draft"]),
            spec=SpeculationConfig(mode="ssd", **spec),
            threads_per_worker=1,
            num_drafts=num_drafts,
            build_ahead=build_ahead,
        )
    )


@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_the_only_draft_builds_ahead_round_after_round_and_stays_exact(ckpts, backup):
    """In process (the draft's follow-up runs on its worker thread): after the
    first speculative round the build starts ahead whenever every next
    proposal is known to the draft — a hit, or the backup (neural or fast)
    its lookup made; the output is AR's, token for token."""
    prompts = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ar = LocalEngine(EngineConfig(target=str(ckpts["target"]), spec=SpeculationConfig(mode="ar"), threads_per_worker=1))
    ssd = _engine(ckpts, k=3, backup=backup)
    try:
        expected = [r.token_ids for r in ar.generate(prompts, params)]
        firsts = []  # each call's first speculative round: its proposals are the round loop's backups
        for p, want in zip(prompts, expected):  # batch 1
            firsts.append(len(ssd.timeline) + 1)
            assert ssd.generate([p], params)[0].token_ids == want
        firsts.append(len(ssd.timeline) + 1)
        assert [r.token_ids for r in ssd.generate(prompts, params)] == expected  # batch 2
        timeline = ssd.timeline
        assert all(not timeline[i].ahead and timeline[i].build is not None for i in firsts)
        rounds = [r for r in timeline if not r.prefill and r.build is not None]
        ahead = [r for r in rounds if r.ahead]
        assert ssd.workers["draft"].logic.ahead_builds == len(ahead)
        # every miss got its backup from the draft's lookup: all other rounds start ahead
        assert len(rounds) - len(ahead) == len(firsts), [int(r.ahead) for r in rounds]
        for r in ahead:  # the span the build really ran
            assert r.build[0] <= r.build[1]
    finally:
        ar.close()
        ssd.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_fan_out_of_zero_is_speculative_decoding_through_the_ssd_round(ckpts, temperature):
    """With a fan-out of 0 the draft builds no speculation (its empty build
    still starts ahead), every lookup misses and drafts the neural backup,
    which is verified next: ordinary speculative decoding through the SSD
    round — backups drafted in the lookups the target placed, q rows over
    the data plane, plans, builds ahead. With the same seed its output is
    SD's token for token (the same proposals from the same laws and
    uniforms, the same verification draws), at T = 0 and at T > 0."""
    prompts = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70]]
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5, ignore_eos=True)
    sd = LocalEngine(EngineConfig(target=str(ckpts["target"]), draft=str(ckpts["draft"]), spec=SpeculationConfig(mode="sd", k=3), threads_per_worker=1))
    ssd = _engine(ckpts, k=3, fanout=(0, 0, 0, 0), backup="neural")
    try:
        expected = [r.token_ids for r in sd.generate(prompts, params)]
        assert [r.token_ids for r in ssd.generate(prompts[:1], params)] == expected[:1]  # batch 1
        assert [r.token_ids for r in ssd.generate(prompts, params)] == expected  # batch 2
        decode = [r for r in ssd.timeline if not r.prefill]
        assert decode and all(r.hits == 0 for r in decode) and sum(r.misses for r in decode) > 0
        assert len(ssd.workers["draft"].logic.cache) == 0
        assert sum(r.ahead for r in decode) >= len(decode) - 2  # all but each call's first round
    finally:
        sd.close()
        ssd.close()


def test_in_process_the_default_is_to_build_when_called(ckpts):
    """``EngineConfig.build_ahead`` is off by default in process (the GIL): the draft
    still makes the backups in its lookups, but builds only when called."""
    eng = LocalEngine(EngineConfig(target=str(ckpts["target"]), draft=str(ckpts["draft"]), spec=SpeculationConfig(mode="ssd", k=2), threads_per_worker=1))
    try:
        eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        rounds = [r for r in eng.timeline if r.build is not None]
        assert rounds and not any(r.ahead for r in rounds)
        assert eng.workers["draft"].logic.ahead_started == 0
    finally:
        eng.close()


def test_several_drafts_never_build_ahead(ckpts):
    """With several drafts each build needs the hit's KV delta from its owner,
    which only the next build call carries: no plans go out, nothing starts ahead."""
    eng = _engine(ckpts, num_drafts=2, k=2)
    try:
        eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        assert not any(r.ahead for r in eng.timeline)
        assert all(w.logic.ahead_builds == 0 for role, w in eng.workers.items() if role.startswith("draft"))
    finally:
        eng.close()
