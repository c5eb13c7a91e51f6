"""Driving a tensor-parallel group of runners from rank 0.

Every rank holds a :class:`~saguaro_ray.workers.runner.ModelRunner` over its
slice, with the same bookkeeping (sequences, block tables, lengths): the
ranks stay identical as long as they see the same state-changing calls in
the same order. Rank 0 — the only rank the coordinator talks to — wraps its
runner in :class:`TPRunnerProxy`, which broadcasts each such call (method
name and arguments) to the followers before running it locally; the
followers run :func:`follow`, which replays those calls in lockstep, so the
collectives inside them line up. Reads (``has_sequence``, ``seq_len``, ...)
are local. Worker logic (``TargetLogic``) sees an ordinary runner and knows
nothing about tensor parallelism.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from saguaro_ray.errors import SaguaroError
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.tensor_parallel import TPContext

log = logging.getLogger(__name__)

# runner methods that change state or run the model: every rank must run them
FORWARDED = ("add_sequence", "free_sequence", "truncate", "forward", "tree_start", "tree_forward", "tree_commit")
# errors a runner raises from validation before any collective: every rank
# raises the same one for the same call, so a follower just carries on
_SYMMETRIC_ERRORS = (SaguaroError, ValueError, KeyError)


def _to_cpu(obj: Any) -> Any:
    """Tensors travel pickled over the CPU control group."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(x) for x in obj)
    return obj


class TPRunnerProxy:
    """Rank 0's runner: forwards every state-changing call to the followers."""

    def __init__(self, runner: ModelRunner, tp: TPContext) -> None:
        if tp.rank != 0:
            raise ValueError("only rank 0 drives a tensor-parallel group")
        self.runner = runner
        self.tp = tp

    def append_kv(self, seq_id: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A KV delta from another process holds every KV head, not this
        rank's slice; sharding it is not implemented (targets never need it)."""
        raise NotImplementedError("append_kv is not supported on a tensor-parallel runner")

    def stop(self) -> None:
        """Release the followers from :func:`follow`."""
        self.tp.broadcast(None)

    def __getattr__(self, name: str) -> Any:  # reads: has_sequence, seq_len, kv, config, ...
        return getattr(self.runner, name)


def _forwarding(name: str) -> Callable[..., Any]:
    """A :class:`TPRunnerProxy` method: broadcast the call, then run it locally.

    Defined on the class, not bound per instance: a closure over the proxy
    stored on the proxy is a reference cycle, which would keep the runner,
    its :class:`TPContext` and the process group alive until the cyclic
    garbage collector runs (possibly only at interpreter exit)."""

    def call(self: TPRunnerProxy, *args: Any, **kwargs: Any) -> Any:
        self.tp.broadcast((name, _to_cpu(args), _to_cpu(kwargs)))
        return getattr(self.runner, name)(*args, **kwargs)

    call.__name__, call.__qualname__ = name, f"TPRunnerProxy.{name}"
    call.__doc__ = getattr(ModelRunner, name).__doc__
    return call


for _name in FORWARDED:
    setattr(TPRunnerProxy, _name, _forwarding(_name))
del _name


def follow(runner: ModelRunner, tp: TPContext) -> None:
    """A follower's loop: replay rank 0's calls until it sends ``None``."""
    while True:
        command = tp.broadcast(None)
        if command is None:
            log.info("tensor-parallel rank %d stopped", tp.rank)
            return
        name, args, kwargs = command
        if name not in FORWARDED:
            raise RuntimeError(f"rank {tp.rank} got an unknown command {name!r}")
        try:
            getattr(runner, name)(*args, **kwargs)
        except _SYMMETRIC_ERRORS as exc:
            log.debug("rank %d: %s raised %s (rank 0 raises it too)", tp.rank, name, exc)
