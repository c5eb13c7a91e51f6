"""A draft row's ranking of next tokens, read from the row only as deep as asked.

SSD reads a glue row's ranking twice: its first F_k tokens (the drafted token
excluded — it cannot be the recovery token) are the branches a build decodes,
and the rank of the real recovery token t* is the observation the fan-out
estimator fits its power law to. Sorting the top ``RANK_DEPTH + 1`` tokens of
every row up front costs more than both uses together: on the reference CPU a
top-65 of a 4096-token row takes ~30 µs, and ~160 µs for five rows right
after a forward (cold branch predictors) — on the critical path of every
build and of every hit's lookup. The branches need a handful of tokens (one
small ``topk`` for all rows of a build), and a rank is one comparison over
the row.

A row's source is its logits (a ``[V]`` tensor, in the draft that computed
it) or a token list in descending order (a peer draft's KV delta, which
travels as lists). Equal logits rank the lower token id first.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

RANK_DEPTH = 64  # ranks beyond this are not observed (None), as the estimator needs no deeper
ROW_BY_ROW = 4  # ranks of up to this many logit rows are read one row at a time (see ranks)

RowSource = Union[torch.Tensor, Sequence[int]]


def top_order(logits: torch.Tensor, depth: int = RANK_DEPTH + 1) -> torch.Tensor:
    """Token ids of each row of ``logits [R, V]`` by descending logit, the first ``depth``."""
    return torch.topk(logits, min(depth, logits.shape[-1]), dim=-1, sorted=True).indices


class RowOrder:
    """One row's ranking of next tokens, ``exclude`` (the drafted token) left out."""

    __slots__ = ("source", "exclude")

    def __init__(self, source: RowSource, exclude: int | None = None) -> None:
        self.source = source
        self.exclude = exclude

    @property
    def lazy(self) -> bool:
        """Read from logits (True) or from a token list."""
        return isinstance(self.source, torch.Tensor)


def top_tokens(rows: Sequence[RowOrder], depths: Sequence[int]) -> list[list[int]]:
    """The first ``depths[r]`` tokens of each row, its excluded token left out
    (fewer where a listed row is shorter) — one ``topk`` for all logit rows."""
    out: list[list[int]] = [[] for _ in rows]
    lazy = [r for r, row in enumerate(rows) if row.lazy and depths[r] > 0]
    if lazy:
        logits = torch.stack([rows[r].source for r in lazy])  # type: ignore[misc]
        found = top_order(logits, max(depths[r] for r in lazy) + 1).tolist()
        for r, order in zip(lazy, found):
            out[r] = order
    for r, row in enumerate(rows):
        if not row.lazy:
            out[r] = list(row.source)  # type: ignore[arg-type]
        out[r] = [t for t in out[r] if t != row.exclude][: depths[r]]
    return out


def _ahead_of(row: torch.Tensor, token: int, exclude: int | None) -> int:
    """How many tokens one logit row ranks before ``token`` (``exclude`` left
    out): greater logits, and equal ones with a lower id — a few scalar reads
    and two comparisons over the row, no batch tensors to build."""
    value = float(row[token])
    ahead = int((row > value).sum()) + int((row[:token] == value).sum())
    if exclude is not None:
        ex = float(row[exclude])
        ahead -= ex > value or (ex == value and exclude < token)
    return ahead


def ranks(rows: Sequence[RowOrder | None], tokens: Sequence[int]) -> list[int | None]:
    """The 1-based rank of ``tokens[r]`` in row r (its excluded token left
    out); None where there is no row, the token is the excluded one, or it
    ranks beyond ``RANK_DEPTH`` — one comparison over all logit rows (row by
    row for a few: a lookup at batch 1 ranks one t*, and building the batch
    tensors cost ~0.2 ms of its ~0.35)."""
    out: list[int | None] = [None] * len(rows)
    lazy = [r for r, row in enumerate(rows) if row is not None and row.lazy and tokens[r] != row.exclude]
    if 0 < len(lazy) <= ROW_BY_ROW:
        for r in lazy:
            c = _ahead_of(rows[r].source, tokens[r], rows[r].exclude)  # type: ignore[union-attr,arg-type]
            out[r] = c + 1 if c < RANK_DEPTH else None
        lazy = []
    if lazy:
        logits = torch.stack([rows[r].source for r in lazy])  # type: ignore[union-attr,misc]
        ids = torch.arange(logits.shape[-1], device=logits.device)
        tok = torch.tensor([tokens[r] for r in lazy], device=logits.device).unsqueeze(1)
        value = logits.gather(1, tok)
        above = (logits > value) | ((logits == value) & (ids < tok))  # tokens ranked before t
        ex = [rows[r].exclude for r in lazy]  # type: ignore[union-attr]
        ex_t = torch.tensor([e if e is not None else 0 for e in ex], device=logits.device).unsqueeze(1)
        ex_above = above.gather(1, ex_t).squeeze(1) & torch.tensor([e is not None for e in ex], device=logits.device)
        counts = (above.sum(1) - ex_above.long()).tolist()
        for r, c in zip(lazy, counts):
            out[r] = c + 1 if c < RANK_DEPTH else None
    for r, row in enumerate(rows):
        if row is not None and not row.lazy and tokens[r] != row.exclude:
            order = [t for t in row.source if t != row.exclude][:RANK_DEPTH]  # type: ignore[union-attr]
            out[r] = order.index(tokens[r]) + 1 if tokens[r] in order else None
    return out
