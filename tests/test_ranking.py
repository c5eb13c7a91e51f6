"""A draft row's lazy ranking (``algorithms/ranking.py``) against a full sort."""

from __future__ import annotations

import random

import torch

from saguaro_ray.algorithms.ranking import RANK_DEPTH, RowOrder, ranks, top_order, top_tokens


def reference_order(row: torch.Tensor, exclude: int | None) -> list[int]:
    """Every token by descending logit, equal logits lower id first, ``exclude`` left out."""
    order = sorted(range(row.numel()), key=lambda t: (-float(row[t]), t))
    return [t for t in order if t != exclude]


def test_ranks_match_a_full_sort_with_ties_exclusions_and_the_depth_cap():
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    vocab = 300
    # coarse values: many equal logits, so the tie rule is exercised
    logits = torch.randint(-40, 40, (24, vocab), generator=gen).float() / 4
    rows, tokens, want = [], [], []
    for r in range(24):
        exclude = None if r % 4 == 0 else rng.randrange(vocab)
        full = reference_order(logits[r], exclude)
        # tokens near the top, around the cap, deep down, and the excluded one
        t = [full[0], full[rng.randrange(5)], full[RANK_DEPTH - 1], full[RANK_DEPTH], full[-1]][r % 5] if r % 6 else (exclude if exclude is not None else full[3])
        rows.append(RowOrder(logits[r], exclude))
        tokens.append(t)
        rank = full.index(t) + 1 if t in full else None
        want.append(rank if rank is not None and rank <= RANK_DEPTH else None)
    assert ranks(rows, tokens) == want
    # a few rows are read one at a time (a lookup at batch 1): the same ranks
    assert [ranks([row], [t])[0] for row, t in zip(rows, tokens)] == want
    assert ranks(rows[:3], tokens[:3]) == want[:3]
    # a row sent between drafts as a token list ranks the same
    listed = [RowOrder(reference_order(logits[r], None)[: RANK_DEPTH + 1], row.exclude) for r, row in enumerate(rows)]
    assert ranks(listed, tokens) == want
    assert ranks([None, rows[1]], [5, tokens[1]]) == [None, want[1]]


def test_top_tokens_are_the_first_of_the_order_without_the_excluded_token():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 500, generator=gen)  # continuous: no ties, the order is unique
    excludes = [None, int(logits[1].argmax()), 7, int(logits[3].topk(3).indices[2]), None, 9]
    depths = [1, 3, 8, 4, 0, 17]
    rows = [RowOrder(logits[r], e) for r, e in enumerate(excludes)]
    got = top_tokens(rows, depths)
    assert got == [reference_order(logits[r], e)[:d] for r, (e, d) in enumerate(zip(excludes, depths))]
    # token lists: the same, and never deeper than the list
    top5 = [top_order(logits[r : r + 1], 5)[0].tolist() for r in range(6)]
    assert top5 == [reference_order(logits[r], None)[:5] for r in range(6)]
    listed = [RowOrder(top5[r], e) for r, e in enumerate(excludes)]
    assert top_tokens(listed, depths) == [[t for t in top5[r] if t != e][:d] for r, (e, d) in enumerate(zip(excludes, depths))]
