"""The in-process engine: every worker's logic in one process, one round loop.

It runs the same worker classes the Ray runtime wraps in actors, so what is
proven exact here is what runs distributed. It owns the authoritative token
history (:class:`SequenceState`), validates requests before touching any
model, and batches all running samples through each step (ragged batches
through the paged runner).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Sequence

import torch

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine.frontend import Frontend, StreamChunk, open_models
from saguaro_ray.engine.round_loop import RoundLoop
from saguaro_ray.engine.scheduler import Scheduler
from saguaro_ray.engine.sequence import GenerationResult
from saguaro_ray.engine.transport import InProcessWorker
from saguaro_ray.errors import ConfigError
from saguaro_ray.models.resolve import resolve_models
from saguaro_ray.models.spec import check_spec
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.qualifier import QualifierLogic
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.target import TargetLogic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalEngineConfig:
    """Models and devices for the in-process engine; ``spec`` picks the mode."""

    # model specs (saguaro_ray.models.spec): a directory, zoo:, real:, hf:; self:<scheme> for a draft or qualifier
    target: str
    draft: str | None = None
    qualifier: str | None = None
    spec: SpeculationConfig = SpeculationConfig()
    device: str = "cpu"
    dtype: str | None = None
    attention_backend: str | None = None
    max_kv_tokens: int | None = None
    max_batch_size: int = 64
    max_queued: int | None = None  # samples waiting for admission; past it a request is refused (EngineOverloadedError)
    num_threads: int | None = None
    num_drafts: int = 1  # SSD: drafts that share the outcome set (each its own model copy and thread)
    # SSD with one draft: the draft starts the next build itself once its lookup is answered.
    # Off in process: the next build call is only a thread hop away here, and the draft's
    # Python would take the GIL from the round loop's just when that sends the verification
    # (measured: SSD/SD 1.10/1.08/0.92x -> 0.99/0.83/0.93x at b = 1, interleaved)
    build_ahead: bool = False

    def __post_init__(self) -> None:
        if self.spec.needs_draft and not self.draft:
            raise ConfigError(f"mode {self.spec.mode!r} needs a draft model (--draft)")
        if self.spec.mode == "pyramid" and not self.qualifier:
            raise ConfigError("mode 'pyramid' needs a qualifier model (--qualifier)")
        for role in ("target", "draft", "qualifier"):
            check_spec(role, getattr(self, role))
        if self.max_batch_size <= 0:
            raise ConfigError(f"max_batch_size must be positive, got {self.max_batch_size}")
        if not isinstance(self.num_drafts, int) or self.num_drafts < 1:
            raise ConfigError(f"num_drafts must be a positive integer, got {self.num_drafts!r}")
        if self.max_queued is not None and (not isinstance(self.max_queued, int) or self.max_queued < 1):
            raise ConfigError(f"max_queued must be a positive integer or None, got {self.max_queued!r}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError(f"num_threads must be positive, got {self.num_threads}")


class LocalEngine:
    """Runs any mode with every worker in this process (one thread each)."""

    def __init__(self, config: LocalEngineConfig) -> None:
        self.config = config
        spec = config.spec
        specs = {"target": config.target}
        if spec.needs_draft:
            specs["draft"] = config.draft
        if spec.mode == "pyramid":
            specs["qualifier"] = config.qualifier
        refs = resolve_models(specs)  # builds / converts named models on first use
        ckpts, self.tokenizer = open_models(refs)  # validates every directory and the vocabularies first
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // len(ckpts))
        torch.set_num_threads(threads)

        def runner(role: str) -> ModelRunner:
            return ModelRunner(
                ckpts[role],
                device=config.device,
                dtype=config.dtype,
                attention_backend=config.attention_backend,
                max_kv_tokens=config.max_kv_tokens,
                quantize=refs[role].quantize,
            )

        runners = {role: runner(role) for role in ckpts}
        if spec.needs_draft:
            for i in range(1, config.num_drafts):  # further drafts: their own copy of the draft model
                runners[f"draft{i}"] = runner("draft")
        logic = {"target": TargetLogic, "draft": DraftLogic, "qualifier": QualifierLogic}
        self.workers = {
            role: InProcessWorker(role, logic[role.rstrip("0123456789")](r), follow_up=config.build_ahead) for role, r in runners.items()
        }
        target = runners["target"]
        self.eos_ids = target.eos_token_ids or tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        self.vocab_size = target.vocab_size
        self.max_context = min(r.max_context for r in runners.values())
        self.loop = RoundLoop(
            spec,
            self.workers["target"],
            self.eos_ids,
            self.max_context,
            draft=[w for role, w in self.workers.items() if role.startswith("draft")],
            qualifier=self.workers.get("qualifier"),
        )
        self.scheduler = Scheduler(
            self.loop,
            config.max_batch_size,
            kv_tokens=min(r.kv.num_blocks * r.kv.block_size for r in runners.values()),
            block_size=max(r.kv.block_size for r in runners.values()),
            max_queued=config.max_queued,
        )
        self.frontend = Frontend(self.tokenizer, self.vocab_size, self.max_context, spec.mode, self.scheduler)

    @property
    def mode(self) -> str:
        return self.config.spec.mode

    @property
    def timeline(self) -> list:
        """Every round so far (most recent last), as :class:`RoundRecord` objects."""
        return list(self.loop.timeline)

    def close(self) -> None:
        self.scheduler.shutdown()
        for w in self.workers.values():
            w.close()

    # ------------------------------------------------------------ requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.frontend.encode(prompt)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        n: int = 1,
    ) -> list[GenerationResult]:
        """Generate ``n`` samples for every prompt; results in (prompt, sample) order."""
        return self.frontend.generate(prompts, params, n)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[str]:
        """Yield text chunks of one sample as rounds complete; closing the
        generator early aborts the sample."""
        with contextlib.closing(self.frontend.stream(prompt, params)) as chunks:
            for chunk in chunks:
                yield chunk.text

    async def agenerate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), n: int = 1, request_id: str | None = None) -> list[GenerationResult]:  # fmt: skip
        """:meth:`generate` for an event loop; a cancelled task aborts the request."""
        return await self.frontend.agenerate(prompts, params, n, request_id)

    def astream(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams(), request_id: str | None = None) -> AsyncIterator[StreamChunk]:
        """Chunks of one sample as rounds complete; a cancelled or closed consumer aborts it."""
        return self.frontend.astream(prompt, params, request_id)

    def abort(self, request_id: str) -> None:
        """Stop the request(s) named ``request_id`` at the next round boundary and free their KV."""
        self.frontend.abort(request_id)
