"""Structured output: the grammar mask of a ``response_format``, through xgrammar.

The library was chosen by measurement (docs/structured_output.md): on
SmolLM2's 49,152-token vocabulary xgrammar compiles JSON grammars in a few
milliseconds, fills a token mask in microseconds, rolls back any number of
tokens and holds a few MB; llguidance is close but larger, outlines-core takes
seconds to compile ``{"type": "object"}``. No JSON grammar is written here.

Exactness under speculation needs only that every logit row is masked by the
grammar state *of the history that row predicts after*: committed tokens, then
the proposed prefix (or, in an SSD tree, the branch's own prefix). Rows of one
sequence arrive as a walk over such histories, mostly extending the last one
by a token, sometimes stepping back to a shorter prefix (a rejected proposal,
another branch). :class:`SequenceGrammar` keeps one matcher per sequence and
moves it along that walk: roll back to the common prefix, accept the rest. A
row whose history the grammar already rejects (a token the draft proposed
without masking) can never be emitted from — its own token had probability
zero — so it gets the EOS-only row, which keeps every law well defined.

Once the grammar is complete only the model's EOS ids are allowed, so
generation ends there (with ``ignore_eos`` it keeps emitting EOS, the only
valid continuation, until ``max_tokens``).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy
import torch

if TYPE_CHECKING:  # imported when a grammar is first compiled: an engine that never sees a
    import xgrammar  # response_format (a GPU check with no xgrammar, say) does not need it

from saguaro_ray.config import ResponseFormat
from saguaro_ray.errors import ConfigError

log = logging.getLogger(__name__)

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its message
_BITS = 32  # xgrammar packs a mask as int32 words, bit i of word w = token 32*w + i
MAX_CACHED_GRAMMARS = 64  # compiled formats kept per compiler (running sequences hold their own reference)


class GrammarCompiler:
    """Compiles response formats for one tokenizer and model vocabulary.

    One per tokenizer in a process (its workers share it): building
    xgrammar's tokenizer index costs ~0.1 s, a compile a few ms, so both are
    done once and the latest compiled grammars
    are cached by their :class:`ResponseFormat` (hashable; the schema is its text).
    ``vocab_size`` is the model's logit width, which may exceed the
    tokenizer's: the padding ids are never allowed.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        if not eos_ids:
            raise ConfigError("response_format needs the model's end-of-sequence token id; the checkpoint names none")
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        import xgrammar

        self._info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(self.eos_ids))
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)  # ours is bounded
        self._compiled: OrderedDict[ResponseFormat, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, fmt: ResponseFormat) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``fmt``; a schema xgrammar cannot compile
        raises :class:`ConfigError` naming ``response_format``. Thread-safe:
        the workers of one process (threads of the in-process engine) share a compiler."""
        with self._lock:
            hit = self._compiled.get(fmt)
            if hit is not None:
                self._compiled.move_to_end(fmt)
                return hit
            compiled = self._compile(fmt)
            self._compiled[fmt] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:  # every request may bring its own schema: keep the recent ones
                self._compiled.popitem(last=False)
            return compiled

    def _compile(self, fmt: ResponseFormat) -> xgrammar.CompiledGrammar:
        # json_object: any object (not strict: every property allowed); json_schema: the schema as
        # OpenAI's strict mode reads it. Fixed separators (", " and ": ", as json.dumps writes them):
        # free whitespace is a known way for small models to loop inside a grammar, and carries no content.
        schema, strict = ('{"type": "object"}', False) if fmt.type == "json_object" else (fmt.schema, True)
        try:
            compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _LOCATION.sub("", str(exc).strip().splitlines()[0]) if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"response_format.json_schema.schema cannot be compiled to a grammar: {reason}") from None
        log.debug("compiled response_format %s (%d chars of schema)", fmt.type, len(fmt.schema or ""))
        return compiled

    def __len__(self) -> int:
        """How many compiled formats the cache holds."""
        return len(self._compiled)

    def start(self, fmt: ResponseFormat) -> "SequenceGrammar":
        """A fresh grammar state for one sequence generating under ``fmt``."""
        import xgrammar

        return SequenceGrammar(xgrammar.GrammarMatcher(self.compile(fmt)), self)


class SequenceGrammar:
    """One sequence's grammar state, positioned after some generated history."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self._compiler = compiler
        self._consumed: list[int] = []  # the generated tokens the matcher has accepted, in order

    def fill(self, generated: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Write into ``bitmask[row]`` the tokens allowed after ``generated``
        (the tokens this sequence generated before the row's token)."""
        # a history the grammar rejects, or EOS already accepted (ignore_eos): EOS is the only valid token
        if not self._move_to(generated) or self._matcher.is_terminated():
            _eos_only(bitmask[row], self._compiler.eos_ids)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _move_to(self, generated: Sequence[int]) -> bool:
        """Roll back to the longest common prefix with ``generated`` and accept
        the rest; False when the grammar rejects one of its tokens."""
        done = self._consumed
        keep = _common_prefix(done, generated)
        if keep < len(done):
            self._matcher.rollback(len(done) - keep)
            del done[keep:]
        for t in generated[keep:]:
            # past the accepted EOS nothing is in the grammar (asking would only make xgrammar warn)
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(t)):
                return False
            done.append(int(t))
        return True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by slice comparisons (C speed,
    log n of them) since histories share long prefixes and differ at the end."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo]; the first difference is at an index <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _eos_only(row: torch.Tensor, eos_ids: Sequence[int]) -> None:
    row.zero_()
    for t in eos_ids:
        row[t // _BITS] |= 1 << (t % _BITS)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed packed mask for ``rows`` rows (int32 words, on the CPU)."""
    import xgrammar

    return xgrammar.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``logits`` with the disallowed tokens of ``rows`` at -inf (a new tensor).

    ``bitmask[i]`` is the packed mask (on the CPU, as xgrammar fills it) of
    row ``rows[i]``; ``rows`` ascend. Unpacking is most of a mask's cost: on
    the CPU numpy does it a byte at a time (2-3x faster than shifting int32
    words in torch, measured); to an accelerator only the packed words cross."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        banned = banned_by_bytes(bitmask, vocab)
    else:
        banned = banned_by_shifts(bitmask.to(logits.device, non_blocking=True), vocab)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(banned, float("-inf"))
    idx = torch.as_tensor(list(rows), device=logits.device, dtype=torch.long)
    out = logits.clone()
    out[idx] = out[idx].masked_fill(banned, float("-inf"))
    return out


def banned_by_bytes(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The disallowed tokens ``[R, vocab]`` (bool) of a packed CPU mask, unpacked by numpy."""
    bits = numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=-1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits) == 0


def banned_by_shifts(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The same, unpacked by torch on the mask's own device."""
    shifts = torch.arange(_BITS, device=bitmask.device, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab] == 0
