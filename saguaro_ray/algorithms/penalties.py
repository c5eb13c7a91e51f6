"""Penalties and logit bias: the target's law as OpenAI / Hugging Face define it.

Applied to raw logits before temperature, top-k and top-p, in this order:

1. ``repetition_penalty`` r (Keskar et al. 2019, Hugging Face's
   ``RepetitionPenaltyLogitsProcessor``): every token present in the history
   (prompt and generated) has its logit divided by r when positive,
   multiplied by r when negative;
2. ``frequency_penalty`` f and ``presence_penalty`` s (OpenAI): with c the
   number of times a token was *generated* so far, its logit loses
   ``f * c + s * (c > 0)``;
3. ``logit_bias``: a fixed amount added to the listed tokens.

Exactness under speculation needs one thing of this module: that a row's
result depends on nothing but the history before the token it predicts. The
workers hand it that history for every row — committed tokens plus the
proposed (or branch) prefix — so the target penalises each position of a
proposal as plain decoding would have, and a draft drafts from the same law
(high acceptance; its q is whatever it sampled from).

Rows come in groups sharing one history list (the rows of one sequence's
proposal): the counts of the shared part are taken once per group, each row
adds only its few tokens beyond it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from saguaro_ray.config import SamplingParams


class History(Protocol):
    """What a row's history is: ``tokens[:upto] + extra``, the first
    ``prompt_len`` of ``tokens`` being the prompt (see
    :class:`saguaro_ray.workers.logit_adjust.RowContext`)."""

    seq_id: int
    params: SamplingParams
    tokens: Sequence[int]
    upto: int
    extra: Sequence[int]
    prompt_len: int


def apply_penalties(logits: torch.Tensor, rows: Sequence[History]) -> torch.Tensor:
    """Penalised and biased copy of ``logits [R, V]`` (row r for ``rows[r]``);
    rows whose params neither penalise nor bias come back unchanged."""
    out = logits.clone()
    vocab = logits.shape[-1]
    todo = [r for r, h in enumerate(rows) if h.params.penalized]
    if todo:
        out[todo] = _penalised(out[todo].float(), [rows[r] for r in todo], vocab).to(out.dtype)
    biased = [(r, t, b) for r, h in enumerate(rows) for t, b in h.params.logit_bias if t < vocab]
    if biased:
        idx = torch.tensor([(r, t) for r, t, _ in biased], device=out.device)
        add = torch.tensor([b for _, _, b in biased], dtype=out.dtype, device=out.device)
        out.index_put_((idx[:, 0], idx[:, 1]), add, accumulate=True)
    return out


def _penalised(x: torch.Tensor, rows: Sequence[History], vocab: int) -> torch.Tensor:
    dev = x.device
    # the shared part of each sequence's history: counted once per group
    base_len: dict[int, int] = {}
    for h in rows:
        base_len[h.seq_id] = min(base_len.get(h.seq_id, h.upto), h.upto)
    groups = list(base_len)
    first = {s: next(h for h in rows if h.seq_id == s) for s in groups}
    gen_counts = torch.zeros(len(groups), vocab, dtype=torch.float32)
    seen = torch.zeros(len(groups), vocab, dtype=torch.bool)
    for g, s in enumerate(groups):
        h, n = first[s], base_len[s]
        held = torch.tensor(h.tokens[:n], dtype=torch.long)
        held = held[held < vocab]  # ids past the model's rows (none in practice) cannot be penalised
        gen = torch.tensor(h.tokens[min(h.prompt_len, n) : n], dtype=torch.long)
        gen_counts[g] = torch.bincount(gen[gen < vocab], minlength=vocab)[:vocab].float()
        seen[g, held] = True
    index = {s: g for g, s in enumerate(groups)}
    which = torch.tensor([index[h.seq_id] for h in rows])
    counts = gen_counts[which]
    present = seen[which]
    # each row's own tokens past the shared part (a proposal's prefix, a
    # branch): present for the repetition penalty, counted where generated
    own: list[tuple[int, int, bool]] = []
    for r, h in enumerate(rows):
        n = base_len[h.seq_id]
        own.extend((r, t, i >= h.prompt_len) for i, t in enumerate(h.tokens[n : h.upto], start=n))
        own.extend((r, t, True) for t in h.extra)
    own = [o for o in own if 0 <= o[1] < vocab]
    if own:
        idx = torch.tensor([(r, t) for r, t, _ in own])
        present[idx[:, 0], idx[:, 1]] = True
        gen = torch.tensor([g for _, _, g in own], dtype=torch.float32)
        counts.index_put_((idx[:, 0], idx[:, 1]), gen, accumulate=True)
    counts, present = counts.to(dev), present.to(dev)
    rep = torch.tensor([h.params.repetition_penalty for h in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    freq = torch.tensor([h.params.frequency_penalty for h in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    pres = torch.tensor([h.params.presence_penalty for h in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    x = torch.where(present, torch.where(x < 0, x * rep, x / rep), x)
    return x - freq * counts - pres * (counts > 0).float()
