"""Fuzzy verification (τ = 0 is exact `verify`), divergences, and PyramidSD stage rules."""

from __future__ import annotations

import math

import pytest
import torch

from saguaro_ray.algorithms.fuzzy import DIVERGENCES, divergence, fuzzy_verify, is_lossy
from saguaro_ray.algorithms.pyramid import qualified_block, qualify, target_check, validate_pyramid
from saguaro_ray.algorithms.sampling import sample_from
from saguaro_ray.algorithms.verification import (
    acceptance_probability,
    point_mass,
    residual_distribution,
    verify,
)
from saguaro_ray.errors import ConfigError

from test_verification_law import V, Enumerator, autoregressive_law, proposal_maker, random_law, target_law


def _case(B: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(B, K + 1, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(B, K, V, generator=g, dtype=torch.float64), -1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    lens = torch.randint(0, K + 1, (B,), generator=g)
    u = torch.rand(B, K + 1, 2, generator=g, dtype=torch.float64)
    return p, draft, q, lens, u


def _same(a, b) -> bool:
    return torch.equal(a.accepted, b.accepted) and torch.equal(a.next_token, b.next_token) and torch.equal(a.rejected, b.rejected)


# ------------------------------------------------------------------- fuzzy

@pytest.mark.parametrize("div", DIVERGENCES)
def test_fuzzy_tau_zero_is_exact_verify(div):
    for seed in range(20):
        p, draft, q, lens, u = _case(32, 3, seed)
        assert _same(fuzzy_verify(p, draft, q, lens, u, 0.0, div), verify(p, draft, q, lens, u))
        assert _same(fuzzy_verify(p, draft, None, lens, u, 0.0, div), verify(p, draft, None, lens, u))


@pytest.mark.parametrize("div", DIVERGENCES)
def test_fuzzy_below_every_divergence_matches_verify_through_the_fuzzy_path(div):
    # τ > 0 but smaller than every row's divergence: the fuzzy branch runs and
    # adds no accept, so its result must still be identical to `verify`.
    p, draft, q, lens, u = _case(64, 3, 99)
    tau = float(divergence(p[:, :3], q, div).min()) * 0.5
    assert tau > 0
    assert _same(fuzzy_verify(p, draft, q, lens, u, tau, div), verify(p, draft, q, lens, u))


@pytest.mark.parametrize("div", DIVERGENCES)
def test_fuzzy_large_tau_accepts_everything(div):
    p, draft, q, lens, u = _case(64, 4, 5)
    res = fuzzy_verify(p, draft, q, lens, u, 1e9, div)
    assert torch.equal(res.accepted, lens)
    assert not bool(res.rejected.any())
    rows = torch.arange(64)
    assert torch.equal(res.next_token, sample_from(p[rows, lens], u[rows, lens, 1]))


def test_fuzzy_accepts_only_where_divergence_is_small():
    p, draft, q, lens, u = _case(200, 1, 8)
    lens = torch.ones(200, dtype=torch.long)
    d = divergence(p[:, 0], q[:, 0], "tv")
    tau = float(d.median())
    exact = verify(p, draft, q, lens, u)
    fz = fuzzy_verify(p, draft, q, lens, u, tau, "tv")
    want = (exact.accepted == 1) | (d < tau)
    assert torch.equal(fz.accepted == 1, want)
    assert bool(((fz.accepted == 1) & (exact.accepted == 0)).any())


def test_divergence_known_values():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.9, 0.1], dtype=torch.float64)
    kl_pq = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl_qp = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert float(divergence(p, q, "reverse_kl")) == pytest.approx(kl_pq, abs=1e-12)
    assert float(divergence(p, q, "kl")) == pytest.approx(kl_qp, abs=1e-12)
    assert float(divergence(p, q, "tv")) == pytest.approx(0.4, abs=1e-12)
    m = (p + q) / 2
    js = 0.5 * sum(float(a) * math.log(float(a / c)) + float(b) * math.log(float(b / c)) for a, b, c in zip(p, q, m))
    assert float(divergence(p, q, "js")) == pytest.approx(js / math.log(2), abs=1e-12)
    # identical → 0 for every kind, including sparse rows
    r = torch.tensor([[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]])
    for kind in DIVERGENCES:
        assert torch.allclose(divergence(r, r.clone(), kind), torch.zeros(2, dtype=torch.float64), atol=1e-12)
    # disjoint supports: TV = JS = 1; KL large but finite
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert float(divergence(a, b, "tv")) == pytest.approx(1.0)
    assert float(divergence(a, b, "js")) == pytest.approx(1.0)
    assert math.isfinite(float(divergence(a, b, "kl"))) and float(divergence(a, b, "kl")) > 10
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence(a, b, "hellinger")


def test_tv_and_js_bounds_on_random_rows():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(4 * torch.randn(500, 7, generator=g), -1)
    q = torch.softmax(4 * torch.randn(500, 7, generator=g), -1)
    tv, js = divergence(p, q, "tv"), divergence(p, q, "js")
    assert ((tv >= 0) & (tv <= 1)).all() and ((js >= 0) & (js <= 1)).all()
    # JS (in bits) ≤ TV is a known inequality; and both KLs ≥ 0
    assert (js <= tv + 1e-9).all()
    assert (divergence(p, q, "kl") >= 0).all() and (divergence(p, q, "reverse_kl") >= 0).all()
    # Pinsker: TV ≤ sqrt(KL/2)
    assert (tv <= (divergence(p, q, "reverse_kl") / 2).sqrt() + 1e-9).all()


def test_is_lossy():
    assert not is_lossy(0) and not is_lossy(0.0)
    assert is_lossy(1e-9) and is_lossy(0.3)


# ------------------------------------------------------------------ pyramid

def qualifier_law(prefix):
    return random_law("pQ", prefix)


def _one_step(p, q):
    a, r = acceptance_probability(p, q), residual_distribution(p, q)
    return q * a + (q * (1 - a)).sum() * r


@pytest.mark.parametrize("kind,salt", [("full", 0), ("sparse", 1), ("point", 0)])
def test_pyramid_exact_first_token_law_is_target_law(kind, salt):
    for root in [(), (2,), (4, 1)]:
        q, pQ, p = proposal_maker(kind, salt)(root), qualifier_law(root), target_law(root)
        stage1 = _one_step(pQ, q)  # law of the first qualified token
        assert torch.allclose(stage1, pQ, atol=1e-9, rtol=0)
        # stage 2: the target verifies y ~ stage1 using q = p_Q as the proposal law
        a2, r2 = acceptance_probability(p, pQ), residual_distribution(p, pQ)
        end = stage1 * a2 + (stage1 * (1 - a2)).sum() * r2
        assert torch.allclose(end, p, atol=1e-9, rtol=0)


def test_pyramid_exact_joint_laws():
    # Stage 1 emits the qualifier's autoregressive law; stage 2, which treats the
    # qualified tokens as draws from p_Q, then emits the target's.
    s1 = Enumerator(qualifier_law, proposal_maker("mixed", 1), K=2)
    assert torch.allclose(s1.law((), 3), autoregressive_law(qualifier_law, (), 3), atol=1e-9, rtol=0)
    s2 = Enumerator(target_law, qualifier_law, K=3)
    assert torch.allclose(s2.law((), 3), autoregressive_law(target_law, (), 3), atol=1e-9, rtol=0)


def test_assisted_stage1_yields_qualifier_law():
    for root in [(), (3,)]:
        q, pQ = proposal_maker("full")(root), qualifier_law(root)
        # x ~ q, then the point-mass rule: keep x w.p. p_Q(x), else p_Q without x
        law = torch.zeros(V, dtype=torch.float64)
        for x in range(V):
            law += q[x] * _one_step(pQ, point_mass(torch.tensor(x), V).double())
        assert torch.allclose(law, pQ, atol=1e-9, rtol=0)
    enum = Enumerator(qualifier_law, lambda pre: point_mass(torch.tensor(len(pre) % V), V).double(), K=2)
    assert torch.allclose(enum.law((1,), 3), autoregressive_law(qualifier_law, (1,), 3), atol=1e-9, rtol=0)


def test_assisted_is_verify_with_point_masses_and_exact_at_greedy():
    p, draft, q, lens, u = _case(64, 3, 21)
    assisted = qualify("assisted", p, draft, q, lens, u)
    assert _same(assisted, verify(p, draft, point_mass(draft, V).double(), lens, u))
    one_hot = point_mass(p.argmax(-1), V).double()  # greedy qualifier
    assert _same(qualify("assisted", one_hot, draft, q, lens, u), qualify("exact", one_hot, draft, q, lens, u))


def test_qualified_block_assembly():
    p, draft, q, lens, u = _case(16, 3, 4)
    res = qualify("exact", p, draft, q, lens, u)
    tokens, q_rows, blens = qualified_block(res, p)
    assert torch.equal(blens, res.accepted + 1)
    assert q_rows.shape == (16, 4, V) and torch.equal(q_rows, p)
    for b in range(16):
        n = int(blens[b])
        assert tokens[b, :n].tolist() == res.emitted(b)
        assert (tokens[b, n:] == -1).all()


@pytest.mark.parametrize("stage1", ["exact", "assisted"])
def test_pyramid_end_to_end_first_token_frequencies(stage1):
    N, K = 20000, 2
    g = torch.Generator().manual_seed(77)
    pQ0, p0 = qualifier_law(("e2e",)), target_law(("e2e",))
    q_rows = torch.stack([proposal_maker("full")((9,)), proposal_maker("full")((8,))]).expand(N, K, V)
    pQ = torch.stack([pQ0, qualifier_law((1,)), qualifier_law((2,))]).expand(N, K + 1, V)
    pT = torch.stack([p0] + [target_law((i,)) for i in range(K + 1)]).expand(N, K + 2, V)
    draft = torch.multinomial(q_rows.reshape(-1, V), 1, replacement=True, generator=g).reshape(N, K)
    u1 = torch.rand(N, K + 1, 2, generator=g, dtype=torch.float64)
    u2 = torch.rand(N, K + 2, 2, generator=g, dtype=torch.float64)
    s1 = qualify(stage1, pQ, draft, q_rows, torch.full((N,), K), u1)
    tokens, rows, blens = qualified_block(s1, pQ)
    s2 = target_check("exact", pT, tokens, rows, blens, u2)
    first = torch.where(s2.accepted > 0, tokens[:, 0], s2.next_token)
    freq = torch.bincount(first, minlength=V).double() / N
    se = (p0 * (1 - p0) / N).sqrt()
    assert ((freq - p0).abs() <= 5 * se + 1e-12).all(), (freq, p0)


def test_pyramid_stage_dispatch():
    p, draft, q, lens, u = _case(8, 2, 1)
    assert _same(qualify("fuzzy", p, draft, q, lens, u, 0.0, "js"), verify(p, draft, q, lens, u))
    assert _same(target_check("fuzzy", p, draft, q, lens, u, 0.0, "kl"), verify(p, draft, q, lens, u))
    assert _same(target_check("fuzzy", p, draft, q, lens, u, 1e9, "tv"), fuzzy_verify(p, draft, q, lens, u, 1e9, "tv"))
    with pytest.raises(ConfigError):
        qualify("greedy", p, draft, q, lens, u)
    with pytest.raises(ConfigError):
        target_check("assisted", p, draft, q, lens, u)


def test_validate_pyramid():
    assert validate_pyramid("exact", "exact", 0, 0, "tv", False) is False
    assert validate_pyramid("assisted", "exact", 0, 0, "js", False) is False
    assert validate_pyramid("fuzzy", "fuzzy", 0, 0, "kl", False) is False
    assert validate_pyramid("fuzzy", "fuzzy", 0.1, 0.2, "reverse_kl", True) is True
    assert validate_pyramid("exact", "fuzzy", 0, 0.2, "tv", True) is True
    with pytest.raises(ConfigError, match="--allow-lossy"):
        validate_pyramid("fuzzy", "fuzzy", 0.1, 0.2, "tv", False)
    with pytest.raises(ConfigError, match="--allow-lossy"):
        validate_pyramid("exact", "fuzzy", 0, 0.05, "tv", False)
    with pytest.raises(ConfigError, match="tau_q"):
        validate_pyramid("fuzzy", "fuzzy", 0.3, 0.2, "tv", True)
    with pytest.raises(ConfigError, match="tau_q"):
        validate_pyramid("fuzzy", "exact", 0.1, 0, "tv", True)
    with pytest.raises(ConfigError, match=">= 0"):
        validate_pyramid("fuzzy", "fuzzy", -0.1, 0.2, "tv", True)
    with pytest.raises(ConfigError, match="only applies"):
        validate_pyramid("exact", "exact", 0.1, 0.1, "tv", True)
    with pytest.raises(ConfigError, match="stage-1"):
        validate_pyramid("sloppy", "exact", 0, 0, "tv", False)
    with pytest.raises(ConfigError, match="stage-2"):
        validate_pyramid("exact", "assisted", 0, 0, "tv", False)
    with pytest.raises(ConfigError, match="divergence"):
        validate_pyramid("exact", "exact", 0, 0, "l2", False)
    with pytest.raises(ConfigError, match=">= 0"):
        validate_pyramid("fuzzy", "fuzzy", float("nan"), 0.2, "tv", True)
