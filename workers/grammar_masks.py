"""A worker's structured-output masks: the grammar state of every sequence it holds.

The grammar math lives in :mod:`saguaro_ray.algorithms.grammar`; this module
gives it what only a worker has: the tokenizer of its checkpoint (loaded on
the first structured request, and shared by the workers of one process — a
target and its self-draft open the same directory) and, per sequence, a
grammar state that outlives one call, so a verification after a proposal
rolls back only the rejected tail and accepts the new tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from saguaro_ray.algorithms.grammar import GrammarCompiler, SequenceGrammar, apply_bitmask, new_bitmask
from saguaro_ray.config import ResponseFormat
from saguaro_ray.tokenizer import end_of_sequence_ids, load_tokenizer

if TYPE_CHECKING:
    from saguaro_ray.workers.logit_adjust import RowContext


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
    """One compiler per tokenizer and vocabulary in a process (~0.1 s to build)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    return GrammarCompiler(tokenizer, vocab_size, end_of_sequence_ids(eos_ids, tokenizer))


class GrammarMasks:
    """Masks the rows of constrained sequences by their grammar state.

    ``tokenizer_dir``: the checkpoint directory holding the tokenizer;
    ``vocab_size``: the logit width; ``eos_ids``: the ids allowed once the
    grammar is complete (the target's end-of-sequence ids)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._key = (str(tokenizer_dir), vocab_size, tuple(eos_ids))
        self._states: dict[int, tuple[ResponseFormat, SequenceGrammar]] = {}

    @classmethod
    def for_runner(cls, runner: Any) -> "GrammarMasks":
        """The masks of a worker running ``runner`` (a :class:`ModelRunner` or
        its tensor-parallel proxy): its checkpoint's tokenizer, its logit
        width, and its end-of-sequence ids (the tokenizer's when the config
        names none, as :attr:`ModelSet.eos_ids` reads them). Nothing is loaded
        until a structured request arrives."""
        return cls(str(runner.checkpoint.path), runner.vocab_size, runner.eos_token_ids)

    def apply(self, logits: torch.Tensor, rows: "Sequence[RowContext]") -> torch.Tensor:
        """``logits [R, V]`` with each constrained row's disallowed tokens at -inf
        (a new tensor), or ``logits`` itself when no row is constrained."""
        picked = [i for i, r in enumerate(rows) if r.params.response_format is not None and r.upto >= r.prompt_len]
        if not picked:
            return logits
        bitmask = new_bitmask(len(picked), logits.shape[-1])
        for j, i in enumerate(picked):
            r = rows[i]
            generated = list(r.tokens[r.prompt_len : r.upto])
            generated.extend(r.extra)
            self._state(r.seq_id, r.params.response_format).fill(generated, bitmask, j)
        return apply_bitmask(logits, bitmask, picked)

    def __len__(self) -> int:
        """How many sequences hold a grammar state here."""
        return len(self._states)

    def release(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            self._states.pop(s, None)

    def _state(self, seq_id: int, fmt: ResponseFormat) -> SequenceGrammar:
        held = self._states.get(seq_id)
        if held is None or held[0] != fmt:
            held = (fmt, _compiler(*self._key).start(fmt))
            self._states[seq_id] = held
        return held[1]
