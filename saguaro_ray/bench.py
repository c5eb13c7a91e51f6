"""Side-by-side benchmarks: every mode on the same models, prompts and machine.

Conventions (Spec-Bench style): the same prompts for every mode, modes run
interleaved (A B C A B C …) so a drifting machine affects all alike, medians
and min–max over repeats, speedups taken against ``ar`` and ``sd`` *from the
same run*. Per setting it reports decode tokens/s, mean accepted length, the
SSD cache hit rate, and a per-round breakdown from the engine's timeline —
verify time, draft busy time, drafting exposed on the critical path, control
plane (everything in a round that is neither verification, exposed drafting
nor the cache lookup), and SSD's ideal (mean accepted + 1 tokens per verify
time per sequence) with efficiency = achieved / ideal.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from saguaro_ray.algorithms.fanout import parse_fanout
from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine.timeline import round_components
from saguaro_ray.bench_peers import PEER_MODES, PeerRunner
from saguaro_ray.prompt_sets import load_prompts

log = logging.getLogger(__name__)


# ----------------------------------------------------------------- analysis
def round_breakdown(rounds: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Sum the per-round components over decode (non-prefill) rounds, seconds."""
    out = {"rounds": 0, "wall": 0.0, "verify": 0.0, "draft_busy": 0.0, "draft_exposed": 0.0, "lookup": 0.0, "control": 0.0}
    for r in rounds:
        if r.get("prefill"):
            continue
        out["rounds"] += 1
        for key, value in round_components(r).items():
            out[key] += value
    return out


@dataclass
class RunResult:
    mode: str
    runtime: str
    num_drafts: int
    batch_size: int
    temperature: float
    seconds: float
    tokens: int
    decode_tokens: int
    decode_seconds: float
    accepted: int
    spec_rounds: int
    hits: int
    lookups: int
    breakdown: dict[str, float]
    rounds: list[dict[str, Any]] = field(repr=False, default_factory=list)


class _Runner:
    """One engine (mode × runtime × drafts), reused across settings."""

    def __init__(self, mode: str, runtime: str, num_drafts: int, args: "BenchArgs") -> None:
        self.mode, self.runtime, self.num_drafts = mode, runtime, num_drafts
        fanout = parse_fanout(args.fanout, args.k)
        spec = SpeculationConfig(
            mode=mode, k=args.k, budget=args.budget, fanout=fanout if fanout == "auto" else tuple(fanout), backup=args.backup, saguaro_c=args.saguaro_c, lq=args.k, ld=2
        )
        if runtime == "inprocess":
            from saguaro_ray.engine import LocalEngine, LocalEngineConfig

            self.engine = LocalEngine(
                LocalEngineConfig(
                    target=args.target,
                    draft=args.draft,
                    qualifier=args.qualifier,
                    spec=spec,
                    num_threads=args.threads,
                    num_drafts=num_drafts,
                    dtype=args.dtype,
                    **_build_ahead(args),
                )
            )
            self._timeline = lambda: [r.to_json() for r in self.engine.timeline]
            self.close = self.engine.close
        else:
            from saguaro_ray.runtime.engine import Engine
            from saguaro_ray.runtime.engine_config import EngineConfig

            self.engine = Engine.launch(
                EngineConfig(
                    target=args.target,
                    draft=args.draft,
                    qualifier=args.qualifier,
                    spec=spec,
                    num_drafts=num_drafts,
                    target_tp=args.target_tp,
                    **_build_ahead(args),
                    threads_per_worker=args.threads,
                    address=args.address,
                    dtype=args.dtype,
                )
            )
            self._timeline = lambda: self.engine.timeline()
            self.close = self.engine.shutdown

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


@dataclass
class BenchArgs:
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


def _median_min_max(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def summarise(runs: list[RunResult], rtt_s: float | None = None) -> list[dict[str, Any]]:
    """One result entry per (mode, runtime, drafts, batch, temperature);
    ``rtt_s``: the machine's bare inter-process round trip (for the floor)."""
    groups: dict[tuple, list[RunResult]] = {}
    for r in runs:
        groups.setdefault((r.mode, r.runtime, r.num_drafts, r.batch_size, r.temperature), []).append(r)
    entries = []
    for (mode, runtime, nd, b, t), rs in groups.items():
        tps = [r.decode_tokens / r.decode_seconds for r in rs]
        med, lo, hi = _median_min_max(tps)
        spec_rounds = sum(r.spec_rounds for r in rs)
        mean_acc = sum(r.accepted for r in rs) / spec_rounds if spec_rounds else None
        lookups = sum(r.lookups for r in rs)
        bd = {k: sum(r.breakdown[k] for r in rs) for k in rs[0].breakdown}
        n_rounds = max(bd["rounds"], 1)
        per_round_ms = {k: 1000 * bd[k] / n_rounds for k in ("wall", "verify", "draft_busy", "draft_exposed", "lookup", "control")}
        # ideal: every round emits (mean accepted + 1) tokens per sequence in one
        # verify time — drafting, lookup and control plane cost nothing (AR: 1 token)
        ideal = None
        if bd["verify"] > 0 and (mode == "ar" or mean_acc is not None):
            batch = sum(rd["batch"] for r in rs for rd in r.rounds if not rd.get("prefill")) / n_rounds
            ideal = batch * ((mean_acc or 0.0) + 1) / (bd["verify"] / n_rounds)
        efficiency = med / ideal if mode == "ssd" and ideal else None
        hops = _control_hops(mode, rs) if runtime == "ray" else None  # in process: no sockets
        entries.append(
            {
                "mode": mode,
                "runtime": runtime,
                "num_drafts": nd,
                "batch_size": b,
                "temperature": t,
                "tokens_per_s": med,
                "tokens_per_s_min": lo,
                "tokens_per_s_max": hi,
                "mean_accepted": mean_acc,
                "cache_hit_rate": (sum(r.hits for r in rs) / lookups) if (mode == "ssd" and lookups) else None,
                "efficiency": efficiency,
                "ideal_tokens_per_s": ideal,
                "control_plane_fraction": bd["control"] / bd["wall"] if bd["wall"] > 0 else None,
                "control_hops": hops,
                "control_floor_fraction": (hops * rtt_s / 2 / (bd["wall"] / n_rounds)) if rtt_s and hops and bd["wall"] > 0 else None,
                "per_round_ms": per_round_ms,
                "drafting_hidden_fraction": _hidden_fraction(rs) if mode == "ssd" else None,
                "build_ahead_fraction": _ahead_fraction(rs) if mode == "ssd" else None,
                **_control_quantiles(rs),
                "hops_ms": _hops(rs),
                "repeats": len(rs),
            }
        )
    ours = [x["runtime"] for x in entries if x["runtime"] != "hf"]
    for e in entries:
        # a peer (runtime "hf") is compared with our modes of the first runtime measured
        runtime = e["runtime"] if e["runtime"] != "hf" or not ours else ours[0]
        for base in ("ar", "sd"):
            ref = [x for x in entries if x["mode"] == base and x["runtime"] == runtime and x["batch_size"] == e["batch_size"] and x["temperature"] == e["temperature"]]
            e[f"speedup_vs_{base}"] = e["tokens_per_s"] / ref[0]["tokens_per_s"] if ref else None
            if base == "ar":
                # the speedup over AR were drafting and the control plane free in both
                # modes: this run's acceptance against this machine's verify costs
                ar_ideal = ref[0]["ideal_tokens_per_s"] if ref else None
                e["ideal_speedup_vs_ar"] = e["ideal_tokens_per_s"] / ar_ideal if ar_ideal and e["ideal_tokens_per_s"] else None
    return entries


# One-way control hops on a decode round's critical path: AR coordinator →
# target → coordinator; SD the same for the propose, then for the verify;
# SSD coordinator → target (verify) → draft (lookup) → coordinator when the
# target places the lookup, one hop more when the coordinator sends it;
# PyramidSD at least draft, qualify and verify, there and back.
_HOPS = {"ar": 2, "sd": 4, "ssd": 4, "pyramid": 6}


def _control_hops(mode: str, rs: Iterable[RunResult]) -> float | None:
    """Mean one-way control hops per decode round on the critical path."""
    per_round = [3 if rd.get("forwarded") else _HOPS[mode] for r in rs for rd in r.rounds if not rd.get("prefill")]
    return sum(per_round) / len(per_round) if per_round and mode in _HOPS else None


def _echo(endpoint: str) -> None:
    """A bare pyzmq echo server (a child process of :func:`ipc_round_trip_s`)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        ident, msg = sock.recv_multipart()
        sock.send_multipart([ident, msg])
        if msg == b"stop":
            return


def ipc_round_trip_s(n: int = 2000) -> float:
    """Median round trip of a bare pyzmq DEALER → ROUTER echo between two
    processes on this machine (ipc, 200-byte frames, no codec, no threads of
    ours): the floor under any control hop — what the kernel and ZeroMQ cost
    to wake a process and back — against which ``control_floor_fraction`` is taken
    (half of it per one-way hop)."""
    import multiprocessing
    import tempfile

    import zmq

    with tempfile.TemporaryDirectory(prefix="saguaro-rtt-") as tmp:
        endpoint = f"ipc://{tmp}/echo"
        proc = multiprocessing.get_context("spawn").Process(target=_echo, args=(endpoint,), daemon=True)
        proc.start()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        try:
            sock.connect(endpoint)
            frame, xs = b"x" * 200, []
            for i in range(n + 200):
                t0 = time.perf_counter()
                sock.send(frame)
                sock.recv()
                if i >= 200:  # warm-up
                    xs.append(time.perf_counter() - t0)
            sock.send(b"stop")
            sock.recv()
        finally:
            sock.close(0)
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return statistics.median(xs)


def _hops(rs: Iterable[RunResult]) -> dict[str, float | None]:
    """Median milliseconds of each control-plane hop of a decode round: the
    verification call reaching the target (``send``) and its result reaching
    the round loop (``reply``); for SSD also the round loop's bookkeeping before
    the lookup leaves, the lookup reaching the draft (after its build), and its
    answer coming back; ``between`` is from a round's last result to the next
    round's verification call, less any drafting in between (SD, PyramidSD).
    Worker spans are on the coordinator's clock."""
    xs: dict[str, list[float]] = {k: [] for k in ("send", "reply", "bookkeeping", "lookup_send", "lookup_reply", "between")}
    for r in rs:
        prev = None
        for rd in r.rounds:
            if rd.get("prefill") or rd.get("sent") is None or rd.get("verify") is None:
                prev = None
                continue
            xs["send"].append(rd["verify"][0] - rd["sent"])
            xs["reply"].append(rd["back"] - rd["verify"][1])
            if rd.get("lookup_sent") is not None and rd.get("lookup_back") is not None:
                ready = max(rd["lookup_sent"], rd["build"][1]) if rd.get("build") else rd["lookup_sent"]
                if not rd.get("forwarded"):  # the target placed the lookup: no bookkeeping before it
                    xs["bookkeeping"].append(rd["lookup_sent"] - rd["back"])
                xs["lookup_send"].append(rd["lookup"][0] - ready)
                xs["lookup_reply"].append(rd["lookup_back"] - rd["lookup"][1])
            if prev is not None and rd["index"] == prev["index"] + 1:
                drafting = rd["draft"][1] - rd["draft"][0] if rd.get("draft") else 0.0  # SD, pyramid, first SSD round
                xs["between"].append(rd["sent"] - (prev.get("lookup_back") or prev["back"]) - drafting)
            prev = rd
    return {k: 1000 * statistics.median(v) if v else None for k, v in xs.items()}


def _control_quantiles(rs: Iterable[RunResult]) -> dict[str, float | None]:
    """Median and p99 of the control-plane time per decode round, microseconds."""
    xs = sorted(1e6 * round_components(rd)["control"] for r in rs for rd in r.rounds if not rd.get("prefill"))
    if not xs:
        return {"control_us_median": None, "control_us_p99": None}
    return {"control_us_median": statistics.median(xs), "control_us_p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def _build_rounds(rs: Iterable[RunResult]) -> list[dict[str, Any]]:
    """The SSD decode rounds that ran a cache build."""
    return [rd for r in rs for rd in r.rounds if not rd.get("prefill") and rd.get("build") is not None]


def _ahead_fraction(rs: Iterable[RunResult]) -> float | None:
    """Share of SSD builds the draft started itself after the previous lookup."""
    builds = _build_rounds(rs)
    return sum(bool(rd.get("ahead")) for rd in builds) / len(builds) if builds else None


def _hidden_fraction(rs: Iterable[RunResult]) -> float | None:
    """Share of SSD rounds whose drafting cost nothing on the critical path:
    served from the cache (no backup drafting) and the build done in time."""
    builds = _build_rounds(rs)
    hidden = sum(rd.get("backup") is None and rd["build"][1] <= rd["verify"][1] for rd in builds)
    return hidden / len(builds) if builds else None


def step_costs(
    models: dict[str, str],
    threads: int = 1,
    context: int = 128,
    repeats: int = 30,
    branches: int = 8,
    device: str = "cpu",
    dtype: str | None = None,
    attention_backend: str | None = None,
) -> dict[str, dict[str, float]]:
    """Median milliseconds of the runner's basic steps per model, on ``threads``
    torch threads: a 1-token decode, an 8-token verify, and one tree-decode
    step of ``branches`` branches — the costs that decide whether speculation
    pays (on CPU a draft step must cost ≲ 1/10 of a target verify)."""
    import torch

    from saguaro_ray.models.resolve import resolve_models
    from saguaro_ray.workers.runner import ModelRunner

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {}
    try:
        for role, ref in resolve_models(models).items():
            runner = ModelRunner(ref.path, device=device, dtype=dtype, attention_backend=attention_backend, quantize=ref.quantize)
            runner.add_sequence(0)
            prompt = [(7 * i) % runner.vocab_size for i in range(context)]
            runner.forward([0], [prompt])

            def timed(fn: Any) -> float:
                samples = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    if device != "cpu":
                        torch.cuda.synchronize()
                    samples.append(time.perf_counter() - t0)
                return 1000 * statistics.median(samples)

            def decode(n: int) -> None:
                runner.forward([0], [prompt[:n]], num_logits=[n])
                runner.truncate(0, context)

            def tree() -> None:
                t = runner.tree_start([0] * branches, [context - (i % 4) for i in range(branches)], depth=4)
                runner.tree_forward(t, [[1]] * branches)

            out[role] = {"decode_1": timed(lambda: decode(1)), "verify_8": timed(lambda: decode(8)), f"tree_step_{branches}": timed(tree)}
    finally:
        torch.set_num_threads(old)
    return out


def machine_info(args: BenchArgs) -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray_version,
        "threads_per_worker": args.threads,
        "cuda": torch.cuda.is_available(),
        "git_commit": commit,
    }


def run_bench(args: BenchArgs) -> dict[str, Any]:
    """Run every mode interleaved over every setting; returns the report dict.

    Peer modes (``hf-ar``, ``hf-assisted``: :mod:`saguaro_ray.bench_peers`)
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
    models = {"target": args.target, "draft": args.draft} | ({"qualifier": args.qualifier} if args.qualifier else {})
    rtt_s = ipc_round_trip_s()
    return {
        "machine": machine_info(args) | {"ipc_round_trip_us": 1e6 * rtt_s},
        "step_costs_ms": step_costs({k: v for k, v in models.items() if v}, threads=args.threads, dtype=args.dtype),
        "config": {k: v for k, v in args.__dict__.items() if k != "progress"},
        "results": summarise(runs, rtt_s),
        "timeline_sample": _timeline_sample(runs),
    }


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
                            continue  # transformers decodes one request at a time (see bench_peers)
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


def _timeline_sample(runs: list[RunResult], rounds: int = 10) -> dict[str, list[dict[str, Any]]]:
    """A few rounds of the first batch-size-1 run per mode, for the Gantt plot."""
    sample: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        key = f"{r.mode}/{r.runtime}/d{r.num_drafts}"
        if key not in sample and r.batch_size == min(x.batch_size for x in runs):
            decode = [x for x in r.rounds if not x.get("prefill")]
            sample[key] = decode[:rounds]
    return sample


# ------------------------------------------------------------------- output
def format_table(report: dict[str, Any]) -> str:
    costs = report.get("step_costs_ms", {})
    pre = [
        f"{role}: decode {c['decode_1']:.2f} ms, 8-token verify {c['verify_8']:.2f} ms, tree step {c[[k for k in c if k.startswith('tree')][0]]:.2f} ms"
        for role, c in costs.items()
    ]
    rtt = report.get("machine", {}).get("ipc_round_trip_us")
    if rtt is not None:
        pre.append(f"bare pyzmq round trip between two processes: {rtt:.0f} us")
    head = f"{'mode':<12}{'runtime':<10}{'D':>2}{'batch':>6}{'T':>5}{'tok/s':>9}{'vs ar':>7}{'vs sd':>7}{'accept':>8}{'hit':>6}{'eff':>6}{'ideal/ar':>9}{'ctrl':>7}{'floor':>7}"
    lines = pre + [head]

    def f(v: float | None, width: int, fmt: str, suffix: str = "") -> str:
        return ("-" if v is None else format(v, fmt) + suffix).rjust(width)

    for e in report["results"]:
        lines.append(
            f"{e['mode']:<12}{e['runtime']:<10}{e['num_drafts']:>2}{e['batch_size']:>6}{e['temperature']:>5.1f}"
            f"{e['tokens_per_s']:>9.1f}{f(e['speedup_vs_ar'], 7, '.2f', 'x')}{f(e['speedup_vs_sd'], 7, '.2f', 'x')}"
            f"{f(e['mean_accepted'], 8, '.2f')}{f(e['cache_hit_rate'], 6, '.0%')}{f(e['efficiency'], 6, '.2f')}"
            f"{f(e['ideal_speedup_vs_ar'], 9, '.2f', 'x')}{f(e['control_plane_fraction'], 7, '.1%')}{f(e['control_floor_fraction'], 7, '.1%')}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Gantt of target and draft work over a few rounds per mode, and tokens/s bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sample = report["timeline_sample"]
    keys = [k for k in sample if sample[k]]
    fig, axes = plt.subplots(len(keys) + 1, 1, figsize=(11, 2.2 * (len(keys) + 1) + 1))
    axes = list(axes) if len(keys) + 1 > 1 else [axes]
    colors = {"verify": "#1f77b4", "build": "#2ca02c", "draft": "#ff7f0e", "lookup": "#9467bd"}
    for ax, key in zip(axes, keys):
        rounds = sample[key]
        t0 = rounds[0]["start"]
        for rd in rounds:
            for lane, part, color in ((1, "verify", "verify"), (0, "build", "build"), (0, "draft", "draft"), (0, "lookup", "lookup"), (0, "miss_backup", "draft")):
                span = rd.get(part)
                if span:
                    ax.barh(lane, (span[1] - span[0]) * 1000, left=(span[0] - t0) * 1000, color=colors[color], height=0.6)
            ax.axvline((rd["start"] - t0) * 1000, color="#cccccc", linewidth=0.5)
        ax.set_yticks([0, 1], ["draft", "target"])
        ax.set_title(key, fontsize=9, loc="left")
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    if keys:
        axes[0].legend(handles, list(colors), loc="upper right", fontsize=7, ncols=4)
    ax = axes[-1]
    res = [e for e in report["results"] if e["temperature"] == min(x["temperature"] for x in report["results"])]
    labels = [f"{e['mode']}/{e['runtime'][:2]}/d{e['num_drafts']}\nb={e['batch_size']}" for e in res]
    ax.bar(range(len(res)), [e["tokens_per_s"] for e in res], color="#1f77b4")
    ax.errorbar(
        range(len(res)),
        [e["tokens_per_s"] for e in res],
        yerr=[[e["tokens_per_s"] - e["tokens_per_s_min"] for e in res], [e["tokens_per_s_max"] - e["tokens_per_s"] for e in res]],
        fmt="none",
        color="black",
        capsize=2,
    )
    ax.set_xticks(range(len(res)), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
