"""The bench's report: one entry per setting, summarised from the runs' round timelines.

Every figure comes from what the engines recorded (their per-round timelines)
and the runs' token counts; the control plane costs what the timeline shows
it cost (``control_plane_fraction``, ``control_us_*``, and ``hops_ms`` per
hop), with no model of its hops. Conventions (Spec-Bench style): medians and
min–max over repeats, speedups taken against ``ar`` and ``sd`` *from the same
run*, repeat by repeat (the median of the paired ratios). Per setting it
reports decode tokens/s, mean accepted length, the SSD cache hit rate, and a
per-round breakdown from the engine's timeline — verify time, draft busy time,
drafting exposed on the critical path, control plane (everything in a round
that is neither verification, exposed drafting nor the cache lookup), and
SSD's ideal (mean accepted + 1 tokens per verify time per sequence) with
efficiency = achieved / ideal. Every cell (batch size × sampling ×
temperature × runtime) names its best fixed mode, and ``auto`` rows their
ratio to it and to AR, with what ``auto`` chose (the requests' own stats).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from saguaro_ray.bench.plan import PEER_MODES, base_mode
from saguaro_ray.engine.timeline import prediction_error, round_components


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
    """One generate pass of one runner over the prompts: what :func:`summarise`
    aggregates. Our engines and the transformers peers both produce it, so a
    peer's row is summarised by the same rules as ours."""

    mode: str  # the ``--modes`` label (``sd:2``)
    runtime: str
    num_drafts: int
    batch_size: int
    temperature: float | str  # a mixed setting's label (``mix:0,0.7``)
    max_tokens: int  # every request's length (``--max-tokens``: one run may bench several)
    seconds: float
    tokens: int
    decode_tokens: int
    decode_seconds: float
    accepted: int
    spec_rounds: int  # sequence-rounds that verified draft tokens
    hits: int
    lookups: int
    breakdown: dict[str, float]
    rounds: list[dict[str, Any]] = field(repr=False, default_factory=list)
    strategy: dict[str, int] = field(default_factory=dict)  # mode → sequence-rounds run in it
    k_total: float = 0.0  # K summed over the sequence-rounds not in AR ...
    k_rounds: int = 0  # ... and their number (mean K = k_total / k_rounds)
    sampling: str | None = None  # the sampling setting's label (``--sampling``; None: plain)
    seed: int = 0  # every request's seed (the repeat's index)
    outputs: list[tuple[int, ...]] = field(repr=False, default_factory=list)  # each request's token ids, in prompt order

    def labels(self) -> dict[str, Any]:
        """What names this run's report row and its ``--rounds`` lines (:data:`ROW_LABELS`)."""
        return {k: getattr(self, k) for k in ROW_LABELS}


# What names a report row and a ``--rounds`` line (a run's labels), and the part of it that makes a
# cell: the rows of one cell are compared with one another (best fixed mode, AR, the exactness check).
ROW_LABELS = ("mode", "runtime", "num_drafts", "max_tokens", "batch_size", "temperature", "sampling")
CELL_LABELS = tuple(k for k in ROW_LABELS if k not in ("mode", "num_drafts"))


def _added(counts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts by key (a run's rounds per mode, its per-round breakdown) added up."""
    out: dict[str, Any] = {}
    for c in counts:
        for key, n in c.items():
            out[key] = out.get(key, 0) + n
    return out


def merge_runs(parts: Sequence[RunResult]) -> RunResult:
    """One runner's batches of a cell as one run: counts, seconds, rounds and
    outputs added up in order (the bench generates a cell batch by batch, the
    modes taking turns)."""
    first, *rest = parts
    if not rest:
        return first
    added = ("seconds", "tokens", "decode_tokens", "decode_seconds", "accepted", "spec_rounds", "hits", "lookups", "k_total", "k_rounds")
    return replace(
        first,
        **{k: sum(getattr(p, k) for p in parts) for k in added},
        breakdown=_added(p.breakdown for p in parts),
        rounds=[rd for p in parts for rd in p.rounds],
        strategy=_added(p.strategy for p in parts),
        outputs=[o for p in parts for o in p.outputs],
    )


def _median_min_max(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def summarise(runs: list[RunResult]) -> list[dict[str, Any]]:
    """One result entry per (mode, runtime, drafts, request length, batch,
    temperature, sampling), then each cell's comparisons (:func:`_compare`)."""
    groups: dict[tuple, list[RunResult]] = {}
    for r in runs:
        groups.setdefault(tuple(r.labels().values()), []).append(r)
    entries = []
    for rs in groups.values():
        mode = rs[0].mode
        tps = [r.decode_tokens / r.decode_seconds for r in rs]
        med, lo, hi = _median_min_max(tps)
        spec_rounds = sum(r.spec_rounds for r in rs)
        accepted = sum(r.accepted for r in rs)
        lookups = sum(r.lookups for r in rs)
        bd = _added(r.breakdown for r in rs)
        n_rounds = max(bd["rounds"], 1)
        per_round_ms = {k: 1000 * bd[k] / n_rounds for k in ("wall", "verify", "draft_busy", "draft_exposed", "lookup", "control")}
        # ideal: every sequence-round emits its accepted tokens and one more in
        # one verify time — drafting, lookup and control plane cost nothing
        # (AR: 1 token); sequences of one round may run different strategies
        seq_rounds = sum(rd["batch"] for r in rs for rd in r.rounds if not rd.get("prefill"))
        ideal = (accepted + seq_rounds) / bd["verify"] if bd["verify"] > 0 else None
        k_rounds = sum(r.k_rounds for r in rs)
        strategy = _added(r.strategy for r in rs)
        entries.append(
            {
                **rs[0].labels(),
                "tokens_per_s": med,
                "tokens_per_s_min": lo,
                "tokens_per_s_max": hi,
                "tokens_per_s_by_repeat": {r.seed: x for r, x in zip(rs, tps)},
                "mean_accepted": accepted / spec_rounds if spec_rounds else None,
                "cache_hit_rate": sum(r.hits for r in rs) / lookups if lookups else None,
                "hit_by_outcome": _hit_by_outcome(rs) if lookups else None,
                "efficiency": med / ideal if base_mode(mode) == "ssd" and ideal else None,
                "ideal_tokens_per_s": ideal,
                "control_plane_fraction": bd["control"] / bd["wall"] if bd["wall"] > 0 else None,
                "per_round_ms": per_round_ms,
                "drafting_hidden_fraction": _hidden_fraction(rs),
                "tail_fraction": _tail_fraction(rs),
                "build_ahead_fraction": _ahead_fraction(rs),
                **_control_quantiles(rs),
                "hops_ms": _hops(rs),
                "strategy": strategy or None,
                "mean_k": sum(r.k_total for r in rs) / k_rounds if k_rounds else None,
                # auto's predicted round time and tokens against what its rounds took (timeline.prediction_error)
                "auto_prediction": prediction_error([rd for r in rs for rd in r.rounds]) if base_mode(mode) == "auto" else None,
                "repeats": len(rs),
                "same_as_ar": _same_as_ar(rs, runs),
            }
        )
    _compare(entries)
    return entries


def _hit_by_outcome(rs: Iterable[RunResult]) -> dict[str, dict[str, float]]:
    """SSD's lookups split by what verification did: ``full`` (every draft token
    accepted: a hit needs the bonus token among the cached ones) and ``rejected``
    (a hit needs the accepted length and the target's correction cached). Each:
    its share of the lookups and its hit rate — where the misses come from."""
    seen = [x for r in rs for rd in r.rounds for x in rd.get("looked_up") or ()]
    out = {}
    for name, full in (("full", True), ("rejected", False)):
        xs = [hit for accepted, proposed, hit in seen if (accepted == proposed) == full]
        out[name] = {"share": len(xs) / len(seen) if seen else 0.0, "hit_rate": sum(xs) / len(xs) if xs else 0.0}
    return out


def _same_as_ar(rs: Sequence[RunResult], runs: Sequence[RunResult]) -> dict[str, int] | None:
    """How many of a row's outputs are AR's tokens, request by request: ``{"equal": n, "of": m}``.

    Every strategy of our engine must emit AR's tokens for the same seeded
    request at any temperature (one verification rule, row-invariant logits:
    DESIGN §8), so this is the benchmark's own exactness check, over every
    prompt it ran. A peer (transformers) is compared at T = 0 only, where its
    greedy search may still differ at a near-tie of the top two logits; its
    sampling draws from another random stream. None: no AR run to compare
    with (or the row is AR's own)."""
    counts = {"equal": 0, "of": 0}
    for r in rs:
        if r.mode == "ar" or not r.outputs or (r.runtime == "hf" and r.temperature != 0.0):
            return None
        ref = next((a for a in runs if a.mode == "ar" and _reference_for(a, r) and len(a.outputs) == len(r.outputs)), None)
        if ref is None:
            return None
        counts["of"] += len(r.outputs)
        counts["equal"] += sum(x == y for x, y in zip(r.outputs, ref.outputs))
    return counts


def _reference_for(ar: RunResult, r: RunResult) -> bool:
    """Is ``ar`` (an AR run of our engine) the run ``r`` is compared with: the
    same request length, temperature, sampling and seed, and for our rows the same runtime and
    batch size (a peer: any of ours, the engine's outputs not depending on the batch)."""
    if ar.runtime == "hf" or (ar.max_tokens, ar.temperature, ar.sampling, ar.seed) != (r.max_tokens, r.temperature, r.sampling, r.seed):
        return False
    return r.runtime == "hf" or (ar.runtime, ar.batch_size) == (r.runtime, r.batch_size)


def inexact_rows(results: Sequence[dict[str, Any]]) -> list[str]:
    """The rows of our engine whose outputs are not all AR's
    (``ssd (ray) 64 tokens batch 4 T 0.7: 3/8 equal``): each one breaks the exactness contract."""
    return [
        f"{row_name(e)} ({e['runtime']}) {e['max_tokens']} tokens batch {e['batch_size']} T {_temperature_label(e['temperature'])}: "
        f"{e['same_as_ar']['equal']}/{e['same_as_ar']['of']} equal"
        for e in results
        if e["runtime"] != "hf" and e.get("same_as_ar") and e["same_as_ar"]["equal"] < e["same_as_ar"]["of"]
    ]


def _same_cell(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in CELL_LABELS)


def row_name(e: dict[str, Any]) -> str:
    """A row's mode label, with its drafts when more than one (``ssd/d2``)."""
    return e["mode"] if e["num_drafts"] == 1 else f"{e['mode']}/d{e['num_drafts']}"


def _compare(entries: list[dict[str, Any]]) -> None:
    """Each entry's speedups over ``ar`` and ``sd`` of its cell (request length ×
    batch size × temperature × sampling × runtime), and the cell's best fixed mode (the fastest
    engine row that is not ``auto``) with ``auto``'s ratios to it and to AR.
    A peer (runtime ``hf``) is compared with our modes of the first runtime measured."""
    ours = [x["runtime"] for x in entries if x["runtime"] != "hf"]
    for e in entries:
        cell = dict(e, runtime=e["runtime"] if e["runtime"] != "hf" or not ours else ours[0])
        ref = {base: next((x for x in entries if x["mode"] == base and _same_cell(x, cell)), None) for base in ("ar", "sd")}
        for base, x in ref.items():
            e[f"speedup_vs_{base}"] = _paired(e, x)[0] if x else None
        # the speedup over AR were drafting and the control plane free in both
        # modes: this run's acceptance against this machine's verify costs
        ar_ideal = ref["ar"]["ideal_tokens_per_s"] if ref["ar"] else None
        e["ideal_speedup_vs_ar"] = e["ideal_tokens_per_s"] / ar_ideal if ar_ideal and e["ideal_tokens_per_s"] else None
        fixed = [x for x in entries if x["runtime"] != "hf" and base_mode(x["mode"]) != "auto" and _same_cell(x, cell)]
        best = max(fixed, key=lambda x: x["tokens_per_s"]) if fixed and e["runtime"] != "hf" else None
        e["best_fixed"] = row_name(best) if best else None
        is_auto = base_mode(e["mode"]) == "auto"
        for name, x in (("best", best), ("ar", ref["ar"])):
            paired = _paired(e, x) if is_auto and x else (None, None, None)
            e[f"auto_vs_{name}"], e[f"auto_vs_{name}_min"], e[f"auto_vs_{name}_max"] = paired


def _paired(e: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float, float]:
    """``e``'s tokens/s over ``ref``'s repeat by repeat — median, min, max. The rows of one
    repeat ran interleaved, minutes apart, while repeats may be an hour apart on a machine
    whose speed drifts by a third: a ratio within a repeat cancels the drift that a ratio of
    the two rows' medians keeps. Without a repeat in common, the ratio of the medians."""
    mine, theirs = e["tokens_per_s_by_repeat"], ref["tokens_per_s_by_repeat"]
    xs = [mine[s] / theirs[s] for s in mine if s in theirs]
    return _median_min_max(xs) if xs else (e["tokens_per_s"] / ref["tokens_per_s"],) * 3  # type: ignore[return-value]


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


def _tail_fraction(rs: Iterable[RunResult]) -> float | None:
    """The share of decode time in rounds that ran fewer sequences than their batch's first
    rounds after its prefill (the bench's batches start together). Requests that speculate
    finish at different rounds, and a batch's last rounds run its laggards alone, where AR's
    finish together: on the coder pair at batch 8 (session 33) 19-37 % of a speculating run's
    time, at a fraction of a full round's tokens per second — a cost of speculation that
    comparing rounds does not show."""
    wall = tail = 0.0
    for r in rs:
        full = 0
        for rd in r.rounds:
            if rd.get("prefill"):
                full = 0  # a batch starts: its size is what its decode rounds run
                continue
            full = max(full, rd["batch"])
            seconds = rd["end"] - rd["start"]
            wall += seconds
            tail += seconds if rd["batch"] < full else 0.0
    return tail / wall if wall > 0 else None


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


def timeline_sample(runs: list[RunResult], rounds: int = 10) -> dict[str, list[dict[str, Any]]]:
    """A few rounds of the first batch-size-1 run per mode, for the Gantt plot."""
    sample: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        key = f"{r.mode}/{r.runtime}/d{r.num_drafts}"
        if key not in sample and r.batch_size == min(x.batch_size for x in runs):
            decode = [x for x in r.rounds if not x.get("prefill")]
            sample[key] = decode[:rounds]
    return sample


def format_table(report: dict[str, Any]) -> str:
    """The report as the fixed-width table the command prints."""
    costs = report.get("step_costs_ms", {})
    pre = [
        f"{role}: decode {c['decode_1']:.2f} ms, 8-token verify {c['verify_8']:.2f} ms, tree step {c[[k for k in c if k.startswith('tree')][0]]:.2f} ms"
        for role, c in costs.items()
    ]
    head = f"{'mode':<12}{'runtime':<10}{'D':>2}{'tokens':>7}{'batch':>6}{'T':>10}{'tok/s':>9}{'vs ar':>7}{'vs sd':>7}{'accept':>8}{'hit':>6}{'eff':>6}{'ideal/ar':>9}{'ctrl':>7}{'=ar':>8}"
    lines = pre + [head]

    def f(v: float | None, width: int, fmt: str, suffix: str = "") -> str:
        return ("-" if v is None else format(v, fmt) + suffix).rjust(width)

    for e in report["results"]:
        t = e["temperature"]
        lines.append(
            f"{e['mode']:<12}{e['runtime']:<10}{e['num_drafts']:>2}{e['max_tokens']:>7}{e['batch_size']:>6}{t if isinstance(t, str) else format(t, '.1f'):>10}"
            f"{e['tokens_per_s']:>9.1f}{f(e['speedup_vs_ar'], 7, '.2f', 'x')}{f(e['speedup_vs_sd'], 7, '.2f', 'x')}"
            f"{f(e['mean_accepted'], 8, '.2f')}{f(e['cache_hit_rate'], 6, '.0%')}{f(e['efficiency'], 6, '.2f')}"
            f"{f(e['ideal_speedup_vs_ar'], 9, '.2f', 'x')}{f(e['control_plane_fraction'], 7, '.1%')}"
            f"{_same_label(e.get('same_as_ar')):>8}"
            + (f"  {auto_note(e)}" if base_mode(e["mode"]) == "auto" else "")
            + (f"  sampling {e['sampling']}" if e.get("sampling") else "")
        )
    return "\n".join(lines)


def _same_label(same: dict[str, int] | None) -> str:
    """``8/8``: a row's outputs equal to AR's, of those compared (``-``: none)."""
    return "-" if not same else f"{same['equal']}/{same['of']}"


def _shares(e: dict[str, Any]) -> list[tuple[str, float]]:
    """What a row's requests ran: (mode, share of its sequence-rounds), most run first."""
    counts = e["strategy"] or {}
    total = sum(counts.values())
    return [(m, n / total) for m, n in sorted(counts.items(), key=lambda kv: -kv[1])] if total else []


def auto_note(e: dict[str, Any]) -> str:
    """An ``auto`` row's comparison and choices: ``best sd:4 1.02x; chose ar 10%, sd 90%; mean K 3.1``."""
    parts = [f"best {e['best_fixed']} {e['auto_vs_best']:.2f}x" if e["auto_vs_best"] is not None else "best -"]
    if shares := _shares(e):
        parts.append("chose " + ", ".join(f"{m} {f:.0%}" for m, f in shares))
    if e["mean_k"] is not None:
        parts.append(f"mean K {e['mean_k']:.1f}")
    if pred := e.get("auto_prediction"):
        parts.append(f"predicted/measured round time {pred['seconds_ratio']:.2f} (median error {pred['seconds_error']:.0%}), verification {pred['verify_ratio']:.2f}")
    return "; ".join(parts)


def _temperature_label(t: float | str) -> str:
    """``0.0`` → ``0``; a mixed cell (``mix:0,0.7``) → ``mixed 0/0.7``."""
    if isinstance(t, str):
        return "mixed " + "/".join(t.split(":", 1)[-1].split(","))
    return format(t, "g")


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    """The report's cells as the README's Markdown table: one row per cell
    (batch size, temperature — and runtime, drafts, sampling, request length
    where a run varies them), one tok/s column per mode in the order the run had them
    (``–``: not run in that cell), then an ``auto`` row's comparison with the
    cell's best fixed mode and AR and what it chose. ``results`` may join
    several runs' (``report["results"]`` of each)."""
    modes = list(dict.fromkeys(e["mode"] for e in results))
    ours = [e for e in results if e["mode"] not in PEER_MODES]
    varying = [k for k in ("runtime", "num_drafts", "sampling") if len({str(e.get(k)) for e in ours}) > 1]
    lengths = len({e.get("max_tokens") for e in ours}) > 1  # a column of its own, which a peer's row matches too

    def cell_of(e: dict[str, Any]) -> tuple:
        return (*([e.get("max_tokens")] if lengths else []), e["batch_size"], _temperature_label(e["temperature"]))

    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for e in ours:
        cells.setdefault((*(str(e.get(k)) for k in varying), *cell_of(e)), {})[e["mode"]] = e
    for e in results:  # a peer (its own runtime) joins every row of its length, batch size and temperature
        if e["mode"] in PEER_MODES:
            cell = cell_of(e)
            for row in [r for k, r in cells.items() if k[-len(cell) :] == cell] or [cells.setdefault(("–",) * len(varying) + cell, {})]:
                row[e["mode"]] = e
    has_auto = any(base_mode(m) == "auto" for m in modes)
    head = [", ".join([*varying, *(["tokens"] if lengths else []), "batch", "T"]), *modes] + (["auto / best fixed", "auto / AR", "auto chose"] if has_auto else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in cells.items():
        out = [", ".join(str(k) for k in key)] + [f"{row[m]['tokens_per_s']:.1f}" if m in row else "–" for m in modes]
        auto = next((e for m, e in row.items() if base_mode(m) == "auto"), None)
        if has_auto:
            out += _auto_cells(auto)
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def _spread(e: dict[str, Any], name: str) -> str:
    """`` [0.91–1.02]``: the range of auto's ratio over the repeats, when they differ."""
    lo, hi = e.get(f"auto_vs_{name}_min"), e.get(f"auto_vs_{name}_max")
    return f" [{lo:.2f}–{hi:.2f}]" if lo is not None and hi is not None and f"{lo:.2f}" != f"{hi:.2f}" else ""


def _auto_cells(e: dict[str, Any] | None) -> list[str]:
    """``0.98 [0.91–1.02] (sd:6)``, ``1.83``, ``sd 83 %, ssd 13 %, ar 4 %, K 7.1`` for an ``auto`` row (dashes without one)."""
    if e is None:
        return ["–", "–", "–"]
    vs_best = "–" if e["auto_vs_best"] is None else f"{e['auto_vs_best']:.2f}{_spread(e, 'best')} ({e['best_fixed']})"
    vs_ar = "–" if e["auto_vs_ar"] is None else f"{e['auto_vs_ar']:.2f}{_spread(e, 'ar')}"
    chose = [f"{m} {f:.0%}".replace("%", " %") for m, f in _shares(e)]
    if e["mean_k"] is not None:
        chose.append(f"K {e['mean_k']:.1f}")
    return [vs_best, vs_ar, ", ".join(chose) or "–"]
