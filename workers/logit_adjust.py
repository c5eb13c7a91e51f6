"""Where a worker turns a model's raw logit rows into the rows its law is built from.

One call for every row a worker samples, verifies or ranks from — the
target's verification rows, the draft's drafting rows, its SSD glue rows and
tree steps, the qualifier's rows — so the target's law and the drafts'
proposals see the same penalties, bias and grammar (issue 21). The math is in
:mod:`saguaro_ray.algorithms.penalties` and :mod:`saguaro_ray.algorithms.grammar`
(through the worker's :class:`~saguaro_ray.workers.grammar_masks.GrammarMasks`);
this class only knows each row's history and hands it over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from saguaro_ray.algorithms.penalties import apply_penalties
from saguaro_ray.config import SamplingParams
from saguaro_ray.errors import ConfigError
from saguaro_ray.workers.grammar_masks import GrammarMasks
from saguaro_ray.workers.token_history import TokenHistory


@dataclass
class RowContext:
    """The history before the token one logit row predicts:
    ``tokens[:upto] + list(extra)``, of which the first ``prompt_len`` ids are
    the prompt. ``tokens`` is the worker's live list for ``seq_id`` (shared by
    the rows of one sequence, never copied); ``extra``: tokens not in the KV's
    list — an SSD tree branch's own."""

    seq_id: int
    params: SamplingParams
    tokens: Sequence[int]
    upto: int
    extra: Sequence[int] = ()
    prompt_len: int = 0


class LogitAdjuster:
    """A worker's logit adjustments, reading histories from its :class:`TokenHistory`.

    ``grammar``: the worker's structured-output masks (None: a worker without
    a tokenizer, which refuses ``response_format`` rows)."""

    def __init__(self, history: TokenHistory, grammar: GrammarMasks | None = None) -> None:
        self.history = history
        self.grammar = grammar

    def rows_after(self, seq_id: int, params: SamplingParams, n: int) -> list[RowContext]:
        """Contexts of the last ``n`` rows a forward returned for ``seq_id``:
        row j predicts the token after the first ``len - n + 1 + j`` held ids."""
        held = self.history.tokens(seq_id)
        plen = self.history.prompt_len(seq_id)
        return [RowContext(seq_id, params, held, len(held) - n + 1 + j, (), plen) for j in range(n)]

    def adjust(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
        """``logits [R, V]`` with each row's penalties and bias applied, then
        its grammar mask (-inf on what the grammar forbids; a new tensor; when
        no row adjusts, ``logits`` itself)."""
        if not any(r.params.adjusts_logits for r in rows):
            return logits
        logits = apply_penalties(logits, rows)
        if any(r.params.response_format is not None for r in rows):
            if self.grammar is None:
                raise ConfigError("response_format needs a worker that holds its model's tokenizer")
            logits = self.grammar.apply(logits, rows)
        return logits

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget the per-sequence state of finished sequences (their grammar states)."""
        if self.grammar is not None:
            self.grammar.release(seq_ids)
