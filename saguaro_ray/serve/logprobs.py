"""The engine's per-token logprobs in OpenAI's two response shapes.

Completions (the legacy shape): ``{"tokens", "token_logprobs",
"top_logprobs" (a dict token → logprob per position), "text_offset"}``.
Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": None}``. A token's string is
its own decoded text (special tokens included, as vLLM shows them) and
``bytes`` its UTF-8 encoding; a token that is part of a multi-byte
character decodes to U+FFFD, as it does in vLLM. ``text_offset`` is where a
token's text starts in the choice's text: the length of the text of the
tokens before it. Values are :mod:`saguaro_ray.algorithms.logprobs`' —
finite, -9999.0 for a token the law cannot emit.
"""

from __future__ import annotations

from typing import Any, Sequence

from saguaro_ray.algorithms.logprobs import TokenLogprobs


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(tokenizer: Any, entries: Sequence[TokenLogprobs], before: Sequence[int] = ()) -> dict[str, Any]:
    """The legacy ``logprobs`` object of ``entries``; ``before``: the
    choice's token ids ahead of them (a stream's earlier chunks), for the offsets."""
    ids = list(before)
    offsets = []
    for e in entries:
        offsets.append(len(tokenizer.decode(ids, skip_special_tokens=True)))
        ids.append(e.token)
    return {
        "tokens": [token_text(tokenizer, e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``entries``."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries], "refusal": None}
