"""Fan-out allocation and its online estimator, the speculation cache, the backup policy."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from saguaro_ray.algorithms.backup import BackupPolicy, BackupStats, expected_speedup
from saguaro_ray.algorithms.cache import Speculation, SpeculationCache
from saguaro_ray.algorithms.fanout import (
    FanoutEstimator,
    fit_power_law,
    geometric_fanout,
    geometric_weights,
    largest_remainder,
    parse_fanout,
)
from saguaro_ray.errors import ConfigError


# ------------------------------------------------------------------ fan-out

def _formula(k: int, a: float, r: float) -> list[float]:
    e = 1 / (1 + r)
    w = [a ** (j * e) for j in range(k)] + [a ** (k * e) * (1 - a) ** (-e)]
    return [x / sum(w) for x in w]


@pytest.mark.parametrize(
    "budget,k,a,r",
    [(0, 3, 0.7, 1.0), (1, 3, 0.7, 1.0), (16, 0, 0.5, 1.0), (16, 4, 0.7, 1.0), (37, 6, 0.9, 0.3),
     (64, 8, 0.1, 2.0), (10, 3, 0.0, 1.0), (10, 3, 1.0, 1.0), (100, 12, 0.99, 0.01), (7, 2, 0.5, 50.0)],
)
def test_geometric_fanout_sums_to_budget_and_follows_the_formula(budget, k, a, r):
    f = geometric_fanout(budget, k, a, r)
    assert len(f) == k + 1 and sum(f) == budget
    assert all(isinstance(x, int) and x >= 0 for x in f)
    a_c = min(max(a, 1e-6), 1 - 1e-6)
    shares = [budget * s for s in _formula(k, a_c, r)]
    assert all(abs(x - s) < 1 for x, s in zip(f, shares))  # largest-remainder rounding


@pytest.mark.parametrize("a,r", [(0.3, 0.5), (0.7, 1.0), (0.9, 2.0)])
def test_geometric_proportions_before_rounding(a, r):
    w = geometric_weights(5, a, r)
    assert [x / sum(w) for x in w] == pytest.approx(_formula(5, a, r), rel=1e-12)
    big = geometric_fanout(10**7, 5, a, r)
    assert [x / 10**7 for x in big] == pytest.approx(_formula(5, a, r), abs=1e-6)


def test_higher_acceptance_shifts_budget_to_later_k():
    def mean_k(a):
        f = geometric_fanout(10**6, 6, a, 1.0)
        return sum(j * x for j, x in enumerate(f)) / 10**6

    means = [mean_k(a) for a in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert means == sorted(means) and means[0] < means[-1]
    shares0 = [geometric_fanout(1000, 6, a, 1.0)[0] for a in (0.1, 0.5, 0.9)]
    assert shares0[0] > shares0[1] > shares0[2]


def test_degenerate_inputs_fall_back_to_uniform_or_raise():
    assert geometric_fanout(10, 4, float("nan"), 1.0) == [2, 2, 2, 2, 2]
    assert geometric_fanout(11, 4, 0.5, float("inf")) == [3, 2, 2, 2, 2]
    assert geometric_fanout(5, 4, 0.5, -1.0) == [1, 1, 1, 1, 1]
    assert largest_remainder([0.0, 0.0], 3) == [2, 1]
    assert geometric_fanout(0, 0, 0.5, 1.0) == [0]
    with pytest.raises(ConfigError):
        geometric_fanout(-1, 3, 0.5, 1.0)
    with pytest.raises(ConfigError):
        geometric_fanout(4, -1, 0.5, 1.0)


def test_parse_fanout():
    assert parse_fanout("auto", 3) == "auto"
    assert parse_fanout(" AUTO ", 3) == "auto"
    assert parse_fanout("4, 3,2,1", 3) == [4, 3, 2, 1]
    assert parse_fanout("0", 0) == [0]
    for bad, msg in [("1,2", "needs 3"), ("1,2,3,4", "needs 3"), ("a,b,c", "comma-separated"),
                     ("1,-2,3", ">= 0"), ("", "comma-separated"), ("1,,2", "comma-separated"), ("1.5,2,3", "comma")]:
        with pytest.raises(ConfigError, match=msg):
            parse_fanout(bad, 2)


def _synthetic_rounds(est, n, a, r, k_max, c=1.0, seed=0, after_backup=False):
    rng = random.Random(seed)
    for _ in range(n):
        k = 0
        while k < k_max and rng.random() < a:
            k += 1
        # P(rank > F) = c·F^(-r): with prob 1 - c the top candidate is right
        rank = 1 if rng.random() > c else math.ceil((1.0 - rng.random()) ** (-1.0 / r))
        est.observe(k, k_max, rank, after_backup=after_backup)


def test_estimator_priors_before_data():
    est = FanoutEstimator()
    assert est.accept_rate == pytest.approx(0.7)
    assert est.r == pytest.approx(1.0)
    assert est.hit_rate == 0.0
    assert est.allocation(20, 4) == geometric_fanout(20, 4, 0.7, 1.0)


@pytest.mark.parametrize("a,r,c", [(0.6, 0.8, 1.0), (0.85, 1.5, 0.6), (0.3, 0.4, 1.0)])
def test_estimator_recovers_a_and_r(a, r, c):
    est = FanoutEstimator()
    _synthetic_rounds(est, 4000, a, r, k_max=5, c=c, seed=int(a * 100))
    assert est.accept_rate == pytest.approx(a, abs=0.03)
    assert est.r == pytest.approx(r, rel=0.2)
    assert est.allocation(40, 5) == geometric_fanout(40, 5, est.accept_rate, est.r)


def test_fit_power_law_exact_tail():
    # ranks with P(rank > F) = F^-1 exactly for F = 1..8 (a finite, exact sample)
    ranks = []
    for f in range(1, 9):
        ranks += [f + 1] * (840 // f - 840 // (f + 1))
    ranks += [100] * (840 // 9)
    assert fit_power_law(ranks, 8) == pytest.approx(1.0, abs=1e-9)
    assert fit_power_law([], 8) is None
    assert fit_power_law([1, 1, 2], 8) is None  # too few tail observations


def test_estimator_keeps_its_rank_tail_in_step_with_the_history():
    # the estimator counts tails as ranks arrive and leave the history window;
    # its r must equal a fresh fit of exactly the ranks it still holds
    est = FanoutEstimator(max_history=300, refit_every=1)
    rng = random.Random(7)
    for i in range(1000):
        est.observe(0, 4, 1 + int(rng.paretovariate(0.9)))
        if i in (60, 299, 300, 301, 999):
            held = list(est._ranks)
            assert len(held) == min(i + 1, 300)
            expect = fit_power_law(held, est.f_max)
            assert est.r == pytest.approx(min(max(expect, est.r_min), est.r_max), rel=1e-12)


def test_estimator_refits_r_once_per_refit_every_ranks():
    # r is read every SSD round; it is refitted only after refit_every new ranks
    est = FanoutEstimator(min_rank_obs=20, refit_every=16)
    rng = random.Random(3)
    fits = []
    for i in range(200):
        est.observe(0, 4, 1 + int(rng.paretovariate(1.2)))
        r = est.r
        if not fits or r != fits[-1][1]:
            fits.append((i + 1, r))
        if (i + 1) % 16 == 0 and i + 1 >= 20:  # a refit just happened: it fits every rank seen
            expect = fit_power_law(list(est._ranks), est.f_max)
            assert r == pytest.approx(min(max(expect, est.r_min), est.r_max), rel=1e-12)
    assert fits[0] == (1, pytest.approx(1.0))  # the prior until min_rank_obs ranks exist
    assert all(n % 16 == 0 for n, _ in fits[1:])  # changes only at refits
    assert len(fits) > 5
    with pytest.raises(ValueError):
        FanoutEstimator(refit_every=0)


def test_backup_regimes_are_tracked_separately():
    est = FanoutEstimator()
    _synthetic_rounds(est, 2000, 0.8, 1.0, k_max=4, seed=1)
    _synthetic_rounds(est, 2000, 0.02, 1.0, k_max=4, seed=2, after_backup="fast")
    _synthetic_rounds(est, 2000, 0.5, 1.0, k_max=4, seed=3, after_backup=True)
    assert est.accept_rate == pytest.approx(0.8, abs=0.03)
    assert est.accept_rate_for("fast") == pytest.approx(0.02, abs=0.02)
    assert est.accept_rate_for(True) == pytest.approx(0.5, abs=0.03)
    fast = est.allocation(32, 4, after_backup="fast")
    assert sum(fast) == 32 and fast[0] >= 0.8 * 32  # point-mass backup: most budget goes to k = 0
    assert est.allocation(32, 4)[0] < 0.5 * 32
    # prior for a fast backup already favours k = 0 before any data
    assert FanoutEstimator().allocation(32, 4, after_backup="fast")[0] >= 0.75 * 32
    with pytest.raises(ValueError):
        est.observe(5, 4, None)
    with pytest.raises(ValueError):
        est.observe(1, 4, 0)
    with pytest.raises(ValueError):
        est.allocation(8, 4, after_backup="random")


def test_estimator_hit_rate_and_unknown_ranks():
    est = FanoutEstimator(min_rank_obs=10)
    for i in range(40):
        est.observe(2, 4, None, hit=(i % 4 != 0))
    assert est.hit_rate == pytest.approx(0.75)
    assert est.r == pytest.approx(1.0)  # no ranks observed: the prior


# -------------------------------------------------------------------- cache

def test_cache_put_lookup_replace_stats_drop():
    cache = SpeculationCache()
    s1 = Speculation(tokens=[5, 6, 7], branch=0)
    s2 = Speculation(tokens=torch.tensor([1, 2, 3]), branch=1)
    cache.put_round("a", {(0, 5): s1, (2, 9): s2})
    cache.put_round("b", {(1, 1): s1})
    assert cache.lookup("a", 0, 5) is s1
    assert cache.lookup("a", 2, 9) is s2 and len(cache.lookup("a", 2, 9)) == 3
    assert cache.lookup("a", 1, 5) is None
    assert cache.lookup("zzz", 0, 5) is None
    assert cache.stats() == {"lookups": 5, "hits": 3, "hit_rate": 0.6}
    assert sorted(cache.keys("a")) == [(0, 5), (2, 9)]
    assert ("a", 0, 5) in cache and ("a", 0, 6) not in cache
    assert cache.stats()["lookups"] == 5  # membership does not count
    assert len(cache) == 3
    # a new round replaces the sequence's entries wholesale
    cache.put_round("a", {(1, 4): s2})
    assert cache.keys("a") == [(1, 4)]
    assert cache.lookup("a", 0, 5) is None
    assert cache.keys("b") == [(1, 1)]
    cache.drop("a")
    cache.drop("never-seen")
    assert cache.keys("a") == [] and cache.sequences() == ["b"]
    assert cache.lookup("a", 1, 4) is None
    assert cache.stats() == {"lookups": 7, "hits": 3, "hit_rate": 3 / 7}
    cache.reset_stats()
    assert cache.stats() == {"lookups": 0, "hits": 0, "hit_rate": 0.0}


# ------------------------------------------------------------------- backup

def test_expected_speedup_hand_computed():
    # [0.8·4 + 0.2·2] / [0.8·max(1, 0.5) + 0.2·(1 + 1)] = 3.6 / 1.2
    assert expected_speedup(0.8, 4.0, 2.0, 0.5, 1.0) == pytest.approx(3.0)
    # batch of 2: tokens per sequence as at batch 1 (3.6), the round avoids the backup with 0.64
    assert expected_speedup(0.8, 4.0, 2.0, 0.5, 1.0, batch_size=2) == pytest.approx(3.6 / (0.64 + 0.36 * 2))
    # slow primary speculation is not hidden: max(1, T_p)
    assert expected_speedup(1.0, 4.0, 2.0, 2.0, 1.0) == pytest.approx(2.0)


def test_a_rounds_fixed_cost_counts_against_the_cheap_backup():
    """T_c, every round's control plane, is paid however few tokens a round
    emits: a neural backup too slow to win on verification time alone wins
    once each round also costs half a verification."""
    # neural: [0.3·2.8 + 0.7·2.7] / [0.3 + 0.7·1.9 + T_c]; fast: [0.3·2.8 + 0.7·1.25] / [1 + T_c]
    neural = lambda t_c: expected_speedup(0.3, 2.8, 2.7, 1.0, 0.9, t_c=t_c)  # noqa: E731
    fast = lambda t_c: expected_speedup(0.3, 2.8, 1.25, 1.0, 0.0, t_c=t_c)  # noqa: E731
    assert neural(0.0) == pytest.approx(2.73 / 1.63) and fast(0.0) == pytest.approx(1.715)
    assert fast(0.0) > neural(0.0) and neural(0.5) == pytest.approx(2.73 / 2.13) and neural(0.5) > fast(0.5) == pytest.approx(1.715 / 1.5)
    stats = BackupStats(p_hit=0.3, e_hit=2.8, e_miss_neural=2.7, e_miss_fast=1.25, t_primary=1.0, t_neural=0.9, t_fast=0.0)
    policy = BackupPolicy("auto", explore_every=0)
    assert policy.choose(1, stats) == "fast"
    for _ in range(200):  # the round loop measures it every SSD round
        stats.observe_latency(t_round=0.5)
    assert stats.t_round == pytest.approx(0.5, abs=1e-3) and policy.choose(1, stats) == "neural"


def test_the_round_loop_measures_each_rounds_fixed_cost(tmp_path):
    """An SSD run feeds T_c — the round's time beyond verification, exposed
    drafting and the lookup, in verifications — to the backup statistics."""
    from helpers import save_tiny_checkpoint

    from saguaro_ray.config import SamplingParams, SpeculationConfig
    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.engine_config import EngineConfig
    from saguaro_ray.engine.timeline import round_components

    target = str(save_tiny_checkpoint(tmp_path, "llama", seed=0))
    eng = LocalEngine(EngineConfig(target=target, draft=target, spec=SpeculationConfig(mode="ssd", k=3), threads_per_worker=1))
    try:
        eng.generate([[3, 5, 7]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        stats = eng.loop.strategies["ssd"].backup_stats
        rounds = [r.to_json() for r in eng.timeline if not r.prefill]
        ema = 0.0  # the statistics' moving average, from its prior of 0
        for r in rounds:
            ema += stats.smoothing * (round_components(r)["control"] / (r["verify"][1] - r["verify"][0]) - ema)
        assert stats.t_round > 0 and stats.t_round == pytest.approx(ema)
    finally:
        eng.close()


def _argmax_choice(stats: BackupStats, b: int) -> str:
    neural = expected_speedup(stats.p_hit, stats.e_hit, stats.e_miss_neural, stats.t_primary, stats.t_neural, b)
    fast = expected_speedup(stats.p_hit, stats.e_hit, stats.e_miss_fast, stats.t_primary, stats.t_fast, b)
    return "fast" if fast > neural else "neural"


def test_auto_policy_is_argmax_of_expected_speedup():
    policy = BackupPolicy("auto", explore_every=0)
    for p_hit, t_neural, e_neural, b in itertools.product((0.5, 0.8, 0.95), (0.2, 0.6, 2.0), (1.5, 3.5), (1, 2, 4, 16, 64)):
        stats = BackupStats(p_hit=p_hit, e_hit=4.0, e_miss_neural=e_neural, e_miss_fast=1.05, t_neural=t_neural, t_fast=0.02)
        assert policy.choose(b, stats) == _argmax_choice(stats, b)


def test_auto_policy_small_batch_neural_large_batch_fast():
    policy = BackupPolicy("auto", explore_every=0)
    small = BackupStats(p_hit=0.9, e_hit=4.0, e_miss_neural=3.5, e_miss_fast=1.05, t_neural=0.3, t_fast=0.0)
    assert policy.choose(1, small) == "neural" == _argmax_choice(small, 1)
    big = BackupStats(p_hit=0.8, e_hit=4.0, e_miss_neural=3.0, e_miss_fast=1.05, t_neural=2.0, t_fast=0.0)
    assert policy.choose(16, big) == "fast" == _argmax_choice(big, 16)
    assert BackupPolicy("neural").choose(16, big) == "neural"
    assert BackupPolicy("fast").choose(1, small) == "fast"
    with pytest.raises(ConfigError, match="backup must be one of"):
        BackupPolicy("random")


def test_hit_rate_depends_on_the_backup_that_serves_misses():
    # a lookup after a cached speculation hits 60% of the time; after a
    # point-mass guess the next build goes to k = 0 and hits 90%; after a
    # neural backup 40%: the long-run share of cache rounds differs by choice
    s = BackupStats(smoothing=1.0)
    assert s.hit_rate_with("fast") == s.p_hit  # nothing observed yet: the pooled rate
    s.observe_lookup("cache", True)
    s.observe_lookup("fast", True)
    s.observe_lookup("neural", False)
    s.hit_after.update(cache=0.6, fast=0.9, neural=0.4)
    assert s.hit_rate_with("fast") == pytest.approx(0.9 / (1 - 0.6 + 0.9))
    assert s.hit_rate_with("neural") == pytest.approx(0.4 / (1 - 0.6 + 0.4))
    # a chain that checks itself: simulate it and compare the stationary share
    rng = random.Random(3)
    state, cache_rounds, n = "cache", 0, 200_000
    for _ in range(n):
        hit = rng.random() < s.hit_after[state]
        cache_rounds += hit
        state = "cache" if hit else "fast"
    assert cache_rounds / n == pytest.approx(s.hit_rate_with("fast"), abs=0.005)
    # the choice uses it: equal yields and costs, so the kind that keeps the cache warmer wins at batch 16
    s.e_hit, s.e_miss_neural, s.e_miss_fast, s.t_neural, s.t_fast, s.t_primary = 3.0, 2.0, 1.5, 0.1, 0.0, 1.0
    assert s.speedup("fast", 16) > s.speedup("neural", 16)
    assert BackupPolicy("auto", explore_every=0).choose(16, s) == "fast"
    with pytest.raises(ValueError, match="after must be"):
        s.observe_lookup("draft", True)


def test_auto_policy_explores_the_losing_backup_once_per_window():
    # without exploration a backup that lost once keeps its stale estimates forever
    stats = BackupStats(p_hit=0.5, e_hit=3.0, e_miss_neural=1.5, e_miss_fast=2.5, t_neural=0.5, t_fast=0.0)
    policy = BackupPolicy("auto", explore_every=10)
    assert [policy.choose(1, stats) for _ in range(30)] == ["fast"] * 30  # nothing served: nothing counts
    picks = []
    for _ in range(100):
        picks.append(policy.choose(1, stats))
        policy.served(picks[-1])
    assert picks.count("neural") == 10
    assert all(picks[i] == "neural" for i in range(9, 100, 10))
    # and once the tried kind measures better, the argmax follows it
    stats.e_miss_neural = 4.5
    assert policy.choose(1, stats) == "neural"
    assert BackupPolicy("fast", explore_every=10).choose(1, stats) == "fast"  # fixed modes never explore
    with pytest.raises(ConfigError, match="explore_every"):
        BackupPolicy("auto", explore_every=1)


def test_backup_stats_updates():
    s = BackupStats(smoothing=0.1)
    prior = BackupStats()
    for _ in range(200):
        s.observe_sequence(True, tokens=5)
    assert s.p_hit == pytest.approx(1.0, abs=1e-6) and s.e_hit == pytest.approx(5.0, abs=1e-6)
    for _ in range(200):
        s.observe_sequence(False, tokens=1, backup="fast")
        s.observe_sequence(False, tokens=3, backup="neural")
        s.observe_latency(t_primary=0.8, t_neural=1.7, t_fast=0.01)
    assert s.p_hit == pytest.approx(0.0, abs=1e-6)
    assert s.e_miss_fast == pytest.approx(1.0, abs=1e-6) and s.e_miss_neural == pytest.approx(3.0, abs=1e-6)
    assert (s.t_primary, s.t_neural, s.t_fast) == pytest.approx((0.8, 1.7, 0.01), abs=1e-6)
    assert s.e_hit == pytest.approx(5.0, abs=1e-6)  # misses do not touch E_hit
    s.observe_sequence(True)  # tokens unknown: only p_hit moves
    assert s.e_hit == pytest.approx(5.0, abs=1e-6) and s.p_hit == pytest.approx(0.1)
    assert prior.speedup("neural", 1) == pytest.approx(
        expected_speedup(prior.p_hit, prior.e_hit, prior.e_miss_neural, prior.t_primary, prior.t_neural)
    )
    with pytest.raises(ValueError):
        s.observe_sequence(False, tokens=2, backup="random")


def test_budget_controller_keeps_the_build_behind_verification():
    """Builds slower than verification shrink the spent budget (never below 1);
    builds comfortably faster let it grow back, never past the ceiling; a
    ratio inside the dead band leaves it alone."""
    from saguaro_ray.algorithms.fanout import BudgetController

    c = BudgetController(16)
    assert c.budget == 16
    for _ in range(5):
        c.observe(1.5)
    assert c.budget == round(16 * 0.8**5)
    for _ in range(100):
        c.observe(3.0)
    assert c.budget == 1
    held = c.budget
    c.observe(1.0)  # inside [low, high]: no change
    assert c.budget == held
    for _ in range(100):
        c.observe(0.5)
    assert c.budget == 16
    with pytest.raises(ValueError):
        BudgetController(0)
