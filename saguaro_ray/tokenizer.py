"""Loading a checkpoint's tokenizer and checking that models can share one.

Tokenizers come from the checkpoint directory through ``transformers``'
``AutoTokenizer`` (tokenization only — no modelling code). Speculation is only
meaningful when draft and target agree on what every token id means, so
:func:`check_same_vocabulary` compares the full vocabularies, not just sizes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from saguaro_ray.errors import CheckpointError, IncompatibleModelsError


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer saved in a model directory (a ``PreTrainedTokenizerFast``)."""
    from transformers import AutoTokenizer

    root = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{root}: cannot load the tokenizer ({exc})") from exc


def end_of_sequence_ids(config_eos: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """A model's end-of-sequence ids: its config's, else its tokenizer's."""
    return config_eos or tuple(t for t in (tokenizer.eos_token_id,) if t is not None)


def check_same_vocabulary(target_tok: Any, other_tok: Any, other_name: str) -> None:
    """Raise :class:`IncompatibleModelsError` unless both tokenizers map every
    token string to the same id."""
    a, b = target_tok.get_vocab(), other_tok.get_vocab()
    if a == b:
        return
    if len(a) != len(b):
        raise IncompatibleModelsError(
            f"{other_name} tokenizer has {len(b)} tokens, the target's has {len(a)}; speculation needs one shared vocabulary"
        )
    differing = sorted(k for k in a if b.get(k) != a[k])[:3]
    raise IncompatibleModelsError(
        f"{other_name} tokenizer maps tokens differently from the target's (e.g. {differing}); "
        "speculation needs one shared vocabulary"
    )


class IncrementalDecoder:
    """Turns a growing token stream into text chunks for streaming.

    Byte-level BPE tokens can split a UTF-8 character, so text is only
    released once decoding the tokens so far no longer ends in a replacement
    character; the concatenated chunks equal decoding everything at once.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the decoded text already released

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        chunk = text[self.emitted :]
        self.emitted = len(text)
        return chunk

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        chunk = text[self.emitted :]
        self.emitted = len(text)
        return chunk
