"""Fuzzy speculative decoding: a deliberately lossy relaxation of verification.

Run the standard accept test; where it rejects position i but the divergence
between the verifier's law p_i and the proposal's q_i is below τ, accept anyway.
Otherwise the usual residual draw applies. τ = 0 accepts nothing extra and is
exactly :func:`~saguaro_ray.algorithms.verification.verify` (same decisions,
same draws): the rule here only *adds* accepts to the standard decisions and
hands them to the same resolver. Any τ > 0 changes the output law, so callers
must ask for it explicitly and report results as lossy.
"""

from __future__ import annotations

import math

import torch

from .verification import VerifyResult, check_inputs, accept_decisions, point_mass, resolve, verify

DIVERGENCES = ("reverse_kl", "kl", "js", "tv")
_EPS = 1e-12


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) over the last dim; 0·log 0 = 0, b clamped at eps where a > 0."""
    return (torch.xlogy(a, a) - torch.xlogy(a, b.clamp_min(_EPS))).sum(-1).clamp_min(0.0)


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """Divergence between rows of ``p`` and ``q`` (``[..., V]`` → ``[...]``).

    ``reverse_kl`` = KL(p‖q), ``kl`` = KL(q‖p), ``js`` = Jensen–Shannon / ln 2
    (in [0, 1]), ``tv`` = ½‖p − q‖₁ (in [0, 1]). Computed in float64.
    """
    p = p.double()
    q = q.double()
    if kind == "reverse_kl":
        return _kl(p, q)
    if kind == "kl":
        return _kl(q, p)
    if kind == "js":
        m = 0.5 * (p + q)
        return (0.5 * (_kl(p, m) + _kl(q, m)) / math.log(2.0)).clamp(0.0, 1.0)
    if kind == "tv":
        return (0.5 * (p - q).abs().sum(-1)).clamp(0.0, 1.0)
    raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")


def is_lossy(tau: float) -> bool:
    """A fuzzy threshold changes the output law iff τ > 0."""
    return float(tau) > 0.0


def fuzzy_verify(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    draft_lens: torch.Tensor,
    u: torch.Tensor,
    tau: float,
    div: str,
) -> VerifyResult:
    """Standard verification plus "accept anyway where Div(p_i, q_i) < τ".

    Same arguments and uniform layout as :func:`verify`; ``q is None`` means
    point masses. τ <= 0 is :func:`verify` itself.
    """
    if div not in DIVERGENCES:
        raise ValueError(f"unknown divergence {div!r}; choose one of {', '.join(DIVERGENCES)}")
    if not is_lossy(tau):
        return verify(p, draft_tokens, q, draft_lens, u)
    check_inputs(p, draft_tokens, q, draft_lens, u)
    K = draft_tokens.shape[1]
    accept = accept_decisions(p, draft_tokens, q, u)
    if K:
        q_rows = q if q is not None else point_mass(draft_tokens.clamp(0, p.shape[-1] - 1), p.shape[-1]).to(p.device)
        close = divergence(p[:, :K], q_rows, div) < float(tau)
        accept = accept | close.to(accept.device)
    return resolve(p, draft_tokens, q, draft_lens, u, accept)

