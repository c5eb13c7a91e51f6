"""Chat messages → prompt token ids, and stop-string handling.

The chat template comes from the target's tokenizer (``chat_template`` in its
``tokenizer_config.json``), or from the deployment's ``chat_template`` option.
A tokenizer without one still serves ``/v1/chat/completions`` through the
**plain fallback template**::

    System: {content}\\n
    User: {content}\\n
    Assistant: {content}\\n
    ...
    Assistant:

(each message as ``{Role}: {content}`` on its own line, the role capitalised,
then ``Assistant:`` to prompt the reply). It is a readable, model-agnostic
format, not one any model was trained on; give base models a real template
when quality matters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FALLBACK_ASSISTANT_PREFIX = "Assistant:"


def render_fallback(messages: Sequence[dict[str, str]]) -> str:
    """The plain fallback template (see the module docstring)."""
    lines = [f"{m['role'].strip().capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, FALLBACK_ASSISTANT_PREFIX])


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]], template: str | None = None) -> str:
    """``messages`` as the text the chat template renders for generation (an
    assistant turn opened at the end), or the plain fallback without one."""
    if template or has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False, add_generation_prompt=True)
    return render_fallback(messages)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]], template: str | None = None) -> list[int]:
    """Token ids of ``messages`` rendered for generation. The template's own
    special tokens (e.g. a BOS it writes) are kept; nothing else is added."""
    return list(tokenizer.encode(render_chat(tokenizer, messages, template), add_special_tokens=False))


class StopMatcher:
    """Cuts a growing text at the first of several stop strings.

    ``push(chunk)`` returns the text that is safe to release: everything that
    cannot be the start of a stop string. Once a stop string appears,
    ``stopped`` is set and the text before it is released; ``flush()``
    releases what was held back at the end of a stream. With no stop strings
    every chunk is released as is.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.stopped = False

    def push(self, chunk: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return chunk
        self.buffer += chunk
        cut = first_stop(self.buffer, self.stops)
        if cut is not None:
            self.stopped = True
            out, self.buffer = self.buffer[:cut], ""
            return out
        safe = len(self.buffer) - self.hold
        if safe <= 0:
            return ""
        out, self.buffer = self.buffer[:safe], self.buffer[safe:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or ``None``."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def tokens_for_text(tokenizer: Any, token_ids: Sequence[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text covers ``chars`` characters
    (for usage after a stop-string cut)."""
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(list(token_ids[:mid]), skip_special_tokens=True)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo
