"""Launching and reaching a distributed engine on Ray.

``Engine.launch(EngineConfig(...))`` validates the configuration and the
models, joins a Ray cluster (or starts the embedded local instance), reserves
one placement group — a CPU bundle for the coordinator and one bundle per
worker (target, each draft, the qualifier) — starts the actors in it, and
returns an :class:`EngineHandle`. A sharded target (``target_tp`` > 1) gets a
placement group of its own, one bundle per rank (:mod:`saguaro_ray.runtime.tp_actors`). Workers bind their ZeroMQ sockets to the
node address Ray reports, or to IPC sockets when every bundle landed on one
node; the endpoints and the per-engine key (HMAC, and with ``encrypt`` a CURVE
keypair) travel through Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Iterator

import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from saguaro_ray.config import SamplingParams
from saguaro_ray.engine.frontend import Prompt, PromptParams, Prompts, StreamChunk
from saguaro_ray.engine.resume import Emitted
from saguaro_ray.engine.sequence import GenerationResult
from saguaro_ray.engine.transport import WorkerGone
from saguaro_ray.errors import ConfigError, SaguaroError
from saguaro_ray.model_set import ModelSet, role_kind
from saguaro_ray.runtime.actors import CoordinatorActor, WorkerActor
from saguaro_ray.runtime.control import EngineKey
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.runtime.placement import actor_options, reserve
from saguaro_ray.runtime.restart_budget import RAY_MAX_RESTARTS
from saguaro_ray.runtime.resumable import Resumption, SampleLog, coordinator_lost
from saguaro_ray.runtime.target_group import TargetGroup, kill_worker, stop, worker_info
from saguaro_ray.runtime.tp_actors import launch_target_group, reserve_target_group
from saguaro_ray.workers.tensor_parallel import check_tensor_parallel

log = logging.getLogger(__name__)

_PG_TIMEOUT_S = 120.0
# the coordinator is an asyncio actor: this bounds the requests and streams it
# serves at once (each a waiting coroutine, not a thread); the scheduler's
# batch and KV limits decide what decodes
COORDINATOR_CONCURRENCY = 1000


class EngineHandle:
    """A client's handle on a running engine (launched here or attached by name)."""

    def __init__(self, coordinator: Any, workers: dict[str, Any] | None = None, pg: Any = None, owned: bool = False) -> None:
        self.coordinator = coordinator
        self.workers = workers or {}
        self.pg = pg
        self._owned = owned

    # ------------------------------------------------------------- sync
    # Every request outlives a lost coordinator: the handle keeps what each
    # sample emitted and resubmits it once Ray has restarted the coordinator
    # (saguaro_ray.runtime.resumable).
    def generate(self, prompts: Prompts | str, params: PromptParams = SamplingParams(), n: int = 1) -> list[GenerationResult]:
        """Generate ``n`` samples per prompt (a lone string: one prompt); results in (prompt, sample) order."""
        prompts = _prompt_list(prompts)
        resumption, done = Resumption(self.coordinator, params), SampleLog()
        while True:
            request_id, gen = self._submit_progress(prompts, resumption, done, n)
            try:
                for ref in gen:
                    item = ray.get(ref)
                    if _is_results(item):
                        return item
                    done.add(item)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                self._resume_or_raise(exc, resumption.back, request_id)
            except BaseException:
                self.abort(request_id)
                raise

    def stream(self, prompt: Prompt, params: SamplingParams = SamplingParams()) -> Iterator[StreamChunk]:
        """Yield one sample's chunks (:class:`StreamChunk`) as rounds complete
        (the last carries the finish reason); closing the generator early aborts the request."""
        resumption, emitted = Resumption(self.coordinator, params), Emitted()
        request_id, finished = uuid.uuid4().hex, False
        try:
            while not finished:
                gen = self.coordinator.stream.remote(prompt, resumption.current_params(), request_id, emitted if emitted.token_ids else None)
                try:
                    for ref in gen:
                        chunk = ray.get(ref)
                        emitted.add(chunk.token_ids, chunk.text, chunk.logprobs)
                        finished = chunk.finish_reason is not None
                        yield chunk
                    return
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                    self._resume_or_raise(exc, resumption.back, request_id)
                    request_id = uuid.uuid4().hex
        finally:
            if not finished:
                self.abort(request_id)

    def _submit_progress(self, prompts: list[Prompt], resumption: Resumption, done: SampleLog, n: int) -> tuple[str, Any]:
        """(Re)submit a generate under a fresh request id, with what ``done``
        holds of its samples to resume from: the call :meth:`generate` and
        :meth:`agenerate` iterate, sync or async."""
        request_id = uuid.uuid4().hex
        resume = done.resume(len(prompts) * n)
        return request_id, self.coordinator.generate_progress.remote(prompts, resumption.current_params(), n, request_id, resume)

    def abort(self, request_id: str) -> None:
        """Abort the request(s) named ``request_id`` (fire and forget: the
        engine drops them at its next round boundary and frees their KV)."""
        self.coordinator.abort.remote(request_id)

    def _resume_or_raise(self, exc: BaseException, back: Any, request_id: str) -> None:
        """After ``exc`` ended a request's call: return once the request may be
        resubmitted (its coordinator was lost and is back), else raise the
        caller's error (its own, or the coordinator's loss it cannot outlive)."""
        if not coordinator_lost(exc):
            raise _user_error(exc) from None
        if not back():
            raise _not_resumed(exc) from None
        self.abort(request_id)  # in case the call lives on (an unreachable, not a dead, coordinator)

    async def _aresume_or_raise(self, exc: BaseException, resumption: Resumption, request_id: str) -> None:
        """:meth:`_resume_or_raise` without holding a thread."""
        if not coordinator_lost(exc):
            raise _user_error(exc) from None
        if not await resumption.aback():
            raise _not_resumed(exc) from None
        self.abort(request_id)

    # ------------------------------------------------------------ async
    async def agenerate(self, prompts: Prompts | str, params: PromptParams = SamplingParams(), n: int = 1) -> list[GenerationResult]:
        """:meth:`generate` for an event loop; cancelling the task aborts the request."""
        prompts = _prompt_list(prompts)
        resumption, done = Resumption(self.coordinator, params), SampleLog()
        while True:
            request_id, gen = self._submit_progress(prompts, resumption, done, n)
            try:
                async for ref in gen:
                    item = await ref
                    if _is_results(item):
                        return item
                    done.add(item)
            except ray.exceptions.TaskCancelledError:  # before RayTaskError: Ray's report of it is both
                self.abort(request_id)
                raise _cancelled() from None
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                await self._aresume_or_raise(exc, resumption, request_id)
            except BaseException:  # cancelled (the caller went away), or closed
                self.abort(request_id)
                raise

    async def astream(self, prompt: Prompt, params: SamplingParams = SamplingParams()) -> AsyncIterator[StreamChunk]:
        """:meth:`stream` for an event loop; a cancelled or closed consumer aborts the request."""
        resumption, emitted = Resumption(self.coordinator, params), Emitted()
        request_id, finished = uuid.uuid4().hex, False
        try:
            while not finished:
                gen = self.coordinator.stream.remote(prompt, resumption.current_params(), request_id, emitted if emitted.token_ids else None)
                try:
                    async for ref in gen:
                        chunk = await ref
                        emitted.add(chunk.token_ids, chunk.text, chunk.logprobs)
                        finished = chunk.finish_reason is not None
                        yield chunk
                    return
                except ray.exceptions.TaskCancelledError:
                    raise _cancelled() from None
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                    await self._aresume_or_raise(exc, resumption, request_id)
                    request_id = uuid.uuid4().hex
        finally:
            if not finished:
                self.abort(request_id)

    # ------------------------------------------------------------ admin
    def timeline(self, last: int | None = None) -> list[dict[str, Any]]:
        return _unwrap(lambda: ray.get(self.coordinator.timeline.remote(last)))

    def metrics(self) -> dict[str, Any]:
        return _unwrap(lambda: ray.get(self.coordinator.metrics.remote()))

    def health(self, timeout_s: float = 30.0) -> tuple[bool, str]:
        """``(ok, why)``: False when the engine cannot serve — a target or
        qualifier whose restarts are exhausted, or a coordinator that is dead
        or does not answer within ``timeout_s`` (see ``CoordinatorActor.health``);
        one Ray is restarting counts as serving (its requests resume)."""
        try:
            ok, why = ray.get(self.coordinator.health.remote(), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 — any failure to answer is the answer
            return _unanswered(exc)
        return bool(ok), str(why)

    async def ahealth(self, timeout_s: float = 30.0) -> tuple[bool, str]:
        """:meth:`health` without holding a thread while the coordinator answers."""
        try:
            ok, why = await asyncio.wait_for(self.coordinator.health.remote(), timeout_s)
        except Exception as exc:  # noqa: BLE001 — any failure to answer is the answer
            return _unanswered(exc)
        return bool(ok), str(why)

    def worker_info(self) -> dict[str, dict[str, Any]]:
        return {role: worker_info(a) for role, a in self.workers.items()}

    def shutdown(self) -> None:
        """Stop the coordinator and workers and free the placement group."""
        try:
            ray.get(self.coordinator.shutdown.remote(), timeout=30)
        except Exception:  # already gone
            log.debug("coordinator shutdown failed", exc_info=True)
        _close_workers(self.workers)
        stop([self.coordinator, *self.workers.values()], self.pg)
        self.pg = None


_CLOSE_TIMEOUT_S = 10.0


def _unanswered(exc: BaseException) -> tuple[bool, str]:
    """Health when the coordinator did not answer: a coordinator Ray is
    restarting is given the benefit of the doubt (its requests wait and
    resume, see saguaro_ray.runtime.resumable — replacing a Serve replica
    then would lose them); dead or silent, it cannot serve."""
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return True, "coordinator restarting (its requests resume once it is back)"
    return False, f"coordinator unreachable ({type(exc).__name__})"


def _is_results(item: Any) -> bool:
    """A generate_progress item that is the results (the others are progress reports, never empty)."""
    return not item or isinstance(item[0], GenerationResult)


def _prompt_list(prompts: Prompts | str) -> list[Prompt]:
    return [prompts] if isinstance(prompts, str) else list(prompts)


def _close_workers(workers: dict[str, Any]) -> None:
    """Let each worker close its sockets (and remove its IPC dir) before it is
    killed; one that does not answer in time is killed all the same."""
    refs = [(w.actors[0] if isinstance(w, TargetGroup) else w).shutdown.remote() for w in workers.values()]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_TIMEOUT_S)


def _cancelled() -> asyncio.CancelledError:
    """What a call Ray cancelled raises in the caller: Ray cancels the calls a
    task made along with it (Ray Serve cancels a request's task when its HTTP
    client goes away), so the engine call ends as its caller did — cancelled,
    not failed (it was answered as a 500 for a client that had left)."""
    return asyncio.CancelledError("the engine call was cancelled with the task that made it")


def _user_error(exc: ray.exceptions.RayError) -> BaseException:
    """Surface our own errors (bad prompt, bad params) as themselves, and the
    coordinator's loss as :class:`WorkerGone` (one line, not Ray's report)."""
    if isinstance(exc, ray.exceptions.RayActorError):
        if isinstance(exc, ray.exceptions.ActorUnavailableError):  # Ray is restarting it
            return WorkerGone("the engine's coordinator is unavailable (lost, and restarting); requests in flight resume once it is back")
        return WorkerGone("the engine's coordinator died; the requests it was running are lost (Ray restarts it while its max_restarts last)")
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, SaguaroError) else exc


def _not_resumed(exc: BaseException) -> WorkerGone:
    """A request its lost coordinator did not come back for in time (or at all)."""
    return WorkerGone(
        f"the engine's coordinator was lost ({type(exc).__name__}) and did not come back within the request's deadline "
        "(or its restarts are spent); the request is lost, resubmit it"
    )


def _start_error(exc: ray.exceptions.RayActorError) -> BaseException:
    """Why the coordinator did not start, as our own one-line error where it
    was ours (e.g. a worker that died during launch past its restart budget)."""
    for arg in exc.args:
        if isinstance(getattr(arg, "cause", None), SaguaroError):
            return arg.cause
    first = str(exc).strip().splitlines()
    return WorkerGone(f"the engine's coordinator did not start ({type(exc).__name__}: {first[0] if first else ''})")


def _unwrap(fn: Any) -> Any:
    try:
        return fn()
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
        raise _user_error(exc) from None


class Engine:
    @staticmethod
    def launch(config: EngineConfig) -> EngineHandle:
        """Validate, place and start an engine; returns its handle."""
        models = _open_models(config)
        ensure_ray(config)
        # a sharded target (target_tp > 1) is placed in its own group (runtime.tp_actors)
        roles = ["coordinator", *(r for r in config.roles if r != "target" or config.target_tp == 1)]
        bundles = [config.bundle(role) for role in roles]
        name = f"{config.name}-pg" if config.name else ""  # unnamed engines must not collide
        pg = reserve(bundles, config.placement_strategy, name, _PG_TIMEOUT_S, f"resources {bundles}", "lower worker_cpus/gpus or add nodes")
        try:  # a sharded target's ranks get a placement group of their own
            target_pg = reserve_target_group(config, _PG_TIMEOUT_S) if config.target_tp > 1 else None
        except ConfigError:
            remove_placement_group(pg)
            raise
        nodes = set(placement_group_table(pg)["bundles_to_node_id"].values())
        if target_pg is not None:
            nodes |= set(placement_group_table(target_pg)["bundles_to_node_id"].values())
        one_node = len(nodes) == 1
        tcp_host = None if one_node else "node"
        key = EngineKey.generate(config.encrypt)
        lifetime = "detached" if config.name else None
        workers: dict[str, Any] = {}
        try:
            if target_pg is not None:
                workers["target"] = launch_target_group(config, models.refs["target"], key, tcp_host, lifetime, target_pg)
            for i, role in enumerate(roles[1:], start=1):
                opts = actor_options(config, pg, i, role, lifetime)
                workers[role] = ray.remote(WorkerActor).options(**opts, max_restarts=RAY_MAX_RESTARTS).remote(
                    role, models.refs[role_kind(role)], config, key, tcp_host
                )
            copts = actor_options(config, pg, 0, "coordinator", lifetime)
            # Ray restarts a lost coordinator (a lifetime count: nothing outlives it to keep a window);
            # the restarted one restarts the workers and serves new requests
            coord_cls = ray.remote(CoordinatorActor).options(
                **copts,
                name=config.name,
                namespace=config.namespace if config.name else None,
                max_concurrency=COORDINATOR_CONCURRENCY,
                max_restarts=config.max_restarts,
            )
            refs = models.refs
            resolved = replace(config, target=refs["target"].path, draft=refs.get("draft"), qualifier=refs.get("qualifier"))
            coordinator = coord_cls.remote(resolved, workers, key)
            try:
                ray.get(coordinator.ready.remote())
            except ray.exceptions.RayActorError as exc:  # its __init__ failed: reaching a worker, mostly
                raise _start_error(exc) from None
        except Exception:
            for a in workers.values():
                kill_worker(a)
            remove_placement_group(pg)
            if target_pg is not None and "target" not in workers:
                remove_placement_group(target_pg)
            raise
        return EngineHandle(coordinator, workers, pg, owned=True)


def connect(name: str, address: str | None = "auto", namespace: str = "saguaro-ray") -> EngineHandle:
    """Attach to a detached engine launched elsewhere with ``EngineConfig(name=...)``."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    try:
        coordinator = ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ConfigError(f"no running engine named {name!r} in namespace {namespace!r}") from None
    return EngineHandle(coordinator)


def _open_models(config: EngineConfig) -> ModelSet:
    """Resolve model names (``zoo:`` built, ``real:`` converted on first use;
    ``self:`` drafts) and validate every model and vocabulary here, before any
    actor starts: workers only ever load a directory."""
    models = ModelSet.from_specs(config.models)
    check_tensor_parallel(models.checkpoints["target"].config, config.target_tp, source=models.refs["target"].path)
    return models


def ensure_ray(config: EngineConfig, logical_cpus: float | None = None) -> None:
    """Connect to Ray per ``config.address``; an embedded instance gets at least
    ``logical_cpus`` logical CPUs (default: what this one engine reserves)."""
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"namespace": config.namespace, "log_to_driver": False}
    if config.address in (None, "local"):
        if config.address is None:
            try:
                ray.init(address="auto", **kwargs)
                return
            except (ConnectionError, RuntimeError):
                pass
        # embedded instance: Ray starts workers at nice 15 by default, but here the
        # workers *are* the workload — any other process on the machine would preempt them
        os.environ.setdefault("RAY_worker_niceness", "0")
        # logical CPUs enough for every actor even on a small machine
        need = logical_cpus or config.coordinator_cpus + config.worker_cpus * config.num_worker_actors
        ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 1)), include_dashboard=False, **kwargs)
    else:
        ray.init(address=config.address, **kwargs)
