"""The logit-adjust hook (issue 21): every worker keeps the token ids behind
its KV (``TokenHistory``) and adjusts every row it verifies, drafts or ranks
from with that row's history — the proposed prefix or SSD branch included.

Checked here: the history follows the KV through every strategy (prefill,
verification, SD drafting, SSD builds, hits' KV deltas, rejections), and a
penalised request in a batch mixing every strategy equals AR with the same
penalty at T = 0 while its output differs from the unpenalised one. The
penalties' own definitions and the law at T > 0 are tested in
``test_penalties.py``.
"""

from __future__ import annotations

import pytest
import test_exactness_greedy
from engine_helpers import settle

from saguaro_ray.config import SamplingParams, Strategy
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [3], [44, 45, 46, 47, 48], [90, 12, 77, 31]]
STRATEGIES = [Strategy("ar"), Strategy("sd", 3), Strategy("ssd", 3), Strategy("pyramid"), Strategy("auto")]
PENALTY = dict(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.4, logit_bias=((7, 3.0), (11, -2.0)))

models = test_exactness_greedy.models


def params(strategy: Strategy | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculation=strategy, **kw)


def run(engine: LocalEngine, per_prompt: list[SamplingParams]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, per_prompt)]


@pytest.fixture(scope="module")
def engine(models):
    eng = LocalEngine(EngineConfig(target=str(models["target"]), draft=str(models["good"]), qualifier=str(models["fair"]), threads_per_worker=1))
    seen: list[tuple[str, int, list[int], int]] = []
    for role, worker in eng.workers.items():
        logic = worker.logic
        release = logic.release

        def checked(seq_ids, logic=logic, release=release, role=role):
            for s in seq_ids:
                if logic.runner.has_sequence(s):
                    seen.append((role, s, list(logic.history.tokens(s)), logic.runner.seq_len(s)))
            return release(seq_ids)

        logic.release = checked
    eng.released = seen
    yield eng
    eng.close()


def test_penalised_requests_in_a_mixed_batch_equal_ar_with_the_same_penalties(engine):
    ar_plain = run(engine, [params(Strategy("ar"))] * len(PROMPTS))
    ar_pen = run(engine, [params(Strategy("ar"), **PENALTY)] * len(PROMPTS))
    assert ar_pen != ar_plain  # the penalties change the output, so equality below means something
    mixed = run(engine, [params(s, **PENALTY) for s in STRATEGIES])
    assert mixed == ar_pen
    # penalised and plain sequences side by side: each keeps its own law
    half = [params(s, **PENALTY) if i % 2 else params(s) for i, s in enumerate(STRATEGIES)]
    assert run(engine, half) == [ar_pen[i] if i % 2 else ar_plain[i] for i in range(len(PROMPTS))]


def test_every_workers_history_follows_its_kv(engine):
    settle(engine)  # sequences of earlier tests are released (and recorded) before the count starts
    engine.released.clear()
    results = engine.generate(PROMPTS, [params(s, **PENALTY) for s in STRATEGIES])
    settle(engine)
    assert {role for role, *_ in engine.released} == set(engine.workers)  # every worker released sequences it held
    bad = [(role, s, len(h), kv) for role, s, h, kv in engine.released if len(h) != kv]
    assert not bad, f"history length != KV length (role, seq, history, kv): {bad}"
    # and the ids are the sequence's: all but the last round's tokens (at most K + 1, K up to
    # the largest an auto sequence may run) are committed; a worker that sat out rounds (the
    # qualifier beside SD) holds a shorter prefix
    last = engine.loop.spec.k_max + 1
    truth = [p + r.token_ids for p, r in zip(PROMPTS, results)]
    for role, s, h, _ in engine.released:
        assert any(h[: len(t) - last] == t[: min(len(h), len(t) - last)] for t in truth), f"{role} holds {h} for sequence {s}"
