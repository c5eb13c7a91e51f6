"""The in-process engine: every worker's logic in one process, one round loop.

It runs the same worker classes the Ray runtime wraps in actors, so what is
proven exact here is what runs distributed. It owns the authoritative token
history (:class:`SequenceState`), validates requests before touching any
model, and batches all running samples through each step (ragged batches
through the paged runner).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine.rounds import RoundLoop
from saguaro_ray.engine.scheduler import Scheduler
from saguaro_ray.engine.sequence import GenerationResult, SequenceState
from saguaro_ray.engine.transport import InProcessWorker
from saguaro_ray.errors import ConfigError, IncompatibleModelsError, PromptTooLongError
from saguaro_ray.tokenizer import IncrementalDecoder, check_same_vocabulary, load_tokenizer
from saguaro_ray.workers.checkpoint import open_checkpoint
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.qualifier import QualifierLogic
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.target import TargetLogic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalEngineConfig:
    """Models and devices for the in-process engine; ``spec`` picks the mode."""

    target: str
    draft: str | None = None
    qualifier: str | None = None
    spec: SpeculationConfig = SpeculationConfig()
    device: str = "cpu"
    dtype: str | None = None
    attention_backend: str | None = None
    max_kv_tokens: int | None = None
    max_batch_size: int = 64
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.spec.needs_draft and not self.draft:
            raise ConfigError(f"mode {self.spec.mode!r} needs a draft model (--draft)")
        if self.spec.mode == "pyramid" and not self.qualifier:
            raise ConfigError("mode 'pyramid' needs a qualifier model (--qualifier)")
        if self.max_batch_size <= 0:
            raise ConfigError(f"max_batch_size must be positive, got {self.max_batch_size}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError(f"num_threads must be positive, got {self.num_threads}")


class LocalEngine:
    """Runs any mode with every worker in this process (one thread each)."""

    def __init__(self, config: LocalEngineConfig) -> None:
        self.config = config
        spec = config.spec
        roles = {"target": config.target}
        if spec.needs_draft:
            roles["draft"] = config.draft
        if spec.mode == "pyramid":
            roles["qualifier"] = config.qualifier
        ckpts = {role: open_checkpoint(path) for role, path in roles.items()}  # validates every directory first
        self.tokenizer = load_tokenizer(ckpts["target"].path)
        for role in ("draft", "qualifier"):
            if role in ckpts:
                _check_compatible(ckpts["target"], self.tokenizer, ckpts[role], role)
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // len(ckpts))
        torch.set_num_threads(threads)
        runners = {
            role: ModelRunner(
                ck,
                device=config.device,
                dtype=config.dtype,
                attention_backend=config.attention_backend,
                max_kv_tokens=config.max_kv_tokens,
            )
            for role, ck in ckpts.items()
        }
        logic = {"target": TargetLogic, "draft": DraftLogic, "qualifier": QualifierLogic}
        self.workers = {role: InProcessWorker(role, logic[role](r)) for role, r in runners.items()}
        target = runners["target"]
        self.eos_ids = target.eos_token_ids or tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        self.vocab_size = target.vocab_size
        self.max_context = min(r.max_context for r in runners.values())
        self.loop = RoundLoop(
            spec,
            self.workers["target"],
            self.eos_ids,
            self.max_context,
            draft=self.workers.get("draft"),
            qualifier=self.workers.get("qualifier"),
        )
        self.scheduler = Scheduler(self.loop, config.max_batch_size)
        self._next_id = 0
        self._id_lock = threading.Lock()

    @property
    def mode(self) -> str:
        return self.config.spec.mode

    @property
    def timeline(self) -> list:
        return self.loop.timeline

    def close(self) -> None:
        self.scheduler.shutdown()
        for w in self.workers.values():
            w.close()

    # ------------------------------------------------------------- requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
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

    def make_sequences(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        n: int = 1,
    ) -> list[SequenceState]:
        """Validate every prompt and expand ``n`` samples each; sample i of a
        prompt uses seed ``seed + i``. Raises before any model work."""
        if n <= 0:
            raise ConfigError(f"n must be a positive integer, got {n}")
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(plist)} sampling parameter sets")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            ids = self.encode(prompt)
            if len(ids) + p.max_tokens > self.max_context:
                raise PromptTooLongError(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={p.max_tokens} it needs "
                    f"{len(ids) + p.max_tokens} > the context window of {self.max_context}; "
                    "shorten the prompt or lower max_tokens"
                )
            base = p.seed if p.seed is not None else secrets.randbelow(2**31)
            for j in range(n):
                seqs.append(SequenceState(self._new_id(), ids, p, base + j, prompt_index=i, sample_index=j))
        return seqs

    def _new_id(self) -> int:
        with self._id_lock:
            self._next_id += 1
            return self._next_id

    # ------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        n: int = 1,
    ) -> list[GenerationResult]:
        """Generate ``n`` samples for every prompt; results in (prompt, sample) order."""
        seqs = self.make_sequences(prompts, params, n)
        t0 = time.perf_counter()
        futures = [self.scheduler.submit([s for s in seqs if s.prompt_index == i]) for i in range(len(prompts))]
        for f in futures:
            f.result()
        elapsed = time.perf_counter() - t0
        for s in seqs:
            s.stats["seconds"] = round(elapsed, 6)
        return [self._result(s) for s in seqs]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[str]:
        """Yield text chunks of one sample as rounds complete."""
        [seq] = self.make_sequences([prompt], params, 1)
        chunks: queue.Queue[list[int] | None] = queue.Queue()
        fut = self.scheduler.submit([seq], lambda s, toks: chunks.put(list(toks)))
        fut.add_done_callback(lambda _: chunks.put(None))
        decoder = IncrementalDecoder(self.tokenizer)
        while (toks := chunks.get()) is not None:
            text = decoder.push(toks)
            if text:
                yield text
        fut.result()  # re-raise a failure
        tail = decoder.flush()
        if tail:
            yield tail

    def _result(self, s: SequenceState) -> GenerationResult:
        return GenerationResult(
            prompt_index=s.prompt_index,
            sample_index=s.sample_index,
            mode=self.mode,
            token_ids=list(s.output_ids),
            text=self.tokenizer.decode(s.output_ids, skip_special_tokens=True),
            finish_reason=s.finish_reason or "length",
            prompt_tokens=len(s.prompt_ids),
            stats=dict(s.stats),
        )




def _check_compatible(target_ckpt, target_tok, other_ckpt, role: str) -> None:
    """Refuse a draft/qualifier that does not share the target's vocabulary."""
    if other_ckpt.config.vocab_size != target_ckpt.config.vocab_size:
        raise IncompatibleModelsError(
            f"{role} {other_ckpt.path} has vocab_size {other_ckpt.config.vocab_size}, the target "
            f"{target_ckpt.path} has {target_ckpt.config.vocab_size}; speculation needs one shared vocabulary"
        )
    check_same_vocabulary(target_tok, load_tokenizer(other_ckpt.path), role)
