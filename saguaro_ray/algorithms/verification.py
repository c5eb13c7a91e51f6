"""Verification: the drafter-invariant rule (:func:`invariant_outcomes`), the
one rule of every exact check — AR, SD, SSD hits and misses, PyramidSD's exact
stages, at any temperature (greedy rows in closed form,
:func:`greedy_outcomes`). It replaced speculative sampling as the rule of
every request because it was measured as fast or faster (SmolLM2-135M with an
int4 draft: SSD's hit rate 83 → 93 % at T = 0.7, 57 → 88 % at T = 1.0,
tokens/s equal or better; docs/performance.md) and a seed then fixes the
output in every strategy.

Speculative sampling (Leviathan et al.; Chen et al.: :func:`verify`) stays
only as the test the lossy fuzzy PyramidSD stages (τ > 0) extend with their
extra accepts (:mod:`.fuzzy`); the rest of this docstring is about it.
A proposed token ``x`` drawn from a law
``q`` is accepted with probability ``min(1, p(x) / q(x))``; at the first
rejection the emitted token is drawn from ``norm(max(0, p - q))``; when every
proposed token is accepted a bonus token is drawn from the next row of ``p``.
The emitted tokens then have exactly the law ``p`` whatever ``q`` is, *provided
``q`` is the law the token was really drawn from* and the uniforms used here are
independent of the ones the proposal used.

Special cases are not special rules:

* temperature 0: ``p`` rows are one-hot (see :func:`process_logits`), so the
  same arithmetic accepts iff ``x == argmax p`` and emits ``argmax p`` at the
  first mismatch;
* deterministic proposals (backup guesses, n-grams, point-mass drafts): ``q`` is
  :func:`point_mass`, which makes the rule accept with probability ``p(x)`` and
  on rejection draw from ``p`` with ``x`` zeroed and renormalised.

Uniform layout (``u [B, K+1, 2]``): ``u[b, i, 0]`` is the accept test at draft
position ``i``; ``u[b, i, 1]`` is the draw of the recovery token (first rejection
at ``i``) or of the bonus token (``i == draft_lens[b]``). A position uses at most
one of each, so no uniform is ever reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling import argmax_lowest, race_token, sample_from


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """``min(1, p(x) / q(x))`` elementwise.

    A drawn token always has ``q(x) > 0``. Padding positions (beyond a row's
    draft length) may carry ``q(x) == 0``; they get 1 when ``p(x) > 0`` and 0
    otherwise so the result is always finite — their decision is ignored anyway.
    """
    p_x, q_x = torch.broadcast_tensors(*_promote(p_x, q_x))
    safe_q = torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    ratio = (p_x / safe_q).clamp(0.0, 1.0)
    return torch.where(q_x > 0, ratio, (p_x > 0).to(ratio.dtype))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` over the last dimension.

    When ``p == q`` the residual has no mass; a rejection then has probability 0,
    so any law is correct there. We return ``p`` (not NaN) so batched code can
    compute every row unconditionally.
    """
    p, q = _promote(p, q)
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, torch.ones_like(mass)), p)


def point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """One-hot laws ``δ_x`` (fp32, shape ``[..., vocab]``) for deterministic proposals.

    Verifying a guess against ``δ_x`` is exact for any way the guess was made,
    as long as it does not depend on the verification uniforms.
    """
    return torch.nn.functional.one_hot(tokens.long(), vocab).float()


@dataclass
class VerifyResult:
    """Outcome of one verification round for a batch of sequences.

    ``accepted[b]`` (k) draft tokens were accepted, then ``next_token[b]`` (t*)
    was emitted: a recovery token when ``rejected[b]`` (rejection at position k),
    else the bonus token drawn from ``p[b, k]``. The SSD cache key is (k, t*).
    """

    accepted: torch.Tensor
    next_token: torch.Tensor
    rejected: torch.Tensor
    draft_tokens: torch.Tensor

    def emitted(self, b: int) -> list[int]:
        """The tokens sequence ``b`` gains this round: ``draft[:k] + [t*]``."""
        k = int(self.accepted[b])
        return self.draft_tokens[b, :k].tolist() + [int(self.next_token[b])]

    def emitted_all(self) -> list[list[int]]:
        """:meth:`emitted` for every row (one device-to-host copy per tensor)."""
        acc = self.accepted.tolist()
        nxt = self.next_token.tolist()
        drafts = self.draft_tokens.tolist()
        return [drafts[b][: acc[b]] + [nxt[b]] for b in range(len(acc))]


def accept_decisions(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """The per-position accept test ``u[:, i, 0] < min(1, p_i(x_i) / q_i(x_i))``: ``[B, K]`` bool.

    Decisions are computed for every position (including padding beyond a row's
    draft length); :func:`resolve` keeps only the leading run within the length.
    ``q is None`` means point masses on the draft tokens (``q_i(x_i) = 1``).
    """
    B, K = draft_tokens.shape
    if K == 0:
        return torch.zeros(B, 0, dtype=torch.bool, device=p.device)
    idx = draft_tokens.long().clamp(0, p.shape[-1] - 1).unsqueeze(-1)
    p_x = p[:, :K].gather(-1, idx).squeeze(-1)
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, idx).squeeze(-1)
    a = acceptance_probability(p_x, q_x)
    return u[:, :K, 0].to(a.device) < a


def resolve(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    draft_lens: torch.Tensor,
    u: torch.Tensor,
    accept: torch.Tensor,
) -> VerifyResult:
    """Turn per-position accept decisions into (k, t*).

    k is the length of the leading run of accepted positions, capped at
    ``draft_lens``. If ``k < draft_lens`` t* is drawn from the residual at
    position k, otherwise the bonus is drawn from ``p[:, k]``; both with
    ``u[:, k, 1]``. Shared by :func:`verify` and the fuzzy rule so the
    residual/bonus step exists once.
    """
    B, K = draft_tokens.shape
    V = p.shape[-1]
    dev = p.device
    lens = draft_lens.to(dev).long()
    if K:
        valid = torch.arange(K, device=dev).unsqueeze(0) < lens.unsqueeze(1)
        run = torch.cumprod((accept.to(dev) & valid).long(), dim=1)
        k = run.sum(dim=1)
    else:
        k = torch.zeros(B, dtype=torch.long, device=dev)
    rejected = k < lens
    rows = torch.arange(B, device=dev)
    p_k = p[rows, k]
    if K:
        kq = k.clamp_max(K - 1)
        if q is None:
            x_k = draft_tokens.to(dev).long()[rows, kq].clamp(0, V - 1)
            q_k = point_mass(x_k, V)
        else:
            q_k = q[rows, kq]
        dist = torch.where(rejected.unsqueeze(-1), residual_distribution(p_k, q_k), p_k)
    else:
        dist = p_k
    t = sample_from(dist, u[rows.to(u.device), k.to(u.device), 1]).to(dev)
    return VerifyResult(accepted=k, next_token=t, rejected=rejected, draft_tokens=draft_tokens)


def verify(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    draft_lens: torch.Tensor,
    u: torch.Tensor,
) -> VerifyResult:
    """Speculative-sampling verification of a ragged batch.

    Args:
        p: ``[B, K+1, V]`` the target's *processed* law at each position (row i
            predicts the token after the first i draft tokens; row K is the bonus).
        draft_tokens: ``[B, K]`` proposed tokens; entries beyond ``draft_lens``
            are ignored (any value, e.g. -1 padding).
        q: ``[B, K, V]`` the exact law each draft token was drawn from. ``None``
            means point masses (deterministic proposals, or a greedy draft whose
            q rows are one-hot anyway).
        draft_lens: ``[B]`` real draft length per row, ``0 <= draft_lens <= K``.
        u: ``[B, K+1, 2]`` independent U[0,1) uniforms (layout in the module doc).
    """
    check_inputs(p, draft_tokens, q, draft_lens, u)
    accept = accept_decisions(p, draft_tokens, q, u)
    return resolve(p, draft_tokens, q, draft_lens, u, accept)


def check_inputs(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    draft_lens: torch.Tensor,
    u: torch.Tensor,
) -> None:
    """Raise ValueError on inconsistent shapes or draft lengths (shared with the fuzzy rule)."""
    B, K = draft_tokens.shape
    if p.dim() != 3 or p.shape[0] != B or p.shape[1] != K + 1:
        raise ValueError(f"p must be [B, K+1, V] = [{B}, {K + 1}, V], got {tuple(p.shape)}")
    if q is not None and tuple(q.shape) != (B, K, p.shape[-1]):
        raise ValueError(f"q must be [B, K, V] = [{B}, {K}, {p.shape[-1]}], got {tuple(q.shape)}")
    if tuple(u.shape) != (B, K + 1, 2):
        raise ValueError(f"u must be [B, K+1, 2] = [{B}, {K + 1}, 2], got {tuple(u.shape)}")
    if tuple(draft_lens.shape) != (B,):
        raise ValueError(f"draft_lens must be [B] = [{B}], got {tuple(draft_lens.shape)}")
    if B and (bool((draft_lens < 0).any()) or bool((draft_lens > K).any())):
        raise ValueError(f"draft_lens must lie in [0, K={K}], got {draft_lens.tolist()}")


def _promote(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(a.dtype, b.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    return a.to(dtype), b.to(dtype)


def greedy_outcomes(logits: torch.Tensor, proposals: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """:func:`verify` for a greedy (temperature 0) verifier, in closed form:
    ``(accepted, emitted token)`` per sequence.

    ``logits`` are the verifier's raw rows, ``len(tokens) + 1`` per sequence,
    flat in batch order. Every processed row is then one-hot on its argmax
    ``a_i`` (lowest id among ties, as :func:`process_logits` makes it), so the
    rule's arithmetic has only one outcome whatever ``q`` and the uniforms are:
    ``min(1, p(x)/q(x))`` is 1 when ``x == a_i`` and 0 otherwise, and at the
    first rejection ``norm(max(0, p - q))`` is the one-hot on ``a_k`` again
    (``q(a_k) < 1`` because ``q`` drew ``x != a_k``); after every token is
    accepted the bonus is ``a_K``. One argmax instead of building the [B, K+1, V]
    laws: on a CPU that is most of a greedy round's verification cost beyond the
    forward pass. ``tests/test_fast_paths.py`` checks it against :func:`verify`.
    """
    return match_outcomes(argmax_lowest(logits).tolist(), proposals)


def match_outcomes(best: Sequence[int], proposals: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(accepted, emitted token)`` per sequence when the verifier's token at
    each position is already decided (``best``: ``len(tokens) + 1`` per
    sequence, flat): keep the proposal while it equals ``best``, then emit
    ``best`` at the first difference, or as the bonus after the last token.
    Shared by :func:`greedy_outcomes` and :func:`invariant_outcomes`."""
    if len(best) != sum(len(t) + 1 for t in proposals):
        raise ValueError(f"expected {sum(len(t) + 1 for t in proposals)} logit rows (len(tokens) + 1 per sequence), got {len(best)}")
    out, offset = [], 0
    for tokens in proposals:
        rows = best[offset : offset + len(tokens) + 1]
        offset += len(tokens) + 1
        k = 0
        while k < len(tokens) and tokens[k] == rows[k]:
            k += 1
        out.append((k, rows[k]))
    return out


def invariant_outcomes(p: torch.Tensor, keys: Sequence[int], proposals: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The drafter-invariant rule (Daliri, Musco, Suresh, arXiv 2408.07978):
    ``(accepted, emitted token)`` per sequence.

    ``p`` holds the verifier's processed rows, ``len(tokens) + 1`` per
    sequence, flat; ``keys[r]`` is row r's public noise key
    (:func:`~saguaro_ray.algorithms.sampling.position_keys` of the sequence's
    seed and the row's output position). The verifier's token at each position
    is the race winner ``y_i`` of its row (:func:`race_token`); the proposal is
    kept while it equals ``y_i`` and ``y_k`` is emitted at the first difference
    (or as the bonus). The proposal's law is never read: a draft that wants to
    be accepted proposes the race winner of its own law under the same noise,
    which equals ``y_i`` with probability at least ``(1 - TV) / (1 + TV)``.

    **Exactness and invariance.** Induct over positions: the emitted token at
    output position j is ``y_j``, the race winner of the target's law after
    the emitted prefix, under the noise of (seed, j). Whatever proposal led
    there, the prefix is a function of the noise of positions < j only (each
    earlier emitted token is some ``y_i``, i < j, under its own key), and the
    noise of position j is independent of it; by the race lemma ``y_j`` then
    has law ``p_j(· | prefix)`` — every token is an exact sample of the
    target, and the whole output is the same function of (seed, target) that
    autoregressive sampling with :func:`race_token` computes: identical for
    every draft, K, cache hit or miss, backup and batch. Greedy rows (one-hot
    p) reduce to :func:`greedy_outcomes`.
    """
    best = race_token(p.reshape(-1, p.shape[-1]), keys).tolist()
    return match_outcomes(best, proposals)
