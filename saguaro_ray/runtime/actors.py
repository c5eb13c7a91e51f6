"""The Ray actors: thin shells around the worker logic and the round loop.

``WorkerActor`` owns one model on its device (target, draft or qualifier
logic from ``saguaro_ray.workers``) and serves the round protocol on a
ZeroMQ :class:`CommandServer`; Ray only creates it and reports its endpoint.
``CoordinatorActor`` owns the authoritative token history, the round loop and
the continuous-batching scheduler; it reaches the workers through
:class:`CommandClient` handles (the same ``submit`` contract as the
in-process transport), and clients reach it through Ray calls. No algorithm
math lives here.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import ray
import torch

from saguaro_ray.config import SamplingParams
from saguaro_ray.engine.frontend import Frontend, open_models
from saguaro_ray.engine.rounds import RoundLoop
from saguaro_ray.engine.scheduler import Scheduler
from saguaro_ray.engine.sequence import GenerationResult
from saguaro_ray.runtime.control import CommandServer
from saguaro_ray.runtime.engine_config import EngineConfig, role_kind
from saguaro_ray.runtime.target_group import connect_worker, worker_info
from saguaro_ray.workers.checkpoint import Checkpoint
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.qualifier import QualifierLogic
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.tensor_parallel import TPContext
from saguaro_ray.workers.target import TargetLogic

log = logging.getLogger(__name__)

_LOGIC = {"target": TargetLogic, "draft": DraftLogic, "qualifier": QualifierLogic}
_METHODS = {
    "target": ["verify", "prefill", "release"],
    "draft": ["propose", "build", "lookup", "prefill", "release"],
    "qualifier": ["qualify", "prefill", "release"],
}


def make_runner(model: str | Checkpoint, config: EngineConfig, tp: TPContext | None = None) -> ModelRunner:
    """A worker's model runner on the configured device (``tp``: one rank's slice)."""
    return ModelRunner(
        model,
        device="cuda" if config.device == "cuda" else "cpu",
        dtype=config.dtype,
        attention_backend=config.attention_backend,
        max_kv_tokens=config.max_kv_tokens,
        tp=tp,
    )


class WorkerActor:
    """One model on one device, serving the round protocol over ZeroMQ."""

    def __init__(self, role: str, model: str, config: EngineConfig, key: bytes, tcp_host: str | None) -> None:
        logging.basicConfig(level=logging.INFO)
        torch.set_num_threads(config.threads_per_worker)
        kind = role_kind(role)
        self.role = role
        self.logic = _LOGIC[kind](self._make_runner(model, config))
        host = ray.util.get_node_ip_address() if tcp_host == "node" else tcp_host
        self.server = CommandServer(self.logic, _METHODS[kind], key, host=host, name=role)

    def _make_runner(self, model: str, config: EngineConfig) -> Any:
        """The runner the logic drives (a tensor-parallel rank 0 wraps it)."""
        return make_runner(model, config)

    def endpoint(self) -> str:
        return self.server.endpoint

    def info(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "endpoint": self.server.endpoint,
            "threads": torch.get_num_threads(),
            "kv_tokens": self.logic.runner.kv.num_blocks * self.logic.runner.kv.block_size,
            "block_size": self.logic.runner.kv.block_size,
            "dropped_frames": self.server.dropped_frames,
        }

    def shutdown(self) -> None:
        self.server.close()


class CoordinatorActor:
    """Token history, round loop and scheduler; the engine's front door."""

    def __init__(self, config: EngineConfig, workers: dict[str, Any], key: bytes) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = config
        roles = {"target": config.target}
        if config.spec.needs_draft:
            roles["draft"] = config.draft  # type: ignore[assignment]
        if config.spec.mode == "pyramid":
            roles["qualifier"] = config.qualifier  # type: ignore[assignment]
        ckpts, tokenizer = open_models(roles)
        self.clients = {role: connect_worker(role, actor, key, timeout_s=config.call_timeout_s) for role, actor in workers.items()}
        target_cfg = ckpts["target"].config
        eos = target_cfg.eos_token_ids or tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        max_context = min(ck.config.max_position_embeddings for ck in ckpts.values())
        self.loop = RoundLoop(
            config.spec,
            self.clients["target"],
            eos,
            max_context,
            draft=self.clients.get("draft0"),
            qualifier=self.clients.get("qualifier"),
        )
        infos = [worker_info(a) for a in workers.values()]
        self.scheduler = Scheduler(
            self.loop,
            config.max_batch_size,
            kv_tokens=min(i["kv_tokens"] for i in infos),
            block_size=max(i["block_size"] for i in infos),
        )
        self.frontend = Frontend(tokenizer, target_cfg.vocab_size, max_context, config.spec.mode, self.scheduler)

    def ready(self) -> bool:
        return True

    def generate(self, prompts: list[Any], params: SamplingParams | list[SamplingParams], n: int = 1) -> list[GenerationResult]:
        return self.frontend.generate(prompts, params, n)

    def stream(self, prompt: Any, params: SamplingParams) -> Iterator[dict[str, Any]]:
        for chunk in self.frontend.stream(prompt, params):
            yield {"token_ids": chunk.token_ids, "text": chunk.text, "finish_reason": chunk.finish_reason, "stats": chunk.stats}

    def timeline(self, last: int | None = None) -> list[dict[str, Any]]:
        recs = list(self.loop.timeline)
        recs = recs if last is None else recs[-last:]
        return [r.to_json() for r in recs]

    def metrics(self) -> dict[str, Any]:
        return {
            "dropped_frames": {role: c.client.dropped_frames for role, c in self.clients.items()},
            "restarts": {role: c.restarts for role, c in self.clients.items()},
            "draft_failures": self.loop.draft_failures,
            "draft_up": self.loop.draft_up,
            "rounds": len(self.loop.timeline),
            "queued": self.scheduler.queued,
        }

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        for c in self.clients.values():
            c.close()
