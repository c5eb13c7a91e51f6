"""Resuming a sample from what its caller already has (a lost coordinator).

The coordinator holds the only copy of each running sequence's history, so
when it is lost its requests are gone from the engine — but not from their
callers: each has what it was given. A sample resubmitted with its
:class:`Emitted` (the token ids, their logprobs, the characters of text
shown) is rebuilt as the same sequence, those tokens already its output: the
workers prefill prompt + output, and it continues with the remaining budget,
its stop strings checked across the seam, its penalties and grammar over its
whole output, its usage counting the original prompt. At T = 0 the
continuation is the tokens the lost run would have emitted; at T > 0 it is
an exact sample of the target's law given that prefix (what the caller never
saw is simply drawn again). :func:`replay` is the one place a resumed
sequence takes its past.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from saguaro_ray.algorithms.logprobs import TokenLogprobs
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.errors import ConfigError
from saguaro_ray.tokenizer import IncrementalDecoder


@dataclass
class Emitted:
    """What one sample has given its caller so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    shown_chars: int = 0  # characters of text the caller was given (a stream's chunks)
    finish_reason: str | None = None  # set once the caller saw the sample end

    def add(self, token_ids: list[int], text: str = "", logprobs: list[TokenLogprobs] | None = None) -> None:
        self.token_ids += token_ids
        self.shown_chars += len(text)
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(logprobs)


def replay(seq: SequenceState, emitted: Emitted, eos_ids: tuple[int, ...]) -> None:
    """Make ``emitted`` the output of the fresh sequence ``seq``: emitted as
    the engine emits (so EOS, a stop, ``max_tokens`` end it as they would
    have — a sample lost between its last token and its end finishes at
    once), its stop checker fed every token and told what was shown."""
    tokens = list(emitted.token_ids)
    if not tokens:
        return
    if len(tokens) > seq.params.max_tokens:
        raise ConfigError(f"resume: {len(tokens)} emitted tokens exceed max_tokens={seq.params.max_tokens}")
    logprobs = emitted.logprobs
    if seq.logprobs is not None and (logprobs is None or len(logprobs) != len(tokens)):
        raise ConfigError("resume: the request asks for logprobs; give one per emitted token")
    seq.emit(tokens, eos_ids, logprobs if seq.logprobs is not None else None)
    if seq.stopper is not None:
        seq.stopper.mark_shown(emitted.shown_chars)


def primed_decoder(tokenizer: object, emitted: Emitted | None) -> IncrementalDecoder:
    """A stream's incremental decoder that has already shown ``emitted``'s text."""
    decoder = IncrementalDecoder(tokenizer)
    if emitted is not None and emitted.token_ids:
        decoder.tokens = list(emitted.token_ids)
        decoder.emitted = emitted.shown_chars
    return decoder
