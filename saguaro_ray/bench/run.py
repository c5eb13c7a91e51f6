"""Side-by-side benchmarks: every mode on the same models, prompts and machine.

Conventions (Spec-Bench style): the same prompts for every mode, modes run
interleaved (A B C A B C …) so a drifting machine affects all alike, and only
the engines being compared are alive at a time. This module runs the engines
and collects their timelines; :mod:`saguaro_ray.bench.report` turns the runs
into the report's entries.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from saguaro_ray.algorithms.fanout import parse_fanout
from saguaro_ray.bench.machine import machine_info, step_costs
from saguaro_ray.bench.peers import PeerRunner
from saguaro_ray.bench.plan import BenchMode, SamplingSetting, TemperatureSetting, in_turn, parse_modes, sampling_settings, temperature_settings
from saguaro_ray.bench.report import RunResult, merge_runs, round_breakdown, summarise, timeline_sample
from saguaro_ray.model_set import needed_specs
from saguaro_ray.config import ResponseFormat, SamplingParams, SpeculationConfig, Strategy
from saguaro_ray.engine.sequence import strategy_totals
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
    max_tokens: list[int]  # request lengths, each a set of cells of its own, run one after another on the same engines
    batch_sizes: list[int]
    temperatures: list[float]
    repeats: int
    mixed: list[float] | None = None  # a mixed-traffic cell: request j of a run at mixed[j mod n]
    runtimes: list[str] = field(default_factory=lambda: ["ray"])
    k: int = 4
    budget: int = 8
    fanout: str = "auto"  # or K+1 comma-separated counts: a fixed fan-out, no adaptive budget
    backup: str = "auto"
    threads: int = 1
    address: str | None = None
    num_prompts: int = 8
    target_tp: int = 1
    draft_vocab: int | None = None  # every draft's reduced-vocabulary head (EngineConfig.draft_vocab)
    build_ahead: bool | None = None  # None: each runtime's default (on through Ray, off in process)
    pin_cores: bool = True  # Ray workers claim CPU cores of their own (EngineConfig.pin_cores)
    dtype: str | None = None  # every engine's and peer's (None: the runner's default, fp32 on CPU)
    sampling: list[dict[str, Any]] | None = None  # sampling settings (``--sampling``), run interleaved; None: plain alone
    rounds: str | None = None  # a JSON-lines file: every batch of every run with all its rounds (``--rounds``)
    progress: bool = True


def _build_ahead(args: BenchArgs) -> dict[str, bool]:
    """The engine config's ``build_ahead`` when the command sets it."""
    return {} if args.build_ahead is None else {"build_ahead": args.build_ahead}


def _engine_calls(runtime: str, engine: Any) -> tuple[Callable[[], list[dict[str, Any]]], Callable[[], dict[str, Any]], Callable[[], None]]:
    """``(timeline, strategies, close)`` of an engine of either runtime: the
    one place the bench adapts to their interfaces. The in-process engine's
    timeline is a property of round records, the Ray handle's a call
    returning their JSON dicts; ``strategies`` is what the engine chose so far
    (sequence-rounds per mode and ``auto``'s policy state: its fitted costs
    and acceptance), the in-process round loop's or the Ray engine's metrics'
    part; one closes with ``close``, the other with ``shutdown``. Both
    ``generate`` alike (a list of ``GenerationResult``); the bench streams
    from neither."""
    if runtime == "inprocess":
        return (lambda: [r.to_json() for r in engine.timeline]), engine.loop.assigner.metrics, engine.close
    return engine.timeline, lambda: engine.metrics()["strategies"], engine.shutdown


def engine_spec(modes: list[BenchMode], args: BenchArgs) -> SpeculationConfig:
    """The one engine's speculation config for ``modes`` (each a request
    strategy): it allows their modes (``auto`` its default when benched), and
    its ``max_k`` covers a K sweep beyond the default ceiling — otherwise left
    as configured, since ``max_k`` is also the largest K ``auto`` may pick."""
    allow = tuple(dict.fromkeys(m.mode for m in modes))
    fanout = parse_fanout(args.fanout, args.k)
    spec = SpeculationConfig(
        mode="auto" if "auto" in allow else allow[0], allow=allow, k=args.k, budget=args.budget, fanout=fanout if fanout == "auto" else tuple(fanout),
        backup=args.backup, lq=args.k, ld=2,
    )
    sweep = max((m.strategy.k or 0 for m in modes if m.strategy), default=0)
    return replace(spec, max_k=sweep) if sweep > spec.k_max else spec


def engine_plan(modes: list[BenchMode], num_drafts: list[int]) -> list[tuple[int, list[BenchMode]]]:
    """``(num_drafts, modes)`` of every engine one runtime starts: one engine
    with one draft serves every mode, but SSD modes run on an engine per
    ``--num-drafts`` entry (SSD splits its outcomes between the drafts)."""
    ours = [m for m in modes if m.strategy]

    def drafts(m: BenchMode) -> list[int]:
        return num_drafts if m.mode == "ssd" else [1]

    return [(nd, [m for m in ours if nd in drafts(m)]) for nd in sorted({nd for m in ours for nd in drafts(m)})]


class _Engine:
    """One engine (runtime × drafts), serving each benched strategy per request."""

    def __init__(self, runtime: str, num_drafts: int, modes: list[BenchMode], args: BenchArgs) -> None:
        from saguaro_ray.runtime.engine_config import EngineConfig

        self.runtime, self.num_drafts = runtime, num_drafts
        config = EngineConfig(
            target=args.target,
            draft=args.draft,
            qualifier=args.qualifier,
            spec=engine_spec(modes, args),
            num_drafts=num_drafts,
            draft_vocab=args.draft_vocab,
            threads_per_worker=args.threads,
            dtype=args.dtype,
            **_build_ahead(args),
            pin_cores=args.pin_cores,
            **({} if runtime == "inprocess" else {"target_tp": args.target_tp, "address": args.address}),
        )
        if runtime == "inprocess":
            from saguaro_ray.engine import LocalEngine

            self.handle = LocalEngine(config)
        else:
            from saguaro_ray.runtime.engine import Engine

            self.handle = Engine.launch(config)
        self.timeline, self.strategies, self.close = _engine_calls(runtime, self.handle)


class _Runner:
    """One benched mode on its engine: the runs' requests carry its strategy."""

    def __init__(self, engine: _Engine, mode: BenchMode) -> None:
        self.engine, self.bench_mode = engine, mode
        self.mode, self.runtime, self.num_drafts = mode.label, engine.runtime, engine.num_drafts

    def run(
        self, prompts: list[str], temperatures: TemperatureSetting, max_tokens: int, seed: int, batch_size: int | None = None,
        sampling: SamplingSetting = SamplingSetting(), first: int = 0,
    ) -> RunResult:
        """Generate every prompt, ``batch_size`` at a time (default: all at once),
        request j at ``temperatures.for_request(first + j)`` (``first``: the
        index of ``prompts[0]`` in its run, which a cell runs batch by batch),
        each with ``sampling``'s fields."""
        params = request_params(len(prompts), temperatures, max_tokens, seed, self.bench_mode.strategy, sampling, first)
        b = batch_size or len(prompts)
        seen = self.engine.timeline()
        after = seen[-1]["index"] if seen else -1  # rounds are numbered; the byte-bounded timeline drops old ones
        t0 = time.perf_counter()
        results = [r for i in range(0, len(prompts), b) for r in self.engine.handle.generate(prompts[i : i + b], params[i : i + b])]
        seconds = time.perf_counter() - t0
        rounds = [r for r in self.engine.timeline() if r["index"] > after]
        tokens = sum(len(r.token_ids) for r in results)
        prefill = [r for r in rounds if r.get("prefill")]
        prefill_tokens = sum(r["batch"] for r in prefill)
        prefill_seconds = sum(r["end"] - r["start"] for r in prefill)
        decode = [r for r in rounds if not r.get("prefill")]
        chosen = chosen_strategies([r.stats for r in results])
        return RunResult(
            mode=self.mode,
            runtime=self.runtime,
            num_drafts=self.num_drafts,
            batch_size=b,
            temperature=temperatures.label,
            max_tokens=max_tokens,
            sampling=sampling.label,
            seconds=seconds,
            tokens=tokens,
            decode_tokens=tokens - prefill_tokens,
            decode_seconds=max(seconds - prefill_seconds, 1e-9),
            accepted=sum(sum(r["accepted"]) for r in decode),
            spec_rounds=sum(p > 0 for r in decode for p in r["proposed"]),  # sequences of a round may run AR
            hits=sum(r["hits"] for r in decode),
            lookups=sum(r["hits"] + r["misses"] for r in decode),
            breakdown=round_breakdown(rounds),
            rounds=rounds,
            seed=seed,
            outputs=[tuple(r.token_ids) for r in results],
            **chosen,
        )


def request_params(
    n: int,
    temperatures: TemperatureSetting,
    max_tokens: int,
    seed: int,
    strategy: Strategy | None,
    sampling: SamplingSetting = SamplingSetting(),
    first: int = 0,
) -> list[SamplingParams]:
    """The sampling parameters of ``n`` requests of a run from its request
    ``first`` on: each ``max_tokens`` long (end-of-sequence ignored, so every
    mode decodes as many tokens), request j at ``temperatures.for_request(j)``, carrying ``strategy`` and
    ``sampling``'s fields (penalties, logprobs, a response format, ...).
    Under a ``response_format`` EOS ends a request: past a complete document
    the grammar allows nothing else, and decoding those forced rows would
    flatter every mode."""
    structured = ResponseFormat.of(sampling.params.get("response_format")) is not None
    return [
        SamplingParams(
            **{"top_k": 0, **sampling.params},
            temperature=temperatures.for_request(j), max_tokens=max_tokens, seed=seed, ignore_eos=not structured, speculation=strategy,
        )
        for j in range(first, first + n)
    ]


def chosen_strategies(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's requests ran, from their stats (``strategy``: mode →
    rounds, ``mean_k`` over the rounds not in ``ar``), as
    :class:`RunResult`'s ``strategy``, ``k_total`` and ``k_rounds``: summed,
    so a cell's mean K weighs every round alike."""
    strategy, k_total, k_rounds = strategy_totals(stats)
    return {"strategy": strategy, "k_total": k_total, "k_rounds": k_rounds}


def run_bench(args: BenchArgs) -> dict[str, Any]:
    """Run every mode interleaved over every setting; returns the report dict.

    Peer modes (``hf-ar``, ``hf-assisted``: :mod:`saguaro_ray.bench.peers`)
    run interleaved with the first runtime's engines, at batch size 1."""
    from tqdm import tqdm

    from saguaro_ray.tokenizer import load_tokenizer
    from saguaro_ray.models.resolve import resolve_model_path

    modes = parse_modes(args.modes)
    settings = temperature_settings(args.temperatures, args.mixed)
    samplings = sampling_settings(args.sampling)
    tokenizer = load_tokenizer(resolve_model_path(args.target)) if args.prompts == "chat" else None
    prompts = load_prompts(args.prompts, max(max(args.batch_sizes), args.num_prompts), tokenizer=tokenizer)
    engines = engine_plan(modes, args.num_drafts)
    peers = [m.label for m in modes if not m.strategy]
    if "ray" in args.runtimes and engines:
        _start_ray_for(args, engines)
    rows = sum(len(ms) for _, ms in engines)
    plain = sum(not s.params for s in samplings)  # the peers run plain sampling alone
    total = len(args.max_tokens) * len(settings) * args.repeats * (len(args.batch_sizes) * rows * len(args.runtimes) * len(samplings) + (1 in args.batch_sizes) * len(peers) * plain)
    runs: list[RunResult] = []
    strategies: dict[str, dict[str, Any]] = {}
    with tqdm(total=total, desc="bench", disable=not args.progress) as bar, _rounds_log(args.rounds) as record:
        # One runtime's engines at a time: modes are compared within a runtime,
        # and engines left idle still cost a small machine (their processes and
        # threads wake up to poll), so only the engines being compared are alive.
        for i, runtime in enumerate(args.runtimes):
            runs += _run_group(args, engines, runtime, peers if i == 0 else [], prompts, settings, samplings, bar, strategies, record)
    return {
        "machine": machine_info(args.threads),
        "step_costs_ms": step_costs(_benched_models(args), threads=args.threads, dtype=args.dtype, draft_vocab=args.draft_vocab),
        "config": {k: v for k, v in args.__dict__.items() if k != "progress"},
        "results": summarise(runs),
        "engine_strategies": strategies,
        "timeline_sample": timeline_sample(runs),
    }


Record = Callable[[RunResult, int, int], None]  # a batch's run, its repeat, its first prompt's index


def _unrecorded(run: RunResult, repeat: int, first: int) -> None:
    """Without ``--rounds`` the batches' rounds are summarised and let go."""


@contextmanager
def _rounds_log(path: str | None) -> Iterator[Record]:
    """``--rounds``: each batch a runner generates, as one JSON line written
    when its cell ends (a bench stopped midway keeps the cells it finished):
    its run's labels, ``repeat``, ``first`` (its first prompt's index), its
    seconds, tokens, strategies, outputs and every round record. The report
    keeps a few rounds per mode; a question the report cannot answer (which
    prompt lost, what auto predicted against what a round took) is answered
    from these lines without running the bench again."""
    if path is None:
        yield _unrecorded
        return
    with open(path, "w", encoding="utf-8") as f:

        def record(run: RunResult, repeat: int, first: int) -> None:
            line = {**run.labels(), "repeat": repeat, "first": first, "seconds": run.seconds, "tokens": run.tokens, "strategy": run.strategy}
            f.write(json.dumps({**line, "outputs": run.outputs, "rounds": run.rounds}) + "\n")
            f.flush()

        yield record


def _benched_models(args: BenchArgs) -> dict[str, str]:
    """Role → model of what the benched engines run (the one rule,
    :func:`~saguaro_ray.model_set.needed_specs`, plus the draft hf-assisted
    runs): the step costs are measured for those alone, so a default
    ``--draft`` that no mode runs is never resolved (``--modes ar`` does not
    build the zoo family it names)."""
    specs = [engine_spec(ms, args) for _, ms in engine_plan(parse_modes(args.modes), args.num_drafts)]
    models = {"target": args.target, **needed_specs(specs, args.target, args.draft, args.qualifier)}
    if "hf-assisted" in args.modes and args.draft:
        models["draft"] = args.draft
    return models


def _run_group(
    args: BenchArgs,
    plan: list[tuple[int, list[BenchMode]]],
    runtime: str,
    peers: list[str],
    prompts: list[str],
    settings: list[TemperatureSetting],
    samplings: list[SamplingSetting],
    bar: Any,
    strategies: dict[str, dict[str, Any]],
    record: Record = _unrecorded,
) -> list[RunResult]:
    """Every cell (request length × batch size × temperature × sampling) over one runtime's engines'
    modes (and the peers at batch 1, plain sampling only: transformers has no
    presence or frequency penalty), interleaved batch by batch
    (:func:`_run_cell`, each batch passed to ``record``); ``strategies`` gets
    each engine's choices once its runs are done (``runtime/dN``)."""
    closers: list[Callable[[], None]] = []
    engines: list[_Engine] = []
    runners: list[Any] = []
    runs: list[RunResult] = []
    try:
        for nd, modes in plan:
            engine = _Engine(runtime, nd, modes, args)
            engines.append(engine)
            closers.append(engine.close)
            runners += [_Runner(engine, m) for m in modes]
        for mode in peers:
            runners.append(PeerRunner(mode, args.target, args.draft, args.dtype, args.threads))
            closers.append(runners[-1].close)
        for r in runners:  # warm-up: first-call allocations (up to the largest batch, on the shared engine) and lazy imports
            r.run(prompts[: 1 if r.runtime == "hf" else max(args.batch_sizes)], settings[0], 8, 0)
        for n in args.max_tokens:  # the engines live on: what auto learned at one length it brings to the next, as a server would
            for b in args.batch_sizes:
                for t in settings:
                    for rep in range(args.repeats):
                        for s in samplings:
                            cell = [r for r in runners if r.runtime != "hf" or (b == 1 and not s.params)]
                            runs += _run_cell(cell, prompts, t, s, n, rep, b, record)
                            bar.update(len(cell))
        strategies.update({f"{e.runtime}/d{e.num_drafts}": e.strategies() for e in engines})
    finally:
        for close in closers:
            close()
    return runs


def _run_cell(
    runners: list[Any], prompts: list[str], t: TemperatureSetting, s: SamplingSetting, max_tokens: int, rep: int, b: int,
    record: Record = _unrecorded,
) -> list[RunResult]:
    """One cell (batch size × setting × repeat): every batch of ``b`` prompts
    is generated by each runner in a rotating order before the next batch
    starts, and each runner's batches make its one run of the cell. Run one
    runner's batches after another's, the last row also carried how far a
    shared machine had drifted by then (±7-15 % within a cell here) and
    whatever the runner before it left behind; taking turns charges both to
    every row alike, as the demo does. The turns go on counting across
    repeats: where one batch is every prompt (batch 8 of 8), a repeat is the
    only turn, and each repeat puts another runner first. Each batch's run
    goes to ``record`` once the cell is done."""
    parts: dict[int, list[RunResult]] = {i: [] for i in range(len(runners))}
    starts = range(0, len(prompts), b)
    for j, first in enumerate(starts):
        chunk = prompts[first : first + b]
        for i in in_turn(list(range(len(runners))), rep * len(starts) + j):
            r = runners[i]
            if r.runtime == "hf":  # transformers decodes one request at a time (see bench.peers), plainly
                parts[i].append(r.run(chunk, t, max_tokens, seed=rep, batch_size=b, first=first))
            else:
                parts[i].append(r.run(chunk, t, max_tokens, seed=rep, batch_size=b, sampling=s, first=first))
    for i in range(len(runners)):
        for first, part in zip(starts, parts[i]):
            record(part, rep, first)
    return [merge_runs(parts[i]) for i in range(len(runners))]


def _start_ray_for(args: BenchArgs, engines: list[tuple[int, list[BenchMode]]]) -> None:
    """One Ray instance hosts every engine of the run at once: give an embedded
    one enough logical CPUs for all their placement groups."""
    from saguaro_ray.runtime.engine import ensure_ray
    from saguaro_ray.runtime.engine_config import EngineConfig

    need = 0.0
    for nd, modes in engines:
        cfg = EngineConfig(
            target=args.target, draft=args.draft, qualifier=args.qualifier, spec=engine_spec(modes, args), num_drafts=nd, target_tp=args.target_tp
        )
        need += cfg.coordinator_cpus + cfg.worker_cpus * cfg.num_worker_actors
    ensure_ray(EngineConfig(target=args.target, address=args.address), logical_cpus=need)
