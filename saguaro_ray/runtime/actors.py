"""The Ray actors: thin shells around the worker logic and the round loop.

``WorkerActor`` owns one model on its device (target, draft or qualifier
logic from ``saguaro_ray.workers``) and serves the round protocol on a
ZeroMQ :class:`CommandServer`; Ray only creates it and reports its endpoint.
``CoordinatorActor`` owns the authoritative token history, the round loop and
the continuous-batching scheduler; it reaches the workers through
:class:`CommandClient` handles (the same ``submit`` contract as the
in-process transport), and clients reach it through Ray calls. No algorithm
math lives here.

The coordinator is an asyncio actor: a request or a stream is a coroutine
waiting on the scheduler's futures and token queue, never a thread, so
clients that stop reading cost nothing; one that goes away is aborted
(``abort``), and its sequences leave the batch at the next round boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any, AsyncIterator

import ray
import torch

from saguaro_ray.config import SamplingParams
from saguaro_ray.engine.cost_probe import cost_identity, seed_auto
from saguaro_ray.engine.frontend import Frontend, Progress, Resume, StreamChunk
from saguaro_ray.engine.calls import submit_each
from saguaro_ray.engine.resume import Emitted
from saguaro_ray.engine.round_loop import RoundLoop
from saguaro_ray.engine.scheduler import Scheduler
from saguaro_ray.engine.sequence import GenerationResult
from saguaro_ray.model_set import ModelSet, role_kind
from saguaro_ray.models.spec import ModelRef
from saguaro_ray.runtime.control import Broadcaster, CallForwarder, CommandServer, ControlError
from saguaro_ray.runtime.data_plane import DataPlaneStore
from saguaro_ray.runtime.data_plane.devices import indexed_device
from saguaro_ray.runtime.data_plane.status import PlaneStatus
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.runtime.process_memory import memory
from saguaro_ray.runtime.ray_transport import RECOVER_TIMEOUT_S, RayWorkerHandle
from saguaro_ray.runtime.restart_budget import RestartBudget
from saguaro_ray.runtime.routing import ActorLogic
from saguaro_ray.runtime.threads import own_threads, thread_kinds
from saguaro_ray.runtime.target_group import TargetGroupHandle, connect_worker, restart_worker, worker_info
from saguaro_ray.workers.checkpoint import Checkpoint
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.qualifier import QualifierLogic
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.tensor_parallel import TPContext
from saguaro_ray.workers.target import TargetLogic

log = logging.getLogger(__name__)

_LOGIC = {"target": TargetLogic, "draft": DraftLogic, "qualifier": QualifierLogic}
_MEMBERSHIP = ["join_data_plane", "leave_data_plane", "discard"]
_METHODS = {
    "target": ["verify", "prefill", "release", *_MEMBERSHIP],
    "draft": ["propose", "propose_for_qualifier", "build", "lookup", "prefill", "release", *_MEMBERSHIP],
    "qualifier": ["qualify", "prefill", "release", *_MEMBERSHIP],
}
JOIN_TIMEOUT_S = 60.0
STATS_TIMEOUT_S = 5.0  # how long metrics() waits for a worker's counters
HEALTH_PROBE_S = 5.0  # how long a health check waits for one worker's answer


def _liveness(client: RayWorkerHandle) -> str:
    """``"up"``, ``"restarting"`` (unavailable, not answering, or restarted
    within its budget) or ``"gone"`` (Ray reports an actor dead — the engine
    stopped it past its restart budget — or Ray restarted it once more than
    the budget allows, which the engine's next call to it will find and stop
    for good) — every rank of a sharded target counts."""
    actors = client.group.actors if isinstance(client, TargetGroupHandle) else [client.actor]
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=HEALTH_PROBE_S)
    except ray.exceptions.ActorDiedError:
        return "gone"
    except Exception:  # noqa: BLE001 — unavailable while Ray restarts it, or busy
        return "restarting"
    if [i["pid"] for i in infos] != client.pids:
        return "gone" if client.budget.exhausted() else "restarting"
    return "up"


def make_runner(
    model: str | Checkpoint, config: EngineConfig, tp: TPContext | None = None, quantize: str | None = None, role: str = "target"
) -> ModelRunner:
    """A worker's model runner on the configured device (``tp``: one rank's slice;
    ``quantize``: a self-draft's weight scheme; ``role``: whose options it takes)."""
    return ModelRunner(model, **config.role_runner_options(role), tp=tp, quantize=quantize)


def _exit_if_asked(role: str) -> None:
    """Fault injection for the tests: a worker whose role names a file in
    ``$SAGUARO_EXIT_ONCE_DIR`` removes it and dies on the spot — a real process
    death while the engine launches, once."""
    folder = os.environ.get("SAGUARO_EXIT_ONCE_DIR")
    if not folder:
        return
    try:
        os.unlink(os.path.join(folder, role))
    except FileNotFoundError:
        return
    log.warning("worker %s: exiting as asked by %s", role, folder)
    os._exit(1)


class WorkerActor:
    """One model on one device, serving the round protocol over ZeroMQ."""

    def __init__(self, role: str, model: ModelRef, config: EngineConfig, key: bytes, tcp_host: str | None) -> None:
        logging.basicConfig(level=logging.INFO)
        _exit_if_asked(role)
        config.start_worker_process()
        kind = role_kind(role)
        self.role = role
        self.logic = _LOGIC[kind](self._make_runner(model, config))
        node = ray.util.get_node_ip_address()
        # tensors to and from peers live on the device the model runs on (indexed: NCCL's set_device needs it)
        self.routed = ActorLogic(self.logic, key, str(indexed_device(self.logic.runner.device)), node, CallForwarder(key) if kind == "target" else None)
        host = node if tcp_host == "node" else tcp_host
        # the work a draft starts after answering (build_ahead None: on through Ray)
        after_reply = self.routed.after_reply if config.build_ahead is not False else None
        self.server = CommandServer(self.routed, _METHODS[kind], key, host=host, name=role, ready=self.routed.ready, after_reply=after_reply)

    def _make_runner(self, model: ModelRef, config: EngineConfig) -> Any:
        """The runner the logic drives (a tensor-parallel rank 0 wraps it)."""
        return make_runner(model.path, config, quantize=model.quantize, role=self.role)

    def endpoint(self) -> str:
        return self.server.endpoint

    def info(self) -> dict[str, Any]:
        return {
            "role": self.role,
            **memory(),  # pid, rss_bytes, heap_in_use_bytes / heap_free_bytes: the soak's samples
            "restarted": ray.get_runtime_context().was_current_actor_reconstructed,  # by Ray, before anyone asked
            "node": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "endpoint": self.server.endpoint,
            "threads": torch.get_num_threads(),
            "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,  # where its threads may run
            "python_threads": len(own_threads()),  # a leak of waiter threads shows here
            "thread_kinds": thread_kinds(),  # ... and which kind leaks
            "kv_tokens": self.logic.runner.kv.num_blocks * self.logic.runner.kv.block_size,
            "block_size": self.logic.runner.kv.block_size,
            "free_kv_blocks": self.logic.runner.kv.free_blocks,
            "held_sequences": sorted(self.logic.runner.kv.seqs),  # a leak names the sequences it holds
            "dropped_frames": self.server.dropped_frames,
            "drop_reasons": self.server.drop_reasons,
            "broadcast_calls": self.server.stats()["broadcast_calls"],
            "forwarded_calls": 0 if self.routed.forwarder is None else self.routed.forwarder.forwarded,
            "data_plane": None if self.routed.plane is None else self.routed.plane.stats(),
            # a draft: SSD builds it started itself, and how many of them a build call used
            "builds_ahead": {"started": getattr(self.logic, "ahead_started", 0), "used": getattr(self.logic, "ahead_builds", 0)},
        }

    def shutdown(self) -> None:
        self.server.close()
        if self.routed.forwarder is not None:  # its sockets were the server thread's
            self.routed.forwarder.close()
        self.routed.leave_data_plane()


class CoordinatorActor:
    """Token history, round loop and scheduler; the engine's front door."""

    def __init__(self, config: EngineConfig, workers: dict[str, Any], key: bytes) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = config
        models = ModelSet.from_specs(config.models)  # resolved by the launcher: only opened here
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:  # the workers hold the lost coordinator's sequences: start them afresh
            log.warning("coordinator restarted: restarting its workers (callers resume the requests it ran)")
            for role, actor in workers.items():
                restart_worker(role, actor, timeout_s=RECOVER_TIMEOUT_S)
        budget = lambda: RestartBudget(config.max_restarts, config.restart_window_s)  # noqa: E731
        self.clients = {
            role: connect_worker(role, actor, key, timeout_s=config.call_timeout_s, budget=budget(), charge_prior_restart=not restarted)
            for role, actor in workers.items()
        }
        # what the coordinator serves binds where the workers do: the node address, or IPC on one node
        tcp = any(c.client.endpoint.startswith("tcp://") for c in self.clients.values())
        host = ray.util.get_node_ip_address() if tcp else None
        self._store: DataPlaneStore | None = None
        self._generations = itertools.count(1)
        self._plane_lock = threading.Lock()
        self.plane = PlaneStatus()  # until a generation forms (or without a data plane): the control frames
        if config.data_plane:
            self._store = DataPlaneStore(key, host)
            self._join_data_plane()
        # the outcome broadcast: one XPUB message per round reaches every draft
        self._broadcaster = Broadcaster(key, host=host, name="outcomes")
        self._subscribed: set[str] = set()
        for role, c in self.clients.items():
            if role_kind(role) == "draft":
                self._subscribe(c)
        for c in self.clients.values():
            c.on_recovered = self._on_recovered
        self.loop = RoundLoop(
            config.spec,
            self.clients["target"],
            models.eos_ids,
            models.max_context,
            draft=[c for role, c in self.clients.items() if role_kind(role) == "draft"],
            qualifier=self.clients.get("qualifier"),
            timeline_bytes=config.timeline_bytes,
            broadcast=self._broadcast,
            forward=lambda workers, method: [w.forwarded(method) for w in workers],
        )
        infos = [worker_info(a) for a in workers.values()]
        seed_auto(self.loop, cost_identity(config, "ray"), config.max_batch_size, min(i["kv_tokens"] for i in infos))  # before any request
        self.scheduler = Scheduler(
            self.loop,
            config.max_batch_size,
            kv_tokens=min(i["kv_tokens"] for i in infos),
            block_size=max(i["block_size"] for i in infos),
            max_queued=config.max_queued,
        )
        self.frontend = Frontend.for_models(models, config.spec, self.scheduler)

    async def ready(self) -> bool:
        return True

    async def health(self) -> tuple[bool, str]:
        """Can this engine serve? ``(ok, why)`` from every worker's liveness.

        A worker Ray reports dead for good (its restarts exhausted) is gone; a
        gone target or qualifier fails every request, so the engine cannot
        serve. A gone draft only slows it down (rounds go on without it), and
        a worker that is restarting or slow to answer is given the benefit of
        the doubt — the round loop waits for it within its restart budget.
        """
        # the probes block on Ray calls: off this actor's event loop
        states = await asyncio.to_thread(lambda: {role: _liveness(c) for role, c in self.clients.items()})
        gone = [role for role, s in states.items() if s == "gone"]
        fatal = [role for role in gone if role_kind(role) != "draft"]
        why = ", ".join(f"{role}: {s}" for role, s in states.items())
        if fatal:
            return False, f"{', '.join(fatal)} gone for good (restarts exhausted); {why}"
        return True, why

    # ------------------------------------------------------------ broadcast
    def _subscribe(self, client: RayWorkerHandle) -> None:
        """Have a worker join the outcome broadcast; wait until it is subscribed
        (so nothing published afterwards can miss it)."""
        self._subscribed.discard(client.name)
        try:
            sid = client.submit("__subscribe__", self._broadcaster.invitation()).result(timeout=60).value
            self._broadcaster.wait_for([sid], timeout_s=60)
        except Exception as exc:  # noqa: BLE001 — it gets its calls one by one instead
            log.warning("%s could not join the outcome broadcast (%s); calling it directly", client.name, exc)
            return
        self._subscribed.add(client.name)

    def _broadcast(self, workers: list[RayWorkerHandle], method: str, args: tuple) -> list[Future]:
        """One XPUB message carries the call to every subscribed worker; each
        answers its own entry to this coordinator's client for it."""
        on_bus = [w for w in workers if w.name in self._subscribed]
        calls, futs = {}, {}
        for w in on_bus:
            identity, cid, futs[w.name] = w.expect(method)
            calls[w.name] = [identity, cid]
        if calls:
            try:
                self._broadcaster.publish({"method": method, "args": list(args), "calls": calls})
            except ControlError as exc:
                log.warning("outcome broadcast failed (%s); calling the drafts directly", exc)
                futs = {}
        return [futs[w.name] if w.name in futs else submit_each([w], method, args)[0] for w in workers]

    def _on_recovered(self, client: RayWorkerHandle) -> None:
        """A restarted worker: rebuild the data plane, and re-join the broadcast."""
        if self._store is not None:
            self._join_data_plane()
        if role_kind(client.name) == "draft":
            self._subscribe(client)

    # ----------------------------------------------------------- data plane
    @property
    def data_plane_generation(self) -> int:
        """The data plane's generation; 0: tensors ride the control frames."""
        return self.plane.generation

    def _join_data_plane(self) -> None:
        """(Re)build the data-plane group over every worker: after start-up and
        after any worker restarts (a dead member breaks a group for good). If
        a member cannot join, every worker leaves and tensors ride the control
        frames until the next rebuild — slower, never wrong. A plane that is
        not what the devices call for (control frames, or gloo on CUDA) is
        logged as a warning when its cause changes — a gloo fallback once, at
        start-up, not at every rebuild — and kept in :attr:`plane`
        (``metrics()``, Serve's ``/health``)."""
        with self._plane_lock:
            roles = list(self.clients)
            rank = {role: i for i, role in enumerate(roles)}
            drafts = [rank[r] for r in roles if role_kind(r) == "draft"]
            qualifier = rank.get("qualifier")
            gen = next(self._generations)
            futs: list[tuple[str, Future]] = []
            for role in roles:
                dst = None if role == "target" else 0  # proposals are verified by the target ...
                qdst = qualifier if role_kind(role) == "draft" else None  # ... or, PyramidSD's, qualified first
                peers = [d for d in drafts if d != rank[role]] if role_kind(role) == "draft" else []
                futs.append(
                    (role, self.clients[role].submit("join_data_plane", self._store.address, rank[role], len(roles), gen, dst, peers, qdst))
                )
            before = self.plane
            try:
                self.plane = PlaneStatus.formed(gen, [f.result(timeout=JOIN_TIMEOUT_S + 10).value for _, f in futs])
            except Exception as exc:  # noqa: BLE001 — any failure: fall back to frames
                self.plane = PlaneStatus.failed(gen, exc)
            news = self.plane.announcement(before)
            if news is not None:
                log.warning("%s", news)
            if self.plane.backend == "control":
                for c in self.clients.values():
                    try:
                        c.submit("leave_data_plane").result(timeout=30)
                    except Exception:  # noqa: BLE001 — a dead worker has nothing to leave
                        pass

    async def generate(
        self, prompts: list[Any], params: SamplingParams | list[SamplingParams], n: int = 1, request_id: str | None = None, resume: Resume = None
    ) -> list[GenerationResult]:
        return await self.frontend.agenerate(prompts, params, n, request_id, resume)

    async def generate_progress(
        self, prompts: list[Any], params: SamplingParams | list[SamplingParams], n: int = 1, request_id: str | None = None, resume: Resume = None
    ) -> AsyncIterator[Progress | list[GenerationResult]]:
        """:meth:`generate` as a stream: what the samples emitted as they go,
        then the results (what ``EngineHandle`` keeps to resume the request
        if this coordinator is lost)."""
        async for item in self.frontend.agenerate_progress(prompts, params, n, request_id, resume):
            yield item

    async def stream(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None, resume: Emitted | None = None
    ) -> AsyncIterator[StreamChunk]:
        # an async generator function: what Ray streams to the caller chunk by chunk
        async for chunk in self.frontend.astream(prompt, params, request_id, resume):
            yield chunk

    async def abort(self, request_id: str) -> None:
        """Abort the request(s) named ``request_id`` at the next round boundary."""
        self.frontend.abort(request_id)

    async def timeline(self, last: int | None = None) -> list[dict[str, Any]]:
        recs = list(self.loop.timeline)
        recs = recs if last is None else recs[-last:]
        return [r.to_json() for r in recs]

    def drop_counts(self) -> dict[str, dict[str, int]]:
        """Dropped control frames by reason, per role — what each worker's
        server (and its broadcast subscriber) dropped plus what this
        coordinator's client for it dropped — and under ``"coordinator"``
        what the outcome broadcaster and the data-plane store dropped. A
        worker that does not answer within a few seconds (restarting)
        contributes only this side's count."""
        asked: dict[str, tuple[Any, Future | None]] = {}
        for role, c in self.clients.items():
            client = c.client
            try:
                asked[role] = (client, client.submit_with("__stats__", (), timeout_s=STATS_TIMEOUT_S))
            except ControlError:  # closed (shut down)
                asked[role] = (client, None)
        out: dict[str, dict[str, int]] = {}
        for role, (client, fut) in asked.items():
            counts = Counter(client.drop_reasons)
            try:
                if fut is not None:
                    counts.update(fut.result().value["drop_reasons"])
            except Exception as exc:  # noqa: BLE001 — a worker that is down reports nothing
                log.debug("no drop counts from %s (%s)", role, exc)
            out[role] = dict(counts)
        own = Counter(self._broadcaster.drop_reasons)
        if self._store is not None:
            own.update(self._store.drop_reasons)
        out["coordinator"] = dict(own)
        return out

    async def metrics(self) -> dict[str, Any]:
        drops = await asyncio.to_thread(self.drop_counts)  # waits on the workers' answers
        return {
            "dropped_frames": {role: sum(reasons.values()) for role, reasons in drops.items()},
            "drop_reasons": drops,
            "restarts": {role: c.restarts for role, c in self.clients.items()},
            "draft_failures": self.loop.draft_failures,
            "draft_up": self.loop.draft_up,
            "drafts_up": len(self.loop.drafts.up()),
            "draft_catch_ups": self.loop.catch_ups,  # auto sequences whose drafts were sent the tokens they missed
            "rounds": self.loop.timeline.appended,  # since start (the timeline keeps the latest)
            "strategies": self.loop.assigner.metrics(),
            "queued": self.scheduler.queued,
            "active": self.scheduler.active,
            **self.plane.metrics(),  # data_plane_backend / _error / _generation
            "broadcast_subscribers": sorted(self._subscribed),
            # this process (the soak's samples): its memory, threads and the timeline's share
            "process": {**memory(), "python_threads": len(own_threads()), "thread_kinds": thread_kinds()},
            "timeline_bytes": self.loop.timeline.bytes,
        }

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self.scheduler.shutdown()
        for c in self.clients.values():
            c.close()
        if self._store is not None:
            self._store.close()
        self._broadcaster.close()
