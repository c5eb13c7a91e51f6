"""What the isolation, cancellation and stop tests share: the tiny zoo's
engines in process, and how to read their workers' KV and the scheduler's
progress without asserting any time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig

WAIT_S = 120.0  # a generous bound on waiting for the engine to go idle (never asserted as a duration)

SPECS = {
    "ar": SpeculationConfig(mode="ar"),
    "sd": SpeculationConfig(mode="sd", k=4),
    "ssd": SpeculationConfig(mode="ssd", k=4, budget=8),
    "pyramid": SpeculationConfig(mode="pyramid", lq=4, ld=2),
}


def local_engine(zoo: Path, mode: str, **kw) -> LocalEngine:
    return LocalEngine(
        EngineConfig(
            target=str(zoo / "target"),
            draft=str(zoo / "draft") if mode != "ar" else None,
            qualifier=str(zoo / "qualifier") if mode == "pyramid" else None,
            spec=SPECS[mode],
            threads_per_worker=1,
            **kw,
        )
    )


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def poisoned(params: SamplingParams, **fields) -> SamplingParams:
    """``params`` with values the validation would refuse (as a value that
    slipped past an edge would arrive): the engine must fail this request only."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def settle(engine: LocalEngine) -> None:
    """Wait until nothing is queued or running, and every worker has run the
    releases sent before (a worker runs its calls in order)."""
    wait_until(lambda: engine.scheduler.active == 0, "the scheduler to go idle")
    for w in engine.workers.values():
        w.call("release", [])


def free_blocks(engine: LocalEngine) -> dict[str, int]:
    return {role: w.logic.runner.kv.free_blocks for role, w in engine.workers.items()}
