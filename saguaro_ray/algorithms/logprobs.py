"""Log-probabilities of emitted tokens, read off the verification pass's own rows.

Verification already scores every position of a proposal, so the target's
log-probabilities of what a round emits — k accepted tokens, then t* — are
rows 0..k of that item's logits: no extra forward, and only the emitted rows
are turned into log-probabilities (the cost is ~0 for sequences that do not
ask, and a ``log_softmax`` plus a top-N per emitted token for those that do).

Two distributions, as vLLM offers them:

* ``raw``: ``log_softmax`` of the model's logits, before any adjustment
  (penalties, bias, grammar) and before temperature, top-k and top-p.
* ``processed``: the log of the law the token was sampled from — the
  adjusted logits through temperature, top-k and top-p
  (:func:`~saguaro_ray.algorithms.sampling.process_logits`). Under exact
  speculation every emitted token's law given its prefix is this one,
  whatever the draft proposed. At temperature 0 it is one-hot.

A token the law cannot emit has probability 0; its log is reported as
:data:`IMPOSSIBLE` (-9999.0, what OpenAI and vLLM return) rather than
``-inf``, which JSON cannot carry. The top-N list holds only tokens the law
can emit, so a processed top list may be shorter than N (one entry at
temperature 0). Ties rank the lower token id first, as the greedy rule does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from saguaro_ray.algorithms.sampling import process_logits

IMPOSSIBLE = -9999.0  # the logprob of a token of probability 0 (finite: JSON has no -inf)


@dataclass
class TokenLogprobs:
    """One emitted token's log-probability and the ``top`` alternatives:
    ``(token id, logprob)`` pairs, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def top_n(logp: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of one row of log-probabilities, ties to
    the lower id, tokens of probability 0 left out (``torch.topk`` leaves the
    order of ties unspecified: every token tied with the n-th is a candidate,
    and a stable sort of the candidates decides)."""
    n = min(n, logp.shape[-1])
    if n <= 0:
        return []
    cut = torch.topk(logp, n).values[-1]
    ids = torch.nonzero(logp >= cut).squeeze(-1)  # ascending ids
    order = torch.sort(logp[ids], descending=True, stable=True).indices[:n]
    vals = logp[ids[order]]
    return [(int(i), float(v)) for i, v in zip(ids[order].tolist(), vals.tolist()) if v > float("-inf")]


def row_logprobs(raw: torch.Tensor, adjusted: torch.Tensor, mode: str, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities ``[R, V]`` of the rows of one sequence in ``mode``
    (``raw``: of ``raw``; ``processed``: of ``adjusted`` through the sampling
    filters); ``-inf`` where the law gives 0."""
    if mode == "raw":
        return torch.log_softmax(raw.float(), dim=-1)
    if mode != "processed":
        raise ValueError(f"unknown logprobs mode {mode!r} (SamplingParams checks it: raw or processed)")
    rows = adjusted.shape[0]
    p = process_logits(adjusted, [temperature] * rows, [top_k] * rows, [top_p] * rows)
    return torch.log(p)


def token_logprobs(logp: torch.Tensor, tokens: Sequence[int], n: int) -> list[TokenLogprobs]:
    """Row j of ``logp`` scores ``tokens[j]``: its logprob and the top ``n``."""
    out = []
    # one copy of the few emitted rows off an accelerator, rather than a sync per value read
    for row, t in zip(logp.cpu(), tokens):
        v = float(row[t])
        out.append(TokenLogprobs(int(t), v if v > float("-inf") else IMPOSSIBLE, top_n(row, n)))
    return out
