"""The SSD protocol (DESIGN §4): what a round's build and lookup carry, and how
the answers are read (``saguaro_ray.workers.ssd_protocol``).

With one draft a lookup carries each sequence's :class:`NextRound`: a miss
gets its backup in the same call (the neural one drafted exactly as
``propose`` would), and, every next proposal known, the draft starts the next
round's build itself once the lookup is answered. The plan is made
before verification (the target places the lookup when verification ends)
and read at the real outcome (``resolve``). The build call still comes, made
by the round loop with the same function from the same plan; it says so
(``ahead``) and is answered from the build already run. These tests
check that the build run ahead is the very build the call asks for (same
speculations, same q rows), that a call made otherwise is built afresh, and
that the engine uses it round after round while staying token-exact."""

from __future__ import annotations

import pytest
import torch
from helpers import perturbed_checkpoint, save_tiny_checkpoint

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.workers import ssd_protocol
from saguaro_ray.engine.round_loop import RoundLoop
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import RoundRecord, round_components
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.messages import BuildItem, KVDelta, LookupResult, NextRound, Proposal, ProposalSource, SeqStep, Timed
from saguaro_ray.workers.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

GREEDY = SamplingParams(temperature=0.0, max_tokens=50)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=50, seed=1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssd_protocol_models")
    target = save_tiny_checkpoint(root, "llama", seed=3, max_position_embeddings=256)
    return {"target": target, "draft": perturbed_checkpoint(target, root / "draft", 0.1, seed=7)}


# ------------------------------------------------------------- the pure protocol
def test_clip_cuts_tokens_and_their_law_alike():
    q = torch.softmax(torch.randn(3, 5), -1)
    p = Proposal([1, 2, 3], q, ProposalSource.CACHE)
    short = ssd_protocol.clip(p, 2)
    assert short.tokens == [1, 2] and torch.equal(short.q, q[:2]) and short.source is ProposalSource.CACHE
    assert ssd_protocol.clip(p, 3) is p and ssd_protocol.clip(Proposal([4]), 0).tokens == []


def test_build_items_carry_tokens_only_and_the_peers_delta():
    step = SeqStep(1, 4, [9], GREEDY, 0, 3, [1, 2, 3, 4])
    delta = KVDelta(1, 4, [9, 5], [[5], [6]])
    p = Proposal([5, 6], torch.ones(2, 4), ProposalSource.CACHE)
    [item] = ssd_protocol.build_items([step], [p], [[2, 1, 1]], [2], 1, 2, [delta])
    assert item == BuildItem(step, Proposal([5, 6], None, ProposalSource.CACHE), [2, 1, 1], 2, 1, 2, delta)


def test_a_plan_read_at_the_outcome_is_the_round_loops_next_step():
    """``resolve``: with the round's step and proposal, the next step is what
    the round loop sends once the outcome is emitted; the next K, the
    fan-outs and the fast guess are the outcome's entry (near a length limit
    the K differs by outcome), or the one entry for every outcome."""
    from saguaro_ray.algorithms.ngram import ngram_guess

    s = SequenceState(3, [5, 6, 7, 5, 6], SAMPLED, 1)
    s.output_ids, s.rounds = [7, 5], 2  # two rounds emitted these
    step, tokens = RoundLoop.step(s), [6, 9]
    plan = NextRound([2, 1, 0], "fast", [[3, 1, 1], [2, 1], [1]], [[5, 0, 0], [4, 0], [2]], list(s.all_ids))
    r = ssd_protocol.resolve(plan, step, tokens, 1, 4)
    s.emit([6, 4], ())
    assert r.step == RoundLoop.step(s) and r.k == 1 and r.after_hit == [2, 1] and r.after_backup == [4, 0]
    assert r.guess == ngram_guess(s.all_ids, 1) and ssd_protocol.resolve(plan, step, tokens, 3, 4) is None
    hit = ssd_protocol.next_build_item(plan, step, tokens, 1, 4, Proposal([7, 6, 5], torch.ones(3, 4), ProposalSource.CACHE))
    assert hit == BuildItem(r.step, Proposal([7], None, ProposalSource.CACHE), [2, 1], 1)
    # a hit shorter than the plan's K (built before the policy raised it): the plan's fan-out is
    # over outcomes it does not have, so it is not the build item (the round loop builds afresh)
    at_0 = ssd_protocol.resolve(plan, step, tokens, 0, 4)
    assert at_0.k == 2 and len(at_0.after_hit) == 3
    assert ssd_protocol.next_build_item(plan, step, tokens, 0, 4, Proposal([7], torch.ones(1, 4), ProposalSource.CACHE)) is None
    guess = ssd_protocol.miss_backup(r)
    assert guess == Proposal(r.guess, None, ProposalSource.FAST)
    assert ssd_protocol.next_build_item(plan, step, tokens, 1, 4, guess) == BuildItem(r.step, guess, [4, 0], 1)
    assert ssd_protocol.miss_backup(ssd_protocol.resolve(plan, step, tokens, 2, 4)) == Proposal([], None, ProposalSource.FAST)  # K = 0
    every = NextRound([2], "neural", [[1, 1, 1]], [[2, 1, 0]])  # one entry: every outcome
    assert [ssd_protocol.resolve(every, step, tokens, k, 4).k for k in range(3)] == [2, 2, 2]
    assert ssd_protocol.resolve(every, step, tokens, 3, 4) is None  # more accepted than proposed
    assert ssd_protocol.miss_backup(ssd_protocol.resolve(every, step, tokens, 0, 4)) is None  # drafted by the draft


def test_read_answers_takes_the_first_hit_its_owner_and_the_first_known_rank():
    hit = Proposal([7], None, ProposalSource.CACHE)
    delta = KVDelta(2, 0, [7], [[1]])
    backup = Proposal([8], None, ProposalSource.NEURAL)
    first = [LookupResult(None, None), LookupResult(None, 4, backup=backup)]
    second = [LookupResult(hit, 2, delta), LookupResult(None, 9)]
    a, b = ssd_protocol.read_answers([first, second], [0, 1])
    assert (a.hit, a.owner, a.delta, a.rank, a.backup) == (hit, 1, delta, 2, None)
    assert (b.hit, b.owner, b.rank, b.backup) == (None, None, 4, backup)


def test_a_round_record_and_its_json_split_the_same_way():
    """The backup policy reads the record itself; the benchmarks its JSON: one rule."""
    rec = RoundRecord(0, 1, start=0.0, end=10.0, verify=(1.0, 4.0), build=(1.0, 6.0), lookup=(7.0, 8.0), draft=(0.0, 0.5))
    assert round_components(rec) == round_components(rec.to_json())
    assert round_components(rec)["draft_exposed"] == pytest.approx(0.5 + 2.0)


# ------------------------------------------------------- the draft's side of it
def _admit(drafts, seqs: list[SequenceState]) -> None:
    """Prefill the prompts; the target's first token is ``seq_id + 20`` (as
    the round loop's admission emits it: a round has run, so the next step
    sends only what the workers lack)."""
    for d in drafts:
        d.prefill([RoundLoop.step(s) for s in seqs])
    for s in seqs:
        s.output_ids.append(s.seq_id + 20)
        s.rounds += 1


def _item(s: SequenceState, proposal: Proposal, fanout: list[int], k_next: int) -> BuildItem:
    [item] = ssd_protocol.build_items([RoundLoop.step(s)], [proposal], [fanout], [k_next], 0, 1, [None])
    return item


def _miss(draft: DraftLogic, s: SequenceState, proposal: list[int], k: int) -> tuple[int, int, int]:
    """Emit an outcome (k accepted, then a t* the draft did not cache) and return its key."""
    t = next(t for t in range(3, 200) if (k, t) not in draft.cache.keys(s.seq_id) and (k >= len(proposal) or t != proposal[k]))
    s.emit(proposal[:k] + [t], ())
    return (s.seq_id, k, t)


def _plan(s: SequenceState, k: int, backup: str = "neural", after_hit=None, after_backup=None) -> NextRound:
    """The plan the round loop sends for ``s`` before verifying this round's
    proposal: the next K is ``k`` whatever the outcome."""
    hit, back = after_hit or [1] * (k + 1), after_backup or [1] * (k + 1)
    return NextRound([k], backup, [hit], [back], list(s.all_ids) if backup == "fast" else None)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_miss_gets_the_neural_backup_propose_would_draft(ckpts, params):
    """A lookup with a plan drafts the miss's backup in the same call: the
    same tokens as ``propose`` from the step the round loop sends next
    (another draft, same calls, no plan), and no law: the drafter-invariant
    rule reads tokens only."""
    a, b = (DraftLogic(ModelRunner(str(ckpts["draft"]))) for _ in range(2))
    s_a, s_b = (SequenceState(1, [3, 5, 7, 9], params, 0) for _ in range(2))
    _admit([a], [s_a])
    _admit([b], [s_b])
    p = Proposal([11, 12])
    for d, s in ((a, s_a), (b, s_b)):
        d.build([_item(s, p, [2, 1, 1], 2)], 1)
    plan = _plan(s_a, 3, after_backup=[1, 1, 1, 1])
    key = _miss(a, s_a, p.tokens, 1)
    s_b.emit(p.tokens[:1] + [key[2]], ())
    [got] = a.lookup([key], round_id=1, plans=[plan])
    [plain] = b.lookup([key], round_id=1)
    assert got.proposal is None and plain.proposal is None and plain.backup is None
    [want] = b.propose([RoundLoop.step(s_b)], [3])
    assert got.backup.source is ProposalSource.NEURAL and got.backup.tokens == want.tokens and len(want.tokens) == 3
    assert got.backup.q is None and want.q is None


def test_a_miss_gets_the_plans_fast_guess_or_nothing_at_k_zero(ckpts):
    """The fast backup is the round loop's own n-gram guess, carried by the
    plan (the draft keeps no history); K = 0 is an empty backup; a sequence
    this draft did not build for (it was restarted) gets none — the round
    loop serves that miss itself. The draft builds
    ahead on each backup like on a hit."""
    from saguaro_ray.algorithms.ngram import ngram_guess

    draft = DraftLogic(ModelRunner(str(ckpts["draft"])))
    seqs = [SequenceState(1, [3, 5, 7, 3, 5, 7, 3, 5], GREEDY, 0), SequenceState(2, [9, 8, 9, 8, 9], GREEDY, 1)]
    _admit([draft], seqs)
    p = Proposal([40, 41])
    draft.build([_item(s, p, [1, 1, 1], 2) for s in seqs], 1)
    steps = [RoundLoop.step(s) for s in seqs]
    plans = [_plan(seqs[0], 2, "fast"), _plan(seqs[1], 0, "fast")]
    keys = [_miss(draft, s, p.tokens, 1) for s in seqs]
    res = draft.lookup(keys, round_id=1, plans=plans)
    assert res[0].backup == Proposal(ngram_guess(seqs[0].all_ids, 2), None, ProposalSource.FAST)
    assert res[1].backup == Proposal([], None, ProposalSource.FAST)
    assert draft.after_reply() is not None  # every next proposal is known: it builds ahead
    draft.after_reply()()
    items = [ssd_protocol.next_build_item(plan, st, p.tokens, k, t, r.backup) for plan, st, (_, k, t), r in zip(plans, steps, keys, res)]
    assert isinstance(draft.build(items, 2, ahead=True), Timed)  # answered from the build started ahead
    stranger = SequenceState(99, [4, 4, 4], GREEDY, 0)  # never built here (this draft was restarted)
    draft.build([_item(seqs[0], Proposal([4]), [1, 1], 1)], 3)
    [r] = draft.lookup([(99, 0, 5)], round_id=3, plans=[_plan(stranger, 2)])
    assert r.proposal is None and r.backup is None and draft.after_reply() is None


def _round(a: DraftLogic, b: DraftLogic, items, round_id, ahead: bool = False):
    """Build on both drafts; ``a`` may answer from a build started ahead.
    Returns both results and whether ``a``'s came from a build started ahead
    (it then reports the span that build ran as the call's :class:`Timed`)."""
    got_a, got_b = a.build(items, round_id, ahead), b.build(items, round_id)
    assert not isinstance(got_b, Timed)
    if isinstance(got_a, Timed):
        assert got_a.start <= got_a.end and got_a.value.pop("ahead") is True
        return got_a.value, got_b, True
    return got_a, got_b, False


def _same_cache(a: DraftLogic, b: DraftLogic, seqs) -> None:
    """The two drafts hold the same speculations for ``seqs``."""
    for s in seqs:
        keys = sorted(a.cache.keys(s))
        assert keys and keys == sorted(b.cache.keys(s))
        for k, t in keys:
            x, y = a.cache.lookup(s, k, t), b.cache.lookup(s, k, t)
            assert x.tokens == y.tokens


def _hit(draft: DraftLogic, s: SequenceState, proposal: list[int], which: int = 0) -> tuple[int, int, int]:
    """Emit an outcome the draft cached (its ``which``-th) and return its key."""
    k, t = sorted(draft.cache.keys(s.seq_id))[which]
    s.emit(proposal[:k] + [t], ())
    return (s.seq_id, k, t)


def test_a_build_started_ahead_is_the_build_the_call_asks_for(ckpts):
    """Both drafts get the same calls; ``a`` runs the follow-up work (the next
    build, once a lookup has been answered), ``b`` — like a worker host that
    ignores it — builds only when called. Same speculations; a call
    not made from the plans (``ahead`` false) is built afresh, the same as ``b``'s."""
    a, b = (DraftLogic(ModelRunner(str(ckpts["draft"]))) for _ in range(2))
    seqs = [SequenceState(1, [3, 5, 7], GREEDY, 0), SequenceState(2, [4, 6, 8], SAMPLED, 1)]
    _admit((a, b), seqs)
    first = [Proposal([11, 12]), Proposal([13, 14])]
    got_a, got_b, ahead = _round(a, b, [_item(s, p, [2, 1, 1], 2) for s, p in zip(seqs, first)], 1, ahead=True)
    assert not ahead and got_a == got_b  # nothing was started ahead

    # round 1's outcomes: a hit for sequence 1, a miss (served by the neural backup) for sequence 2
    steps = [RoundLoop.step(s) for s in seqs]
    plans = [_plan(seqs[0], 2, after_hit=[2, 1, 1]), _plan(seqs[1], 2, after_backup=[3, 0, 0])]
    keys = [_hit(a, seqs[0], first[0].tokens), _miss(a, seqs[1], first[1].tokens, 0)]
    res_a = a.lookup(keys, round_id=1, plans=plans)
    res_b = b.lookup(keys, round_id=1, plans=plans)
    work = a.after_reply()
    assert work is not None
    work()
    assert a.after_reply() is None
    hit, backup = res_a[0].proposal, res_a[1].backup
    assert hit is not None and hit.tokens == res_b[0].proposal.tokens
    assert res_a[1].proposal is None and backup is not None and backup.tokens == res_b[1].backup.tokens
    assert backup.q is None and hit.q is None  # tokens alone: the drafter-invariant rule reads no law

    second = [ssd_protocol.next_build_item(plan, st, f.tokens, k, t, p) for plan, st, f, (_, k, t), p in zip(plans, steps, first, keys, (hit, backup))]
    assert second[0].proposal.tokens == hit.tokens[:2] and second[1].fanout == [3, 0, 0]
    got_a, got_b, ahead = _round(a, b, second, 2, ahead=True)
    assert ahead and got_a == got_b and got_a["branches"] > 0 and a.ahead_builds == a.ahead_started == 1
    _same_cache(a, b, (1, 2))

    # round 2: both hit; the call is made otherwise (another fan-out, ahead false): built afresh
    plans2 = [_plan(s, 1) for s in seqs]
    keys2 = [_hit(a, s, it.proposal.tokens, -1) for s, it in zip(seqs, second)]
    res_a = a.lookup(keys2, round_id=2, plans=plans2)
    res_b = b.lookup(keys2, round_id=2, plans=plans2)
    for x, y in zip(res_a, res_b):  # served from the build started ahead
        assert x.proposal.tokens == y.proposal.tokens and x.rank == y.rank
    a.after_reply()()
    third = [_item(s, Proposal(r.proposal.tokens[:1], None, ProposalSource.CACHE), [2, 1], 1) for s, r in zip(seqs, res_a)]
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
    step0 = RoundLoop.step(seqs[0])
    plans = [_plan(s, 2) for s in seqs]
    keys = [_hit(a, s, first.tokens) for s in seqs]
    res = a.lookup(keys, round_id=1, plans=plans)
    b.lookup(keys, round_id=1)
    assert all(r.proposal is not None for r in res)
    a.after_reply()()
    for d in (a, b):
        d.release([2])
    _, _, ahead = _round(a, b, [ssd_protocol.next_build_item(plans[0], step0, first.tokens, keys[0][1], keys[0][2], res[0].proposal)], 2, ahead=True)
    assert ahead  # (its branch count still includes the released sequence's)
    _same_cache(a, b, (1,))


def test_the_round_loop_plans_per_outcome_near_a_length_limit():
    """``_plans``: the next K of every outcome — the same far from a limit, one
    per outcome near it — and the fan-outs of each; several drafts get none."""
    loop = RoundLoop(SpeculationConfig(mode="ssd", k=3, fanout=(2, 1, 1, 1)), None, (), 1000)  # type: ignore[arg-type]
    far = SequenceState(1, [1, 2], SamplingParams(temperature=0.0, max_tokens=50), 0)
    near = SequenceState(2, [1, 2], SamplingParams(temperature=0.0, max_tokens=8), 0)
    far.output_ids, near.output_ids = [9] * 10, [9] * 2  # near: 6 left, and a round emits 1..4
    far.k = near.k = 3  # the K they run with (the round loop's assignment)
    plans = loop.strategies["ssd"]._plans([far, near], [Proposal([4, 5, 6])] * 2, [3, 3], "fast")  # type: ignore[attr-defined]
    assert plans[0].ks == [3] and plans[1].ks == [3, 3, 2, 1]  # one K for every outcome; min(3, 8 - 2 - n - 1)
    assert [len(f) for f in plans[1].after_hit] == [4, 4, 3, 2] and plans[1].history == near.all_ids


# ------------------------------------------------------------- whole rounds
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
        assert all(r.miss_backup is None for r in rounds)  # no backup was drafted after a lookup
    finally:
        ar.close()
        ssd.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_fan_out_of_zero_is_speculative_decoding_through_the_ssd_round(ckpts, temperature):
    """With a fan-out of 0 the draft builds no speculation (its empty build
    still starts ahead), every lookup misses and drafts the neural backup,
    which is verified next: ordinary speculative decoding through the SSD
    round — backups drafted in the lookups, q rows over the data plane,
    plans, builds ahead. With the same seed its output is SD's token for
    token (the same proposals from the same laws and uniforms, the same
    verification draws), at T = 0 and at T > 0."""
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
