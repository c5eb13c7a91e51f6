"""Chat messages → prompt token ids (stop strings are the engine's: :mod:`saguaro_ray.engine.stops`).

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
