"""Point-mass guesses for the *fast* backup speculator.

On an SSD cache miss the fast backup must cost next to nothing, so it guesses
from the sequence's own history (prompt-lookup style): find the most recent
earlier occurrence of the last ``n`` tokens and propose what followed it.
The guess is deterministic, so verification treats each token as a point
mass δ_x — exact whatever the guess is.
"""

from __future__ import annotations

from typing import Sequence


def ngram_guess(history: Sequence[int], k: int, max_n: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the history's
    last ``n`` tokens (longest n first, n ≤ ``max_n``); repeats the last token
    when nothing matches. Always returns exactly ``k`` tokens (k ≥ 0)."""
    if k <= 0 or not history:
        return []
    h = list(history)
    for n in range(min(max_n, len(h) - 1), 0, -1):
        tail = h[-n:]
        for start in range(len(h) - n - 1, -1, -1):
            if h[start : start + n] == tail:
                follow = h[start + n : start + n + k]
                if follow:
                    return (follow + [follow[-1]] * k)[:k]
    return [h[-1]] * k
