"""The token ids behind each sequence's KV cache in a worker.

Penalties and grammars are functions of the history before the token a logit
row predicts (DESIGN §4: the target applies them at every position of a
proposal, the proposed prefix counted; the draft when it drafts). The round
loop sends only what is new each round, so each worker keeps, beside its KV,
the ids that KV holds: prompt, generated tokens, and — while it sits in the
KV — speculation. Every change to a sequence's KV goes through
:meth:`TokenHistory.put` / :meth:`truncate` at the same place, so
``len(tokens(s)) == runner.seq_len(s)`` holds after every worker call (the
tests check it).
"""

from __future__ import annotations

from typing import Sequence


class TokenHistory:
    """Per sequence: the ids its KV holds and how many of them are the prompt."""

    def __init__(self) -> None:
        self._tokens: dict[int, list[int]] = {}
        self._prompt: dict[int, int] = {}

    def put(self, seq_id: int, pos: int, tokens: Sequence[int]) -> None:
        """The KV of ``seq_id`` now holds ``tokens`` from ``pos`` on (anything past ``pos`` was dropped)."""
        held = self._tokens.setdefault(seq_id, [])
        del held[pos:]
        held.extend(tokens)

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        self._tokens.setdefault(seq_id, []).extend(tokens)

    def truncate(self, seq_id: int, length: int) -> None:
        held = self._tokens.get(seq_id)
        if held is not None:
            del held[length:]

    def set_prompt_len(self, seq_id: int, n: int) -> None:
        self._prompt[seq_id] = n

    def tokens(self, seq_id: int) -> list[int]:
        """The held ids (the live list: read it, do not change it)."""
        return self._tokens.get(seq_id, [])

    def prompt_len(self, seq_id: int) -> int:
        """How many of the held ids are the prompt (0 when no step said)."""
        return self._prompt.get(seq_id, 0)

    def drop(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)
        self._prompt.pop(seq_id, None)
