"""Placement groups and the actor options that put an actor in one of their bundles.

An engine reserves one placement group (a bundle for the coordinator and one
per worker) and, for a sharded target, a second one of its own (one bundle
per rank). Both are reserved, and their actors placed, here; what one bundle
holds is :meth:`EngineConfig.bundle`.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from saguaro_ray.errors import ConfigError
from saguaro_ray.runtime.engine_config import EngineConfig


def reserve(bundles: list[dict[str, float]], strategy: str, name: str, timeout_s: float, what: str, advice: str) -> Any:
    """A ready placement group of ``bundles``; one Ray cannot place in
    ``timeout_s`` is removed and refused with a :class:`ConfigError` saying
    ``what`` it could not reserve and ``advice`` on what to change."""
    pg = placement_group(bundles, strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception as exc:
        remove_placement_group(pg)
        raise ConfigError(f"could not reserve {what} ({type(exc).__name__}); {advice}") from None
    return pg


def actor_options(config: EngineConfig, pg: Any, index: int, role: str, lifetime: str | None) -> dict[str, Any]:
    """Ray options of the ``role`` actor in bundle ``index`` of ``pg``: the
    bundle's CPUs (and a worker's GPU share on CUDA)."""
    bundle = config.bundle(role)
    opts: dict[str, Any] = {
        "num_cpus": bundle["CPU"],
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    }
    if "GPU" in bundle:
        opts["num_gpus"] = bundle["GPU"]
    if lifetime:
        opts["lifetime"] = lifetime
    return opts
