"""Side-by-side benchmarks: every mode on the same models, prompts and machine.

Conventions (Spec-Bench style): the same prompts for every mode, modes run
interleaved (A B C A B C …) so a drifting machine affects all alike, and only
the engines being compared are alive at a time. This module runs the engines
and collects their timelines; :mod:`saguaro_ray.bench.report` turns the runs
into the report's entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from saguaro_ray.algorithms.fanout import parse_fanout
from saguaro_ray.bench.machine import machine_info, step_costs
from saguaro_ray.bench.peers import PEER_MODES, PeerRunner
from saguaro_ray.model_set import needed_specs
from saguaro_ray.bench.report import RunResult, round_breakdown, summarise, timeline_sample
from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.prompt_sets import load_prompts


@dataclass
class BenchArgs:
    """One bench command: the models, the modes and settings to compare, and
    the engine options every mode shares (the CLI's flags, one to one)."""

    target: str
    draft: str | None
    qualifier: str | None
    modes: list[str]
    num_drafts: list[int]
    prompts: str
    max_tokens: int
    batch_sizes: list[int]
    temperatures: list[float]
    repeats: int
    runtimes: list[str] = field(default_factory=lambda: ["ray"])
    k: int = 4
    budget: int = 8
    fanout: str = "auto"  # or K+1 comma-separated counts: a fixed fan-out, no adaptive budget
    backup: str = "auto"
    saguaro_c: float = 1.0
    threads: int = 1
    address: str | None = None
    num_prompts: int = 8
    target_tp: int = 1
    build_ahead: bool | None = None  # None: each runtime's default (on through Ray, off in process)
    dtype: str | None = None  # every engine's and peer's (None: the runner's default, fp32 on CPU)
    progress: bool = True


def _build_ahead(args: BenchArgs) -> dict[str, bool]:
    """The engine config's ``build_ahead`` when the command sets it."""
    return {} if args.build_ahead is None else {"build_ahead": args.build_ahead}


def _engine_calls(runtime: str, engine: Any) -> tuple[Callable[[], list[dict[str, Any]]], Callable[[], None]]:
    """``(timeline, close)`` of an engine of either runtime: the one place the
    bench adapts to their interfaces. The in-process engine's timeline is a
    property of round records, the Ray handle's a call returning their JSON
    dicts; one closes with ``close``, the other with ``shutdown``. Both
    ``generate`` alike (a list of ``GenerationResult``); the bench streams
    from neither."""
    if runtime == "inprocess":
        return (lambda: [r.to_json() for r in engine.timeline]), engine.close
    return engine.timeline, engine.shutdown


class _Runner:
    """One engine (mode × runtime × drafts), reused across settings."""

    def __init__(self, mode: str, runtime: str, num_drafts: int, args: BenchArgs) -> None:
        self.mode, self.runtime, self.num_drafts = mode, runtime, num_drafts
        fanout = parse_fanout(args.fanout, args.k)
        spec = SpeculationConfig(
            mode=mode, k=args.k, budget=args.budget, fanout=fanout if fanout == "auto" else tuple(fanout), backup=args.backup, saguaro_c=args.saguaro_c, lq=args.k, ld=2
        )
        from saguaro_ray.runtime.engine_config import EngineConfig

        config = EngineConfig(
            target=args.target,
            draft=args.draft,
            qualifier=args.qualifier,
            spec=spec,
            num_drafts=num_drafts,
            threads_per_worker=args.threads,
            dtype=args.dtype,
            **_build_ahead(args),
            **({} if runtime == "inprocess" else {"target_tp": args.target_tp, "address": args.address}),
        )
        if runtime == "inprocess":
            from saguaro_ray.engine import LocalEngine

            self.engine = LocalEngine(config)
        else:
            from saguaro_ray.runtime.engine import Engine

            self.engine = Engine.launch(config)
        self._timeline, self.close = _engine_calls(runtime, self.engine)

    def run(self, prompts: list[str], temperature: float, max_tokens: int, seed: int, batch_size: int | None = None) -> RunResult:
        """Generate every prompt, ``batch_size`` at a time (default: all at once)."""
        params = SamplingParams(temperature=temperature, top_k=0, max_tokens=max_tokens, seed=seed, ignore_eos=True)
        b = batch_size or len(prompts)
        before = len(self._timeline())
        t0 = time.perf_counter()
        results = [r for i in range(0, len(prompts), b) for r in self.engine.generate(prompts[i : i + b], params)]
        seconds = time.perf_counter() - t0
        rounds = self._timeline()[before:]
        tokens = sum(len(r.token_ids) for r in results)
        prefill = [r for r in rounds if r.get("prefill")]
        prefill_tokens = sum(r["batch"] for r in prefill)
        prefill_seconds = sum(r["end"] - r["start"] for r in prefill)
        decode = [r for r in rounds if not r.get("prefill")]
        return RunResult(
            mode=self.mode,
            runtime=self.runtime,
            num_drafts=self.num_drafts,
            batch_size=b,
            temperature=temperature,
            seconds=seconds,
            tokens=tokens,
            decode_tokens=tokens - prefill_tokens,
            decode_seconds=max(seconds - prefill_seconds, 1e-9),
            accepted=sum(sum(r["accepted"]) for r in decode),
            spec_rounds=sum(len(r["accepted"]) for r in decode) if self.mode != "ar" else 0,
            hits=sum(r["hits"] for r in decode),
            lookups=sum(r["hits"] + r["misses"] for r in decode),
            breakdown=round_breakdown(rounds),
            rounds=rounds,
        )


def run_bench(args: BenchArgs) -> dict[str, Any]:
    """Run every mode interleaved over every setting; returns the report dict.

    Peer modes (``hf-ar``, ``hf-assisted``: :mod:`saguaro_ray.bench.peers`)
    run interleaved with the first runtime's engines, at batch size 1."""
    from tqdm import tqdm

    from saguaro_ray.tokenizer import load_tokenizer
    from saguaro_ray.models.resolve import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(args.target)) if args.prompts == "chat" else None
    prompts = load_prompts(args.prompts, max(max(args.batch_sizes), args.num_prompts), tokenizer=tokenizer)
    engine_modes = [m for m in args.modes if m not in PEER_MODES]
    peers = [m for m in args.modes if m in PEER_MODES]
    plan = [
        (runtime, mode, nd)
        for runtime in args.runtimes
        for mode in engine_modes
        for nd in (args.num_drafts if mode == "ssd" else [1])
    ]
    if "ray" in args.runtimes and engine_modes:
        _start_ray_for(args, [(mode, nd) for runtime, mode, nd in plan if runtime == "ray"])
    settings = len(args.temperatures) * args.repeats
    total = settings * (len(args.batch_sizes) * len(plan) + (1 in args.batch_sizes) * len(peers))
    runs: list[RunResult] = []
    with tqdm(total=total, desc="bench", disable=not args.progress) as bar:
        # One runtime's engines at a time: modes are compared within a runtime,
        # and engines left idle still cost a small machine (their processes and
        # threads wake up to poll), so only the engines being compared are alive.
        for i, runtime in enumerate(args.runtimes):
            group = [(m, nd) for rt, m, nd in plan if rt == runtime] + [(m, 1) for m in peers if i == 0]
            runs += _run_group(args, group, runtime, prompts, bar)
    return {
        "machine": machine_info(args.threads),
        "step_costs_ms": step_costs(_benched_models(args), threads=args.threads, dtype=args.dtype),
        "config": {k: v for k, v in args.__dict__.items() if k != "progress"},
        "results": summarise(runs),
        "timeline_sample": timeline_sample(runs),
    }


def _benched_models(args: BenchArgs) -> dict[str, str]:
    """Role → model of what the benched modes run (the one rule,
    :func:`~saguaro_ray.model_set.needed_specs`, plus the draft hf-assisted
    runs): the step costs are measured for those alone, so a default
    ``--draft`` that no mode runs is never resolved (``--modes ar`` does not
    build the zoo family it names)."""
    engine_specs = [SpeculationConfig(mode=m) for m in args.modes if m not in PEER_MODES]
    models = {"target": args.target, **needed_specs(engine_specs, args.target, args.draft, args.qualifier)}
    if "hf-assisted" in args.modes and args.draft:
        models["draft"] = args.draft
    return models


def _run_group(args: BenchArgs, engines: list[tuple[str, int]], runtime: str, prompts: list[str], bar: Any) -> list[RunResult]:
    """Every setting over one runtime's engines (and the peers), interleaved (A B C A B C …)."""
    runners: list[Any] = []
    runs: list[RunResult] = []
    try:
        for mode, nd in engines:
            if mode in PEER_MODES:
                runners.append(PeerRunner(mode, args.target, args.draft, args.dtype, args.threads))
            else:
                runners.append(_Runner(mode, runtime, nd, args))
        for r in runners:  # warm-up: first-call allocations and lazy imports
            r.run(prompts[:1], 0.0, 8, 0)
        for b in args.batch_sizes:
            for t in args.temperatures:
                for rep in range(args.repeats):
                    for r in runners:
                        if r.runtime == "hf" and b != 1:
                            continue  # transformers decodes one request at a time (see bench.peers)
                        # every batch size sees the same prompts: ceil(P / b) generate calls of b
                        runs.append(r.run(prompts, t, args.max_tokens, seed=rep, batch_size=b))
                        bar.update(1)
    finally:
        for r in runners:
            r.close()
    return runs


def _start_ray_for(args: BenchArgs, engines: list[tuple[str, int]]) -> None:
    """One Ray instance hosts every engine of the run at once: give an embedded
    one enough logical CPUs for all their placement groups."""
    from saguaro_ray.runtime.engine import ensure_ray
    from saguaro_ray.runtime.engine_config import EngineConfig

    need = 0.0
    for mode, nd in engines:
        cfg = EngineConfig(
            target=args.target, draft=args.draft, qualifier=args.qualifier, spec=SpeculationConfig(mode=mode), num_drafts=nd, target_tp=args.target_tp
        )
        need += cfg.coordinator_cpus + cfg.worker_cpus * cfg.num_worker_actors
    ensure_ray(EngineConfig(target=args.target, address=args.address), logical_cpus=need)
