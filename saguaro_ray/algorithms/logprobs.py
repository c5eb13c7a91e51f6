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


def top_n(logp: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
    """The ``n`` most likely tokens of each row of log-probabilities
    ``[R, V]``, ties to the lower id, tokens of probability 0 left out.

    ``torch.topk`` leaves the order of ties unspecified, so its picks are
    re-sorted by (value, id); where more tokens than n tie with the n-th,
    topk's choice among them need not be the lower ids', and that row's
    candidates — every token at least as likely as the n-th — are sorted
    instead."""
    n = min(n, logp.shape[-1])
    if n <= 0:
        return [[] for _ in range(logp.shape[0])]
    vals, ids = torch.topk(logp, n, dim=-1)
    cut = vals[:, -1:]
    # a cut at -inf means topk took every possible token: nothing was left to choose
    ambiguous = ((cut[:, 0] > float("-inf")) & ((logp >= cut).sum(-1) > n)).tolist()
    out = []
    for r, (row_vals, row_ids) in enumerate(zip(vals.tolist(), ids.tolist())):
        if ambiguous[r]:
            row = logp[r]
            cand = torch.nonzero(row >= cut[r]).squeeze(-1)  # ascending ids
            order = torch.sort(row[cand], descending=True, stable=True).indices[:n]
            row_ids, row_vals = cand[order].tolist(), row[cand[order]].tolist()
        pairs = sorted(zip(row_ids, row_vals), key=lambda p: (-p[1], p[0]))
        out.append([(int(t), float(v)) for t, v in pairs if v > float("-inf")])
    return out


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
    # log(0) is slow on CPUs (a one-hot row is all zeros but one): take logs of the rest only
    return torch.where(p > 0, p, 1.0).log().masked_fill_(p == 0, float("-inf"))


def token_logprobs(logp: torch.Tensor, tokens: Sequence[int], n: int) -> list[TokenLogprobs]:
    """Row j of ``logp`` scores ``tokens[j]``: its logprob and the top ``n``."""
    logp = logp.cpu()  # one copy of the few emitted rows off an accelerator, rather than a sync per value read
    own = logp.gather(-1, torch.tensor(list(tokens), dtype=torch.long).unsqueeze(-1)).squeeze(-1).tolist()
    return [TokenLogprobs(int(t), v if v > float("-inf") else IMPOSSIBLE, top) for t, v, top in zip(tokens, own, top_n(logp, n))]
