"""``saguaro-ray demo``: the built-in model family, every mode side by side.

Runs the same held-out prompts at temperature 0 through ``ar``, ``sd``,
``ssd`` and ``pyramid`` — as Ray actors on the embedded local Ray instance
(or in process with ``--in-process``) — and prints throughput,
mean accepted length, cache hit rate and whether each mode's tokens equal
AR's (they must: exactness is the contract).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from saguaro_ray.config import SamplingParams, SpeculationConfig


@dataclass
class DemoRow:
    mode: str
    tokens: int
    seconds: float
    mean_accepted: float | None
    cache_hit_rate: float | None
    same_as_ar: bool

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def demo_prompts(count: int, chars: int = 160) -> list[str]:
    """Prompts from the zoo's held-out source files (never training text)."""
    from saguaro_ray.zoo import heldout_texts

    texts = [t for t in heldout_texts() if len(t) > 2 * chars]
    step = max(1, len(texts) // count)
    return [texts[i * step][:chars] for i in range(count)]


def _engine(spec: SpeculationConfig, preset: str, threads: int, in_process: bool) -> tuple[Any, Any]:
    """An engine for ``spec`` on the zoo family and its close function."""
    models = dict(target=f"zoo:{preset}/target", draft=f"zoo:{preset}/draft", qualifier=f"zoo:{preset}/qualifier")
    if in_process:
        from saguaro_ray.engine import LocalEngine, LocalEngineConfig

        engine = LocalEngine(LocalEngineConfig(**models, spec=spec, num_threads=threads))
        return engine, engine.close
    from saguaro_ray.runtime.engine import Engine
    from saguaro_ray.runtime.engine_config import EngineConfig

    handle = Engine.launch(EngineConfig(**models, spec=spec, threads_per_worker=threads))
    return handle, handle.shutdown


def run_demo(
    preset: str = "tiny", prompts: int = 4, max_tokens: int = 48, k: int = 4, budget: int = 8, threads: int = 1, in_process: bool = False
) -> list[DemoRow]:
    """Generate with every mode (Ray actors by default); returns one row per mode."""
    from saguaro_ray.zoo import build_family

    build_family(preset)
    texts = demo_prompts(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    specs = [
        SpeculationConfig(mode="ar"),
        SpeculationConfig(mode="sd", k=k),
        SpeculationConfig(mode="ssd", k=k, budget=budget),
        SpeculationConfig(mode="pyramid", lq=k, ld=2),
    ]
    rows: list[DemoRow] = []
    reference: list[list[int]] | None = None
    for spec in specs:
        engine, close = _engine(spec, preset, threads, in_process)
        try:
            engine.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            t0 = time.perf_counter()
            results = engine.generate(texts, params)
            seconds = time.perf_counter() - t0
        finally:
            close()
        tokens = [r.token_ids for r in results]
        if reference is None:
            reference = tokens
        acc = [r.stats["mean_accepted"] for r in results if r.stats["mean_accepted"] is not None]
        hits = [r.stats["cache_hit_rate"] for r in results if r.stats["cache_hit_rate"] is not None]
        rows.append(
            DemoRow(
                mode=spec.mode,
                tokens=sum(len(t) for t in tokens),
                seconds=seconds,
                mean_accepted=sum(acc) / len(acc) if acc else None,
                cache_hit_rate=sum(hits) / len(hits) if hits else None,
                same_as_ar=tokens == reference,
            )
        )
    return rows


def format_rows(rows: list[DemoRow]) -> str:
    ar = rows[0].tokens_per_s
    lines = [f"{'mode':<8} {'tokens/s':>9} {'vs ar':>6} {'accepted':>9} {'hit rate':>9}  same tokens as ar"]
    for r in rows:
        acc = "-" if r.mean_accepted is None else f"{r.mean_accepted:.2f}"
        hit = "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.0%}"
        lines.append(f"{r.mode:<8} {r.tokens_per_s:>9.1f} {r.tokens_per_s / ar:>5.2f}x {acc:>9} {hit:>9}  {'yes' if r.same_as_ar else 'NO'}")
    return "\n".join(lines)
