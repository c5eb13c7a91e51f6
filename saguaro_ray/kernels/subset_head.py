"""A draft's LM head over N token ids: logits for those rows only, -inf elsewhere.

A small draft's step is dominated by its LM head (SmolLM2-135M's is
49152 × 576: ~35 % of the bytes an ``self:int4`` step reads, most of a 1-layer
distilled draft's), so a draft may compute logits for a subset of the
vocabulary only (``EngineConfig(draft_vocab=N)``). The head's rows are sliced
once at load, before the runner quantises or packs its linears, so the
subset head is quantised / packed exactly as the full head would be (int8 per
output channel and int4 per group are both per row: the subset's rows are the
full head's rows, bit for bit). Its output is scattered into a
full-vocabulary tensor whose other entries are -inf, so everything
downstream — sampling, the q rows proposals carry, SSD's fan-out ranking,
logit adjustments, verification — is unchanged, and the draft's law is
exactly the law its tokens are drawn from, with q = 0 outside the subset.
Verification stays exact whatever q is; the subset only costs acceptance
where the target's token lies outside it.

Which ids (:func:`subset_ids`): every special token of the tokenizer (EOS
among them) and then the lowest ids. A byte-level BPE vocabulary is numbered
in merge order, which follows frequency in the tokenizer's training corpus,
so its first ids are the common ones — free, deterministic, and needing no
data. Measured on SmolLM2-135M-Instruct against the N most frequent ids of
the target's own greedy text (the distillation teacher data: 17 245 tokens
from 168 chat and HumanEval-train prompts for the counts; coverage counted on
2 569 tokens of the 24 held-out prompts' greedy continuations):

=======  =====================  =================================
N        first N ids (chosen)   N most frequent in target text
=======  =====================  =================================
4096     0.805                  0.880 (only 1 992 ids ever seen)
8192     0.887                  0.880
16384    0.946                  0.880
=======  =====================  =================================

The most-frequent list saturates at the ids its data ever saw (1 992), and
filling it up with the first ids would give 0.914 / 0.948 / 0.974 — better,
but it would make a draft option generate ~15 minutes of target text on first
use, and the held-out prompts share the training prompts' subjects, which
flatters it. So the first-N rule stands.

Measured (docs/performance.md, "A reduced-vocabulary draft head"): for ``self:int4`` the int8
head is only ~15 % of a step and the subset loses more acceptance than it saves (SSD's hit
rate falls most); for a 1-layer distilled draft it makes the step 2–3× cheaper at almost no
acceptance cost. So the option exists for small drafts and is off by default.

The full head is kept beside the subset one: :meth:`SubsetHead.full_logits`
gives full-vocabulary logits for rows whose adjusted subset logits allow no
token at all (a grammar that only allows ids outside the subset), so such
a row still gets a proper law (see ``DraftLogic.adjust_rows``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from saguaro_ray.errors import ConfigError


def check_draft_vocab(n: object) -> None:
    """Refuse a ``draft_vocab`` that is not ``None`` or a positive integer
    (:class:`ConfigError` naming it); one at or above a model's vocabulary
    size means the full head."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"draft_vocab must be a positive integer (token ids the draft's head covers) or None, got {n!r}")


def subset_ids(vocab_size: int, n: int, always: Iterable[int]) -> torch.Tensor:
    """``n`` (< ``vocab_size``) token ids, ascending: every id of ``always``
    (the special tokens) and the lowest other ids. ``n`` below the number of
    ``always`` ids is a :class:`ConfigError` naming ``draft_vocab``."""
    keep = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    if len(keep) > n:
        raise ConfigError(f"draft_vocab={n} cannot hold the tokenizer's {len(keep)} special token ids; use at least {len(keep)}")
    special = set(keep)
    others = [i for i in range(n) if i not in special][: n - len(keep)]
    return torch.tensor(sorted(special.union(others)), dtype=torch.long)


class SubsetHead(nn.Module):
    """An LM head that computes the rows ``ids`` of ``full`` and returns
    ``[..., V]`` logits that are -inf at every other id.

    ``full`` (a plain ``nn.Linear``, possibly sharing its weight with a tied
    embedding) stays as a child for :meth:`full_logits`; ``subset`` is a new
    ``nn.Linear`` over copies of its rows. Both are plain linears, so the
    runner's kernels (packing, quantisation) replace them like any other.
    """

    def __init__(self, full: nn.Linear, ids: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = full.out_features
        self.full = full
        self.subset = nn.Linear(full.in_features, len(ids), bias=full.bias is not None, device=full.weight.device, dtype=full.weight.dtype)
        ids = ids.to(full.weight.device)
        with torch.no_grad():
            self.subset.weight.copy_(full.weight[ids])
            if full.bias is not None:
                self.subset.bias.copy_(full.bias[ids])
        self.subset.requires_grad_(False)
        self.register_buffer("ids", ids, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.subset(x)
        out = y.new_full((*y.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, y)

    def full_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The full head's logits of ``x`` (every id)."""
        return self.full(x)

    def extra_repr(self) -> str:
        return f"ids={len(self.ids)} of {self.vocab_size}"


__all__ = ["SubsetHead", "check_draft_vocab", "subset_ids"]
