"""The request side shared by every engine: prompts in, results and streams out.

Validation happens here, before any model work: empty prompts, token ids
outside the vocabulary (in the prompt, ``stop_token_ids`` or ``logit_bias``),
prompts that (with ``max_tokens``) do not fit the context window of *every*
model, a ``response_format`` the grammar library cannot compile for this
tokenizer (compiled once here, so a bad schema is a clear error naming it,
never a worker failure). Sample i of a prompt gets seed ``seed + i``.
The in-process engine and the Ray coordinator both put a :class:`Frontend`
in front of their :class:`Scheduler`, so they answer identically.

Every request gets a request id; a caller that goes away (a cancelled
``agenerate``/``astream`` task, a stream generator closed early) aborts it,
so the scheduler drops it at the next round boundary and frees its KV.

``resume`` (one :class:`~saguaro_ray.engine.resume.Emitted` per sample, in
(prompt, sample) order): the samples continue from what their caller already
has — how a caller carries a request across a lost coordinator
(:mod:`saguaro_ray.engine.resume`); :meth:`Frontend.agenerate_progress` tells
it, as it goes, what the samples of a non-streamed request have emitted.
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from saguaro_ray.algorithms.grammar import GrammarCompiler
from saguaro_ray.algorithms.logprobs import TokenLogprobs
from saguaro_ray.config import ResponseFormat, SamplingParams, SpeculationConfig
from saguaro_ray.engine.resume import Emitted, primed_decoder, replay
from saguaro_ray.engine.scheduler import Scheduler
from saguaro_ray.engine.sequence import GenerationResult, SequenceState
from saguaro_ray.engine.stops import StopChecker
from saguaro_ray.engine.strategy_menu import StrategyMenu
from saguaro_ray.errors import ConfigError, PromptTooLongError
from saguaro_ray.model_set import ModelSet
from saguaro_ray.tokenizer import IncrementalDecoder


Prompt = str | Sequence[int]  # text, or token ids
Prompts = Sequence[Prompt]
PromptParams = SamplingParams | Sequence[SamplingParams]  # one for every prompt, or one each
# what the scheduler thread hands a stream's consumer after a round: new tokens, the text a
# stop checker released (None: the consumer decodes), and the tokens' logprobs (None: not asked)
StreamItem = tuple[list[int], str | None, list[TokenLogprobs] | None]
Resume = Sequence["Emitted | None"] | None  # per sample, in (prompt, sample) order
# a non-streamed request's progress: (sample index, new tokens, their logprobs) per sample that
# emitted since the last report
Progress = list[tuple[int, list[int], list[TokenLogprobs] | None]]
PROGRESS_INTERVAL_S = 0.25  # how often a non-streamed request reports what it has emitted


@dataclass
class StreamChunk:
    """Newly emitted tokens of one sample and their text (may be empty while a
    multi-byte character is incomplete); ``finish_reason`` and ``stats`` on the
    last chunk. What every engine's ``stream``/``astream`` yields — in
    process, and through Ray (it pickles as it is)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # the sample's stats, on the last chunk
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the params asked


@dataclass
class _Stream:
    """One streamed sample on its way out. Its text comes from the stop
    checker when the request has stops (which holds back what may still turn
    into a stop string; read on the scheduler thread, right after the round
    that changed it), else from an incremental decoder on the consumer's side."""

    seq: SequenceState
    request_id: str
    decoder: IncrementalDecoder | None
    future: "Future[list[SequenceState]] | None" = None

    def item(self, tokens: list[int]) -> StreamItem:
        """What the scheduler's listener hands the consumer for new ``tokens``
        (the last ones of the sequence's output, their logprobs the last ones too)."""
        seq = self.seq
        stopper = seq.stopper
        logprobs = None if seq.logprobs is None else seq.logprobs[len(seq.logprobs) - len(tokens) :]
        return list(tokens), None if stopper is None else stopper.release(seq.finished), logprobs

    def chunk(self, item: StreamItem) -> StreamChunk:
        tokens, text, logprobs = item
        return StreamChunk(tokens, text if text is not None else self.decoder.push(tokens), logprobs=logprobs)

    def last(self) -> StreamChunk:
        """The closing chunk (re-raises the request's failure)."""
        self.future.result()
        seq = self.seq
        text = seq.stopper.release(True) if seq.stopper is not None else self.decoder.flush()
        return StreamChunk([], text, seq.finish_reason or "length", dict(seq.stats))


class Frontend:
    def __init__(
        self, tokenizer: Any, vocab_size: int, max_context: int, menu: StrategyMenu, scheduler: Scheduler | None, eos_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.menu = menu
        self.scheduler = scheduler
        self.eos_ids = tuple(eos_ids)
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._grammars: GrammarCompiler | None = None  # built on the first structured request (~0.1 s)
        self._grammar_lock = threading.Lock()

    @classmethod
    def for_models(cls, models: ModelSet, spec: SpeculationConfig, scheduler: Scheduler | None = None) -> "Frontend":
        """The front of an engine of ``spec`` running ``models`` (its vocabulary,
        context window and the strategies it offers)."""
        menu = StrategyMenu.of(spec, "draft" in models.refs, "qualifier" in models.refs)
        return cls(models.tokenizer, models.vocab_size, models.max_context, menu, scheduler, models.eos_ids)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("prompt is empty; give at least one token")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def make_sequences(self, prompts: Prompts, params: PromptParams, n: int = 1, resume: Resume = None) -> list[SequenceState]:
        """Validate every prompt and expand ``n`` samples each; sample i of a
        prompt uses seed ``seed + i``; ``resume``: what each sample emitted
        already. Raises before any model work."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(plist)} sampling parameter sets")
        for p in plist:
            p.check_samples(n)
        strategies = [self.menu.resolve(p.speculation) for p in plist]
        seqs = []
        for i, (prompt, p, strategy) in enumerate(zip(prompts, plist, strategies)):
            ids = self.encode(prompt)
            if len(ids) + p.max_tokens > self.max_context:
                raise PromptTooLongError(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={p.max_tokens} it needs "
                    f"{len(ids) + p.max_tokens} > the context window of {self.max_context}; "
                    "shorten the prompt or lower max_tokens"
                )
            if any(t >= self.vocab_size for t in p.stop_token_ids):
                raise ConfigError(f"stop_token_ids must be in [0, {self.vocab_size})")
            biased = max((t for t, _ in p.logit_bias), default=-1)
            if biased >= self.vocab_size:  # a bias the model has no logit for
                raise ConfigError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {biased}")
            if p.response_format is not None:
                self.check_response_format(p.response_format)
            base = p.seed if p.seed is not None else secrets.randbelow(2**31)
            for j in range(n):
                stopper = StopChecker(self.tokenizer, p.stop, p.stop_token_ids) if p.stop or p.stop_token_ids else None
                seqs.append(
                    SequenceState(self._new_id(), ids, p, base + j, prompt_index=i, sample_index=j, stopper=stopper, strategy=strategy)
                )
        if resume is not None:
            if len(resume) != len(seqs):
                raise ConfigError(f"resume: got {len(resume)} samples' emitted tokens for {len(seqs)} samples")
            for seq, emitted in zip(seqs, resume):
                if emitted is not None:
                    if any(not 0 <= t < self.vocab_size for t in emitted.token_ids):
                        raise ConfigError(f"resume: emitted token ids must be in [0, {self.vocab_size})")
                    replay(seq, emitted, self.eos_ids)
        return seqs

    def check_response_format(self, fmt: ResponseFormat) -> None:
        """Raise :class:`ConfigError` (naming ``response_format``) unless the
        grammar library compiles ``fmt`` for this tokenizer."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
            self._grammars.compile(fmt)

    def _new_id(self) -> int:
        with self._id_lock:
            self._next_id += 1
            return self._next_id

    # ------------------------------------------------------------ generation
    def generate(self, prompts: Prompts, params: PromptParams = SamplingParams(), n: int = 1) -> list[GenerationResult]:
        """Generate ``n`` samples for every prompt; results in (prompt, sample) order."""
        seqs, futures, t0 = self._submit(prompts, params, n, None)
        for f in futures:
            f.result()  # re-raises a failed request's error
        return self._results(seqs, t0)

    async def agenerate(
        self, prompts: Prompts, params: PromptParams = SamplingParams(), n: int = 1, request_id: str | None = None, resume: Resume = None
    ) -> list[GenerationResult]:
        """:meth:`generate` for an event loop; cancelling the awaiting task
        aborts the request (``request_id``, default a fresh one)."""
        request_id = request_id or uuid.uuid4().hex
        seqs, futures, t0 = self._submit(prompts, params, n, request_id, resume)
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:
            self.scheduler.abort(request_id)
            raise
        return self._results(seqs, t0)

    async def agenerate_progress(
        self, prompts: Prompts, params: PromptParams = SamplingParams(), n: int = 1, request_id: str | None = None, resume: Resume = None
    ) -> AsyncIterator[Progress | list[GenerationResult]]:
        """:meth:`agenerate` that reports, at most every
        :data:`PROGRESS_INTERVAL_S`, what its samples have emitted
        (:data:`Progress`), then yields the results — what a caller keeps to
        resume the request if the engine's coordinator is lost. A sample's
        tokens not yet reported when it is lost are drawn again: exact all the same."""
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        news: asyncio.Queue[tuple[int, list[int], list[TokenLogprobs] | None] | None] = asyncio.Queue()
        index: dict[int, int] = {}

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(news.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

        def listener(s: SequenceState, tokens: list[int]) -> None:
            logprobs = None if s.logprobs is None else s.logprobs[len(s.logprobs) - len(tokens) :]
            put((index[s.seq_id], list(tokens), logprobs))

        seqs = self.make_sequences(prompts, params, n, resume)
        index.update((s.seq_id, i) for i, s in enumerate(seqs))
        t0 = time.perf_counter()
        futures = self.scheduler.submit_many([[s for s in seqs if s.prompt_index == i] for i in range(len(prompts))], listener, request_id)
        done = asyncio.ensure_future(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        done.add_done_callback(lambda _: put(None))
        try:
            last = loop.time()  # when the caller was last told
            ended = False
            while not ended:
                if (item := await news.get()) is None:
                    break
                batch: Progress = [item]
                wait = PROGRESS_INTERVAL_S - (loop.time() - last)
                if wait > 0:  # more news until the interval is up, or the request has ended
                    await asyncio.wait([done], timeout=wait)
                while not news.empty():
                    if (item := news.get_nowait()) is None:
                        ended = True  # the results follow at once: they carry everything
                        break
                    batch.append(item)
                if not ended:
                    yield batch
                    last = loop.time()
            await done  # re-raises a failed request's error
        except (asyncio.CancelledError, GeneratorExit):
            self.scheduler.abort(request_id)
            done.cancel()
            raise
        yield self._results(seqs, t0)

    def stream(self, prompt: Prompt, params: SamplingParams = SamplingParams()) -> Iterator[StreamChunk]:
        """Yield one sample's new tokens and text as rounds complete; the last
        chunk carries the finish reason. Closing the generator early aborts it."""
        chunks: queue.Queue[StreamItem | None] = queue.Queue()
        stream = self._submit_stream(prompt, params, None, chunks.put)
        try:
            while (item := chunks.get()) is not None:
                yield stream.chunk(item)
            yield stream.last()
        finally:
            if not stream.future.done():
                self.scheduler.abort(stream.request_id)

    async def astream(
        self, prompt: Prompt, params: SamplingParams = SamplingParams(), request_id: str | None = None, resume: Emitted | None = None
    ) -> AsyncIterator[StreamChunk]:
        """:meth:`stream` for an event loop: no thread waits for the tokens, and
        a cancelled or closed consumer aborts the request."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[StreamItem | None] = asyncio.Queue()

        def put(item: StreamItem | None) -> None:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

        stream = self._submit_stream(prompt, params, request_id, put, resume)
        try:
            while (item := await chunks.get()) is not None:
                yield stream.chunk(item)
            yield stream.last()
        finally:
            if not stream.future.done():
                self.scheduler.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort the request(s) named ``request_id`` (see :meth:`Scheduler.abort`)."""
        self.scheduler.abort(request_id)

    def _submit(
        self, prompts: Prompts, params: PromptParams, n: int, request_id: str | None, resume: Resume = None
    ) -> tuple[list[SequenceState], "list[Future[list[SequenceState]]]", float]:
        seqs = self.make_sequences(prompts, params, n, resume)
        t0 = time.perf_counter()
        futures = self.scheduler.submit_many([[s for s in seqs if s.prompt_index == i] for i in range(len(prompts))], request_id=request_id)
        return seqs, futures, t0

    def _results(self, seqs: list[SequenceState], t0: float) -> list[GenerationResult]:
        elapsed = time.perf_counter() - t0
        for s in seqs:
            s.stats["seconds"] = round(elapsed, 6)
        return [self._result(s) for s in seqs]

    def _submit_stream(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None, put: Callable[[Any], None], resume: Emitted | None = None
    ) -> "_Stream":
        """Submit one streamed sample whose chunks ``put`` delivers (None ends them);
        ``resume``: what its caller was given already (the chunks continue after it)."""
        [seq] = self.make_sequences([prompt], params, 1, None if resume is None else [resume])
        stream = _Stream(seq, request_id or uuid.uuid4().hex, None if seq.stopper is not None else primed_decoder(self.tokenizer, resume))
        stream.future = self.scheduler.submit([seq], lambda s, toks: put(stream.item(toks)), stream.request_id)
        stream.future.add_done_callback(lambda _: put(None))
        return stream

    def _result(self, s: SequenceState) -> GenerationResult:
        return GenerationResult(
            prompt_index=s.prompt_index,
            sample_index=s.sample_index,
            mode=(s.strategy or self.menu.resolve(None)).mode,
            token_ids=list(s.output_ids),
            text=s.stopper.final_text() if s.stopper is not None else self.tokenizer.decode(s.output_ids, skip_special_tokens=True),
            finish_reason=s.finish_reason or "length",
            prompt_tokens=len(s.prompt_ids),
            stats=dict(s.stats),
            logprobs=None if s.logprobs is None else list(s.logprobs),
        )
