"""Stop strings and stop token ids: where a sequence ends, decided by the engine.

The one home of the cutting rule. After every emitted token (in token order,
so a speculative round that emits several tokens stops exactly where
autoregressive decoding would), the text decoded so far is searched for the
stop strings; the first token at which any appears ends the sequence, the
tokens after it are dropped, and the text is cut where the earliest of the
stop strings present starts (the stop string itself excluded, as OpenAI
does). A token of ``stop_token_ids`` ends the sequence too: it stays in the
token ids (like EOS) and its text is left out.

Because the check runs on the coordinator after each round, decoding stops in
the round that meets a stop instead of running on to ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or ``None``."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


class StopChecker:
    """One sequence's stop state; ``accept`` is fed every emitted token.

    ``text`` is the decoded text so far (without a trailing incomplete UTF-8
    character), cut at the stop once ``stopped``. ``release`` hands a stream
    the part of it no later token can take back: a tail that could still
    grow into a stop string is held until it either does or cannot."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tokens: list[int] = []  # the tokens whose text counts (a stop token id's does not)
        self.text = ""
        self.stopped = False
        self._released = 0  # characters of ``text`` a stream has been given

    def accept(self, token: int) -> bool:
        """Take one emitted token; True when the sequence stops with it."""
        if token in self.stop_token_ids:
            self.stopped = True
            return True
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).rstrip("\ufffd")
        cut = first_stop(text, self.stops)
        if cut is not None:
            self.stopped = True
            text = text[:cut]
        self.text = text
        return self.stopped

    def final_text(self) -> str:
        """The sequence's whole text once it has finished."""
        if self.stopped:
            return self.text
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def release(self, finished: bool) -> str:
        """The text a stream may show now that it has not shown yet."""
        if finished:
            text = self.final_text()
            end = len(text)
        else:
            text = self.text
            end = len(text) - self._held(text)
        if end <= self._released:
            return ""
        out, self._released = text[self._released : end], end
        return out

    def mark_shown(self, chars: int) -> None:
        """A resumed stream's caller was already given ``chars`` characters
        (see :mod:`saguaro_ray.engine.resume`): release continues after them."""
        self._released = chars

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that starts some stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
