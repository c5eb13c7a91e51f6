"""``EngineConfig``: one engine's models, devices and limits, validated once.

Both engines take it: :class:`~saguaro_ray.engine.local.LocalEngine` (every
worker a thread of this process) and ``Engine.launch`` (Ray actors). The
fields under "Ray runtime" only mean something to the latter; the in-process
engine leaves them unused, except ``target_tp`` > 1, which it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from saguaro_ray.config import SpeculationConfig
from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels.subset_head import check_draft_vocab
from saguaro_ray.model_set import ModelSpec, allowed_modes, needed_specs, role_kind, worker_roles
from saguaro_ray.models.spec import ModelRef, check_spec

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class EngineConfig:
    """An engine: models, devices, limits, and (Ray) placement.

    ``threads_per_worker``: torch threads of each worker (``None``: 1 for a
    Ray actor; in process, this machine's CPUs split between the workers).
    On CPU every Ray worker asks for ``worker_cpus`` logical CPUs (fractions
    are fine — a 2-core machine cannot give a coordinator, a target and two
    drafts a whole CPU each). On CUDA (``device="cuda"``) each worker asks for ``gpus_per_worker``.
    ``target_tp`` > 1 shards the target over that many rank actors (one
    device, or one CPU bundle, each) in a placement group of their own with
    ``target_placement_strategy`` (``STRICT_PACK``: the ranks share a node, as
    their all-reduces want; ``PACK``/``SPREAD`` allow crossing nodes).
    ``address``: ``None`` joins a running cluster when there is one and starts
    the embedded local instance otherwise; ``"auto"`` insists on a running
    cluster; ``"local"`` always starts the embedded instance; anything else is
    a cluster address. ``name`` registers a detached engine that other
    processes reach with :func:`saguaro_ray.connect`.
    """

    # model specs (saguaro_ray.models.spec): a directory, zoo:, real:, hf:; self:<scheme>
    # for a draft or qualifier. Launch resolves them (the coordinator gets ModelRefs).
    target: str
    draft: str | ModelRef | None = None
    qualifier: str | ModelRef | None = None
    spec: SpeculationConfig = field(default_factory=SpeculationConfig)
    num_drafts: int = 1  # SSD: drafts that share the outcome set (each its own model copy: an actor, or a thread)
    # every draft's LM head covers only this many token ids (the tokenizer's special ids and the
    # lowest others; q = 0 elsewhere, still exact): saguaro_ray.kernels.subset_head. None: all
    draft_vocab: int | None = None
    device: str = "cpu"
    dtype: str | None = None
    attention_backend: str | None = None
    cuda_graphs: bool = True  # on CUDA: decode and verify replay CUDA graphs (saguaro_ray.workers.graphs)
    max_kv_tokens: int | None = None
    max_batch_size: int = 64
    max_queued: int | None = None  # samples waiting for admission; past it a request is refused (EngineOverloadedError)
    threads_per_worker: int | None = None
    # SSD with one draft: the draft starts the next round's build itself once its lookup
    # is answered, one control-plane hop before the build call would reach it. None: on
    # through Ray; off in process, where the next build call is only a thread hop away and
    # the draft's Python would take the GIL from the round loop's just when that sends the
    # verification (measured: SSD/SD 1.10/1.08/0.92x -> 0.99/0.83/0.93x at b = 1, interleaved)
    build_ahead: bool | None = None
    # each CPU worker actor claims cores of its own on its node and binds its threads
    # to them (saguaro_ray.runtime.cores: on 2 cores, verification beside a build took
    # 607-868 ms unpinned, 279 ms pinned, 262-273 ms alone); one that finds none free
    # runs unpinned. Ray actors only: in process the workers are threads of one process
    pin_cores: bool = True
    # ---- Ray runtime
    target_tp: int = 1
    target_placement_strategy: str = "STRICT_PACK"
    worker_cpus: float = 0.5
    coordinator_cpus: float = 0.25
    gpus_per_worker: float = 1.0
    placement_strategy: str = "PACK"
    address: str | None = None
    name: str | None = None
    namespace: str = "saguaro-ray"
    # each worker may be restarted max_restarts times within any restart_window_s
    # seconds (math.inf: in its lifetime); one more and it is stopped for good
    max_restarts: int = 2
    restart_window_s: float = 600.0
    # q rows and KV deltas go worker-to-worker over a torch.distributed group
    # (gloo on CPU, NCCL on CUDA); False: they ride the ZeroMQ frames
    data_plane: bool = True
    call_timeout_s: float = 120.0
    # the coordinator's round history (engine.timeline(), the benchmarks' source), estimated
    # bytes; None: saguaro_ray.engine.timeline.TIMELINE_BYTES (16 MiB)
    timeline_bytes: int | None = None
    # ZeroMQ CURVE on every TCP control-plane socket (multi-node): frames cannot be read
    # or altered on the network; on one node the sockets are IPC in private dirs either way
    encrypt: bool = False
    # custom Ray resources per role, e.g. {"target": {"node_a": 1}}: pins roles to nodes
    resources: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.models  # noqa: B018 — refuses a model the mode needs and was not given
        for role in ("target", "draft", "qualifier"):
            check_spec(role, getattr(self, role))
        check_draft_vocab(self.draft_vocab)
        if self.draft_vocab is not None and self.draft is None:
            raise ConfigError("draft_vocab sets the draft's LM head; this engine has no draft")
        if not isinstance(self.num_drafts, int) or self.num_drafts < 1:
            raise ConfigError(f"num_drafts must be a positive integer, got {self.num_drafts!r}")
        if self.num_drafts > 1 and not {"ssd", "auto"} & set(self.allowed_modes):
            # only SSD divides work between drafts (the outcome set); elsewhere
            # the extra actors would sit idle on a device of their own
            raise ConfigError(f"num_drafts > 1 needs mode 'ssd' allowed (this engine allows {list(self.allowed_modes)})")
        if not isinstance(self.target_tp, int) or isinstance(self.target_tp, bool) or self.target_tp < 1:
            raise ConfigError(f"target_tp must be a positive integer, got {self.target_tp!r}")
        if self.target_placement_strategy not in STRATEGIES:
            raise ConfigError(
                f"target_placement_strategy must be one of {', '.join(STRATEGIES)}, got {self.target_placement_strategy!r}"
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.placement_strategy not in STRATEGIES:
            raise ConfigError(f"placement_strategy must be one of {', '.join(STRATEGIES)}, got {self.placement_strategy!r}")
        for name in ("worker_cpus", "coordinator_cpus", "gpus_per_worker", "call_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be a positive integer, got {self.max_batch_size!r}")
        if self.threads_per_worker is not None and (not isinstance(self.threads_per_worker, int) or self.threads_per_worker < 1):
            raise ConfigError(f"threads_per_worker must be a positive integer or None, got {self.threads_per_worker!r}")
        if self.build_ahead not in (None, True, False):
            raise ConfigError(f"build_ahead must be True, False or None, got {self.build_ahead!r}")
        if not isinstance(self.pin_cores, bool):
            raise ConfigError(f"pin_cores must be True or False, got {self.pin_cores!r}")
        if not isinstance(self.encrypt, bool):
            raise ConfigError(f"encrypt must be True or False, got {self.encrypt!r}")
        if self.max_queued is not None and (not isinstance(self.max_queued, int) or self.max_queued < 1):
            raise ConfigError(f"max_queued must be a positive integer or None, got {self.max_queued!r}")
        if self.timeline_bytes is not None and (not isinstance(self.timeline_bytes, int) or isinstance(self.timeline_bytes, bool) or self.timeline_bytes < 1):
            raise ConfigError(f"timeline_bytes must be a positive integer or None, got {self.timeline_bytes!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be a non-negative integer, got {self.max_restarts!r}")
        if isinstance(self.restart_window_s, bool) or not isinstance(self.restart_window_s, (int, float)) or not self.restart_window_s > 0:
            raise ConfigError(f"restart_window_s must be a positive number of seconds (math.inf: lifetime), got {self.restart_window_s!r}")
        unknown = set(self.resources) - {"target", "draft", "qualifier", "coordinator"}
        if unknown:
            raise ConfigError(f"resources has unknown roles {sorted(unknown)}; use target, draft, qualifier, coordinator")

    @property
    def models(self) -> dict[str, ModelSpec]:
        """Role → spec of the models this engine runs (see :func:`~saguaro_ray.model_set.needed_specs`)."""
        return needed_specs([self.spec], self.target, self.draft, self.qualifier)

    @property
    def allowed_modes(self) -> tuple[str, ...]:
        """The strategies this engine's requests may name (see :func:`~saguaro_ray.model_set.allowed_modes`)."""
        return allowed_modes(self.spec, self.draft is not None, self.qualifier is not None)

    @property
    def roles(self) -> list[str]:
        """Worker roles in launch order: target, draft0..draftD-1, qualifier."""
        return worker_roles(self.spec, self.num_drafts, self.draft is not None, self.qualifier is not None)

    @property
    def num_worker_actors(self) -> int:
        """Worker actors this engine starts: one per role, T for a sharded target."""
        return len(self.roles) + self.target_tp - 1

    @property
    def runner_options(self) -> dict[str, Any]:
        """What of this config every worker's :class:`ModelRunner` takes."""
        return {"device": self.device, "dtype": self.dtype, "attention_backend": self.attention_backend, "cuda_graphs": self.cuda_graphs, "max_kv_tokens": self.max_kv_tokens}

    def role_runner_options(self, role: str) -> dict[str, Any]:
        """:attr:`runner_options` for a worker of ``role``: a draft's also
        carry its reduced-vocabulary head (``draft_vocab``)."""
        if role_kind(role) == "draft" and self.draft_vocab is not None:
            return {**self.runner_options, "head_vocab": self.draft_vocab}
        return self.runner_options

    @property
    def worker_threads(self) -> int:
        """Torch threads of a Ray worker actor."""
        return self.threads_per_worker or 1

    def start_worker_process(self) -> None:
        """What a worker actor's process sets first: its torch threads and, on
        the CPU with ``pin_cores``, cores of its own (before any model thread starts)."""
        import torch

        from saguaro_ray.runtime.cores import claim_cores

        torch.set_num_threads(self.worker_threads)
        if self.pin_cores and self.device == "cpu":
            claim_cores(self.worker_threads)

    def bundle(self, role: str) -> dict[str, float]:
        """The resources one actor of ``role`` (``coordinator``, or a worker
        role; each rank of a sharded target alike) reserves."""
        kind = role_kind(role)
        if kind == "coordinator":
            b: dict[str, float] = {"CPU": self.coordinator_cpus}
        else:
            b = {"CPU": self.worker_cpus}
            if self.device == "cuda":
                b["GPU"] = self.gpus_per_worker
        b.update(self.resources.get(kind, {}))
        return b
