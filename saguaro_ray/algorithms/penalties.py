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
    rows whose params neither penalise nor bias come back unchanged, and
    ``logits`` itself when no row does (a grammar alone needs no copy here)."""
    vocab = logits.shape[-1]
    todo = [r for r, h in enumerate(rows) if h.params.penalized]
    biased = [(r, t, b) for r, h in enumerate(rows) for t, b in h.params.logit_bias if t < vocab]
    if not todo and not biased:
        return logits
    out = logits.clone()
    if todo:
        _penalise(out, todo, rows, vocab)
    if biased:
        idx = torch.tensor([(r, t) for r, t, _ in biased], device=out.device)
        add = torch.tensor([b for _, _, b in biased], dtype=out.dtype, device=out.device)
        out.index_put_((idx[:, 0], idx[:, 1]), add, accumulate=True)
    return out


def _penalise(x: torch.Tensor, todo: Sequence[int], rows: Sequence[History], vocab: int) -> None:
    """Penalise rows ``todo`` of ``x`` in place. Sparse: only the ids a row's
    history holds change, so each row's entries are gathered and scattered (a
    dense [R, V] pass costs tens of ms a round at V = 49k on a CPU)."""
    base_len: dict[int, int] = {}
    first: dict[int, History] = {}
    for r in todo:
        h = rows[r]
        base_len[h.seq_id] = min(base_len.get(h.seq_id, h.upto), h.upto)
        first.setdefault(h.seq_id, h)
    # per sequence, its shared part once: every id present; the generated ids with their counts
    shared: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, set[int], set[int]]] = {}
    for s, h in first.items():
        n = base_len[s]
        held, gen = list(h.tokens[:n]), list(h.tokens[min(h.prompt_len, n) : n])
        present = torch.unique(torch.tensor(held, dtype=torch.long))
        gen_ids, gen_counts = torch.unique(torch.tensor(gen, dtype=torch.long), return_counts=True)
        shared[s] = (present, gen_ids, gen_counts.to(x.dtype), set(held), set(gen))
    # repetition entries (row, id): once per id present. Frequency/presence entries
    # (row, id, count, first): frequency is linear in the count, so a row's own
    # occurrences are entries of count 1 that index_put adds up; presence counts
    # once per id, so only on an id the shared part did not generate.
    rep_base, rep_lens, gen_base, gen_counts, gen_lens = [], [], [], [], []
    own_rep: list[tuple[int, int]] = []
    own_gen: list[tuple[int, int, float, float]] = []
    for r in todo:
        h = rows[r]
        n = base_len[h.seq_id]
        present, g_ids, g_counts, held_set, gen_set = shared[h.seq_id]
        rep_base.append(present)
        rep_lens.append(len(present))
        gen_base.append(g_ids)
        gen_counts.append(g_counts)
        gen_lens.append(len(g_ids))
        own = [(t, i >= h.prompt_len) for i, t in enumerate(h.tokens[n : h.upto], start=n)] + [(t, True) for t in h.extra]
        own_rep.extend((r, t) for t in dict.fromkeys(t for t, _ in own if t not in held_set))
        gen_own = [t for t, g in own if g]
        own_gen.extend((r, t, 1.0, 0.0) for t in gen_own)
        own_gen.extend((r, t, 0.0, 1.0) for t in dict.fromkeys(t for t in gen_own if t not in gen_set))
    dev, todo_t = x.device, torch.tensor(todo)
    p = [rows[r].params for r in range(len(rows))]
    rep = torch.tensor([q.repetition_penalty for q in p], dtype=x.dtype)
    freq = torch.tensor([q.frequency_penalty for q in p], dtype=x.dtype)
    pres = torch.tensor([q.presence_penalty for q in p], dtype=x.dtype)
    own_r = torch.tensor(own_rep, dtype=torch.long).view(-1, 2)
    rr = torch.cat([todo_t.repeat_interleave(torch.tensor(rep_lens)), own_r[:, 0]])
    ri = torch.cat([*rep_base, own_r[:, 1]])
    keep = ri < vocab  # ids past the model's rows (none in practice) cannot be penalised
    rr, ri = rr[keep], ri[keep]
    flat = x.view(-1)  # flat indices: index_select / index_copy_ / index_add_ beat 2-D advanced indexing
    idx = (rr * vocab + ri).to(dev)
    v = flat.index_select(0, idx)
    factor = rep[rr].to(dev)
    flat.index_copy_(0, idx, torch.where(v < 0, v * factor, v / factor))
    own_g = torch.tensor(own_gen, dtype=torch.float64).view(-1, 4)
    gr = torch.cat([todo_t.repeat_interleave(torch.tensor(gen_lens)), own_g[:, 0].long()])
    gi = torch.cat([*gen_base, own_g[:, 1].long()])
    count = torch.cat([*gen_counts, own_g[:, 2].to(x.dtype)])
    first_seen = torch.cat([torch.ones(sum(gen_lens), dtype=x.dtype), own_g[:, 3].to(x.dtype)])
    amount = freq[gr] * count + pres[gr] * first_seen
    keep = gi < vocab
    flat.index_add_(0, (gr[keep] * vocab + gi[keep]).to(dev), -amount[keep].to(dev))
