"""PyramidSD stage rules: draft → qualifier → target.

Stage 1: the qualifier (processed law p_Q) checks the draft's tokens.
  * ``exact``: standard verification with the draft's q. The qualified tokens
    have exactly the law p_Q (autoregressive sampling from the qualifier).
  * ``assisted``: the qualifier samples its own token at each position; draft
    tokens are kept while equal to it and the qualifier's token is emitted at
    the first difference. We implement it as the one verification rule with
    point-mass proposals q = δ_x: accept x with probability p_Q(x), otherwise
    draw from p_Q with x zeroed. That is the same law as "draw y ~ p_Q, keep x
    iff y == x, else emit y" (P(keep) = p_Q(x); given a miss, y ~ p_Q
    conditioned on y ≠ x), identical at temperature 0 — so assisted also
    yields tokens with law exactly p_Q, and needs no special-case rule.
  * ``fuzzy``: :func:`fuzzy_verify` with τ_Q (lossy when τ_Q > 0).
Stage 2: the target (law p) checks the qualified block with q = p_Q rows
(:func:`qualified_block` assembles them), by ``exact`` or ``fuzzy`` (τ_T).
With exact/assisted stage 1 and exact stage 2 the output law is exactly p.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .fuzzy import DIVERGENCES, fuzzy_verify, is_lossy
from .verification import VerifyResult, verify

STAGE1_RULES = ("exact", "assisted", "fuzzy")
STAGE2_RULES = ("exact", "fuzzy")


def validate_pyramid(
    stage1: str,
    stage2: str,
    tau_q: float,
    tau_t: float,
    div: str,
    allow_lossy: bool,
) -> bool:
    """Check a PyramidSD configuration; return whether it is lossy.

    Rules: known stage and divergence names; τ ≥ 0; a τ > 0 only on a ``fuzzy``
    stage (elsewhere it would be silently ignored); τ_Q ≤ τ_T (a qualifier
    looser than the target would pass blocks the target then throws away);
    any τ > 0 requires ``allow_lossy`` (``--allow-lossy``).
    """
    if stage1 not in STAGE1_RULES:
        raise ConfigError(f"pyramid stage-1 rule must be one of {', '.join(STAGE1_RULES)}; got {stage1!r}")
    if stage2 not in STAGE2_RULES:
        raise ConfigError(f"pyramid stage-2 rule must be one of {', '.join(STAGE2_RULES)}; got {stage2!r}")
    if div not in DIVERGENCES:
        raise ConfigError(f"fuzzy divergence must be one of {', '.join(DIVERGENCES)}; got {div!r}")
    tau_q, tau_t = float(tau_q), float(tau_t)
    for name, tau in (("tau_q", tau_q), ("tau_t", tau_t)):
        if not tau >= 0.0:
            raise ConfigError(f"{name} must be >= 0, got {tau}")
    if tau_q > 0 and stage1 != "fuzzy":
        raise ConfigError(f"tau_q={tau_q} only applies to the 'fuzzy' stage-1 rule (got {stage1!r}); set it to 0")
    if tau_t > 0 and stage2 != "fuzzy":
        raise ConfigError(f"tau_t={tau_t} only applies to the 'fuzzy' stage-2 rule (got {stage2!r}); set it to 0")
    if tau_q > tau_t:
        raise ConfigError(f"tau_q ({tau_q}) must be <= tau_t ({tau_t}): the qualifier may not be looser than the target")
    lossy = is_lossy(tau_q) or is_lossy(tau_t)
    if lossy and not allow_lossy:
        raise ConfigError(
            f"fuzzy thresholds tau_q={tau_q}, tau_t={tau_t} change the output distribution (lossy); "
            "pass --allow-lossy (allow_lossy=True) to accept that, or set both to 0 for exact decoding"
        )
    return lossy


def qualify(
    rule: str,
    p_q: torch.Tensor,
    draft_tokens: torch.Tensor,
    q_draft: torch.Tensor | None,
    draft_lens: torch.Tensor,
    u: torch.Tensor,
    tau_q: float = 0.0,
    div: str = "tv",
) -> VerifyResult:
    """Stage 1: the qualifier's law ``p_q [B, K+1, V]`` checks the draft tokens.

    ``q_draft`` is the draft's exact law (None = point masses); ``assisted``
    ignores it (drafts are treated as point-mass guesses). Uniform layout as
    :func:`verify`; use the qualifier's own random stream.
    """
    if rule == "exact":
        return verify(p_q, draft_tokens, q_draft, draft_lens, u)
    if rule == "assisted":
        return verify(p_q, draft_tokens, None, draft_lens, u)
    if rule == "fuzzy":
        return fuzzy_verify(p_q, draft_tokens, q_draft, draft_lens, u, tau_q, div)
    raise ConfigError(f"pyramid stage-1 rule must be one of {', '.join(STAGE1_RULES)}; got {rule!r}")


def qualified_block(result: VerifyResult, p_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage-2 inputs from one stage-1 round: ``(tokens [B, K+1], q [B, K+1, V], lens [B])``.

    The block is ``draft[:k] + [t*]`` (padded with -1); its proposal law at
    position i is the qualifier's row ``p_q[:, i]`` — row i conditions on
    exactly the block's first i tokens, which equal the draft's for i ≤ k.
    """
    draft = result.draft_tokens.to(p_q.device).long()
    B, K = draft.shape
    k = result.accepted.to(p_q.device)
    pos = torch.arange(K + 1, device=p_q.device).unsqueeze(0)
    tokens = torch.cat([draft, torch.full((B, 1), -1, dtype=torch.long, device=p_q.device)], dim=1)
    tokens = torch.where(pos == k.unsqueeze(1), result.next_token.to(p_q.device).unsqueeze(1), tokens)
    tokens = torch.where(pos <= k.unsqueeze(1), tokens, torch.full_like(tokens, -1))
    return tokens, p_q[:, : K + 1], k + 1


def target_check(
    rule: str,
    p_t: torch.Tensor,
    block_tokens: torch.Tensor,
    p_q_rows: torch.Tensor,
    block_lens: torch.Tensor,
    u: torch.Tensor,
    tau_t: float = 0.0,
    div: str = "tv",
) -> VerifyResult:
    """Stage 2: the target's law ``p_t [B, L+1, V]`` checks the qualified block
    with the qualifier's rows ``p_q_rows [B, L, V]`` as q."""
    if rule == "exact":
        return verify(p_t, block_tokens, p_q_rows, block_lens, u)
    if rule == "fuzzy":
        return fuzzy_verify(p_t, block_tokens, p_q_rows, block_lens, u, tau_t, div)
    raise ConfigError(f"pyramid stage-2 rule must be one of {', '.join(STAGE2_RULES)}; got {rule!r}")
