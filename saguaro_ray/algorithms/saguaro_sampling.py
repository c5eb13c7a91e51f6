"""Saguaro sampling: the draft law q' = σ_{F,C}(q) that raises the cache hit rate.

The SSD cache holds, for each number k of accepted tokens, speculations for the
top-F_k recovery candidates of the draft's row k (excluding the sampled token
s_{k+1}, which cannot be the recovery token after a rejection at k+1 — hence
top-(F+1)). The recovery token is drawn from ``norm(max(0, p - q))``, so the
more mass q puts on a token, the *less* likely it is to be recovered. Drawing
the draft from q' (q scaled by C on its top-(F+1) tokens, renormalised) leaves
residual mass exactly on the cached candidates.

**Verification must use q'** — the law the draft token really came from — never
q. Using q there would break exactness (see the negative control in
``tests/test_verification_law.py``). Drafts should ship q' rows (or the top
set) to the verifier so the top-(F+1) tie-break (lowest token id, stable sort)
can never differ between draft and verifier.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def validate_saguaro_c(c: float) -> float:
    """C must lie in (0, 1]; C = 1 disables the rescaling."""
    c = float(c)
    if not (0.0 < c <= 1.0):
        raise ConfigError(f"saguaro C must be in (0, 1], got {c}; use 1.0 to disable Saguaro sampling")
    return c


def top_ranks(q: torch.Tensor) -> torch.Tensor:
    """0-based rank of every token in its row of ``q [..., V]``, descending; ties
    rank the lower token id first (stable sort)."""
    order = torch.sort(q, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ar = torch.arange(q.shape[-1], device=q.device).expand_as(order)
    return ranks.scatter_(-1, order, ar.contiguous())


def top_set(q: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """``top_ranks(q) < size`` without sorting the vocabulary: the ``size``
    (>= 1, broadcastable to ``q.shape[:-1]``) highest tokens of each row, ties
    resolved to the lower token id, as a bool mask ``[..., V]``."""
    vocab = q.shape[-1]
    size = torch.as_tensor(size, device=q.device).long().clamp(1, vocab).expand(q.shape[:-1]).unsqueeze(-1)
    kmax = int(size.max()) if size.numel() else 1
    # the size-th largest value of each row; everything above it is in, and of
    # the tokens equal to it, the lowest ids fill the remaining places
    threshold = q.topk(kmax, dim=-1).values.gather(-1, size - 1)
    above = q > threshold
    tied = q == threshold
    room = size - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def saguaro_rescale(q: torch.Tensor, fanout: int | torch.Tensor, c: float) -> torch.Tensor:
    """q'(t) ∝ C·q(t) for t among the top-(F+1) tokens of q, q(t) otherwise.

    Args:
        q: ``[..., V]`` the draft's processed law (rows sum to 1).
        fanout: F, an int or a LongTensor broadcastable to ``q.shape[:-1]``
            (per-row fan-out, e.g. F_k for row k). F = 0 still scales the top-1
            token (the sampled token's slot), matching top-(F+1).
        c: C in (0, 1]. C = 1 returns ``q`` itself.

    Returns q' with the same shape and dtype, rows renormalised. A row whose
    whole mass sits in its top-(F+1) set is returned unchanged in law (C
    cancels).
    """
    c = validate_saguaro_c(c)
    f = torch.as_tensor(fanout, device=q.device)
    if bool((f < 0).any()):
        raise ConfigError(f"fan-out must be >= 0, got {fanout}")
    if c == 1.0:
        return q
    in_top = top_set(q, f.long() + 1)
    scaled = torch.where(in_top, q * c, q)
    return scaled / scaled.sum(-1, keepdim=True)
