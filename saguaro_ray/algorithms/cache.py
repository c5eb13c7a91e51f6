"""The SSD speculation cache: predicted round outcomes → ready speculations.

While the target verifies round T, a draft pre-computes one speculation for
each predicted outcome v_T = (k, t*) of each sequence. When the real outcome
arrives it is looked up here: a hit returns the speculation at once, a miss
sends the sequence to the backup speculator. Only the latest round's entries of
a sequence are meaningful (older ones predicted outcomes of a round that is
over), so :meth:`SpeculationCache.put_round` replaces them wholesale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch


@dataclass
class Speculation:
    """One pre-computed speculation for a predicted outcome (k, t*).

    ``tokens``: the K proposed tokens (the draft's race winners, or argmaxes at
    temperature 0: the drafter-invariant rule reads no law). ``branch``: an
    opaque index the draft uses to find the branch's scratch KV (for the KV
    delta on a hit).
    """

    tokens: list[int] | torch.Tensor
    branch: int = -1

    def __len__(self) -> int:
        return len(self.tokens)


Key = tuple[int, int]


class SpeculationCache:
    """Per-sequence map (k, t*) → :class:`Speculation`, with hit statistics."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, dict[Key, Speculation]] = {}
        self._lookups = 0
        self._hits = 0

    def put_round(self, seq_id: Hashable, entries: dict[Key, Speculation]) -> None:
        """Install this round's speculations for ``seq_id``, dropping the previous round's."""
        self._entries[seq_id] = {(int(k), int(t)): s for (k, t), s in entries.items()}

    def lookup(self, seq_id: Hashable, k: int, t: int) -> Speculation | None:
        """The speculation for outcome (k, t) of ``seq_id``, or None (a miss). Counted."""
        self._lookups += 1
        spec = self._entries.get(seq_id, {}).get((int(k), int(t)))
        if spec is not None:
            self._hits += 1
        return spec

    def drop(self, seq_id: Hashable) -> None:
        """Forget a sequence (finished, aborted, or its draft state was rebuilt)."""
        self._entries.pop(seq_id, None)

    def keys(self, seq_id: Hashable) -> list[Key]:
        """The predicted outcomes currently held for ``seq_id`` (insertion order)."""
        return list(self._entries.get(seq_id, {}))

    def sequences(self) -> list[Hashable]:
        """Sequence ids with entries."""
        return list(self._entries)

    def stats(self) -> dict[str, float]:
        """``lookups``, ``hits`` and ``hit_rate`` (0.0 before any lookup) since creation/reset."""
        return {
            "lookups": self._lookups,
            "hits": self._hits,
            "hit_rate": self._hits / self._lookups if self._lookups else 0.0,
        }

    def reset_stats(self) -> None:
        self._lookups = 0
        self._hits = 0

    def __len__(self) -> int:
        """Total number of held speculations across sequences."""
        return sum(len(e) for e in self._entries.values())

    def __contains__(self, key: tuple[Hashable, int, int]) -> bool:
        """``(seq_id, k, t) in cache`` — a membership test that does not count as a lookup."""
        seq_id, k, t = key
        return (int(k), int(t)) in self._entries.get(seq_id, {})
