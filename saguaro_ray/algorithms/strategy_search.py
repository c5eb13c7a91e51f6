"""``auto``'s round-time model and the search over it: what a round of a given assignment of
modes and K to the batch's groups is predicted to emit and take, and the assignment that
maximises the ratio (``docs/auto.md``: the model term by term, and the search).

The search linearises exactly the round-time model it evaluates, so the two live here together;
the fitted coefficients they read come from :class:`~saguaro_ray.algorithms.strategy_model.AutoPolicy`
(its estimators: :mod:`~saguaro_ray.algorithms.strategy_fits`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from saguaro_ray.algorithms.strategy_fits import ALPHA_MAX

_SEQUENTIAL = ("sd", "pyramid")  # modes drafted step by step before verification
SWITCH_HORIZON = 16  # rounds a choice is expected to hold: the SSD switch cost is spread over them
_DINKELBACH_ITERS = 4


def expected_tokens(alphas: Sequence[float], scale: float, k_max: int) -> list[float]:
    """E[emitted] for K = 0..k_max speculated: 1 + Σ_{i≤K} Π_{j≤i} α_j (α_j scaled, capped)."""
    out = [1.0]
    run = 1.0
    for j in range(k_max):
        run *= min(ALPHA_MAX, alphas[j] * scale)
        out.append(out[-1] + run)
    return out


class Load:
    """A round's totals as the cost model sees them: the fixed sequences' part, then a candidate's."""

    __slots__ = (
        "n", "tokens", "e", "n_sd", "steps", "n_ssd", "ssd_k", "build_k", "log_hit", "miss_k", "switch_s", "held", "held_rows", "sd_held",
        "ssd_held",
    )

    def __init__(self) -> None:
        self.n = 0
        self.tokens = 0
        self.e = 0.0  # expected emitted tokens (switch costs included)
        self.n_sd = 0
        self.steps = 0  # the SD group's largest K: its sequential draft steps
        self.n_ssd = 0
        self.ssd_k = 0  # the SSD group's largest K: a neural backup's sequential steps
        self.build_k = 0  # the largest K the round's SSD build is for (steady: ssd_k)
        self.log_hit = 0.0  # log P(every SSD sequence hits)
        self.miss_k = 0.0  # expected Σ K over the SSD sequences that miss
        self.switch_s = 0.0  # seconds of switch costs (SSD entries and rebuilds), amortised: the search's, not the round's
        self.held = 0.0  # tokens the sequences hold (Held: what each attends)
        self.held_rows = 0.0  # Σ (K + 1)·held over the verification's rows
        self.sd_held = 0.0  # ... held by the SD sequences (a draft step's rows)
        self.ssd_held = 0.0  # ... and by the SSD ones (a tree step's)

    def add(
        self, count: int, mode: str, k: int, e: float, hit: float, switch_s: float = 0.0, build_k: int = 0, held: float = 0.0
    ) -> None:
        """``count`` sequences verifying ``k`` tokens in ``mode``, holding ``held`` tokens between
        them; an SSD sequence's build is for ``build_k`` (0: ``k``, as in a steady round)."""
        self.n += count
        self.switch_s += count * switch_s
        self.tokens += count * (k + 1)
        self.held += held
        self.held_rows += held * (k + 1)
        self.e += count * e
        if mode in _SEQUENTIAL:
            self.n_sd += count
            self.sd_held += held
            if k > self.steps:
                self.steps = k
        elif mode == "ssd":
            self.n_ssd += count
            self.ssd_held += held
            if k > self.ssd_k:
                self.ssd_k = k
            if (build_k or k) > self.build_k:
                self.build_k = build_k or k
            self.log_hit += count * math.log(min(max(hit, 1e-9), 1.0 - 1e-9))
            self.miss_k += count * (1.0 - hit) * k

    def copy(self) -> "Load":
        out = Load.__new__(Load)
        for name in Load.__slots__:
            setattr(out, name, getattr(self, name))
        return out


class Held(NamedTuple):
    """What the tokens a sequence holds cost the calls that attend them, in seconds per token
    held: a verification's per sequence and per verified token, a draft step's per sequence
    (a tree step is a draft step over the sequence's branches, which share what it holds).
    Measured by the start-up probe at two contexts
    (:func:`~saguaro_ray.algorithms.strategy_fits.held_costs`): SmolLM2 at batch 8 on 2 cores,
    16 -> 512 tokens held, a decode 64 -> 114 ms, a verification of 9 tokens each 316 -> 416 ms,
    a draft step 57 -> 80 ms."""

    verify_seq: float = 0.0
    verify_token: float = 0.0
    step: float = 0.0

    def verify(self, held: float, held_rows: float) -> float:
        """A verification's part for sequences holding ``held`` tokens between them, its rows
        ``held_rows`` = Σ (K + 1)·held."""
        return self.verify_seq * held + self.verify_token * held_rows


@dataclass
class Costs:
    """The fitted coefficients one choice is made with (plain floats, read once per round)."""

    ver: tuple[float, float, float, int, float]  # a, per token past the knee, per sequence, the knee, with SSD (KneeFit)
    draft: tuple[float, float, float]  # a (per round), per step, per step and sequence
    build: tuple[float, float, float, float]  # the build's end after verification's start: a, per SSD sequence, per K, per K and sequence
    after: tuple[float, float, float, float]  # lookup and backups: a, per SSD sequence, per backup step when any misses, per missed K
    # a, per sequence of each kind (plain, drafting, SSD), with drafting, per draft step, with SSD
    ctl: tuple[float, float, float, float, float, float, float]
    # recent steady SSD rounds' measured build end and verification, each over what these
    # coefficients predict for its load: the spread the build's overrun is priced over (empty: none yet)
    spread: tuple[tuple[float, float], ...] = ()
    held: Held = Held()  # what the tokens the sequences hold cost the calls that attend them

    def build_s(self, n_ssd: int, k: int, held: float = 0.0) -> float:
        """The SSD build over ``n_ssd`` sequences holding ``held`` tokens between them, at K = ``k``:
        when it ends, from verification's start."""
        b = self.build
        return b[0] + b[1] * n_ssd + k * (b[2] + b[3] * n_ssd + self.held.step * held)

    def verify_s(self, tokens: float, n: float, ssd: bool, held: float = 0.0, held_rows: float = 0.0) -> float:
        """A verification of ``tokens`` tokens over ``n`` sequences holding ``held`` tokens between
        them (``held_rows``: Σ (K + 1)·held; ``ssd``: a build runs beside it)."""
        v = self.ver
        return max(0.0, v[0] + v[1] * max(0.0, tokens - v[3]) + v[2] * n + (v[4] if ssd else 0.0) + self.held.verify(held, held_rows))

    def overrun(self, build: float, verify: float) -> float:
        """The build's expected time past the verification's end, E[max(0, B − V)].

        Taken over the recent rounds' measured spread, not at the means: on the
        coder pair at batch 1 the verifications were bimodal (a quarter 500-670 ms
        against 280-390), so a build whose mean ended well inside the mean
        verification still overran the fast ones — 23 ms a round at K = 4, 45-57 at
        K = 5, where max(0, mean B − mean V) gave 0 and 0-13; the mean of a maximum
        grows with K where the maximum at the means stays 0, and a K that costs
        88 ms more looked one verified token (21 ms) dearer. Each pair scales the
        predicted B and V as one round's measurement did, so a slow spell that
        slows both moves them together, and a fit whose level is off for these
        rounds is corrected in the overrun it prices."""
        if not self.spread:
            return max(0.0, build - verify)
        return sum(max(0.0, build * rb - verify * rv) for rb, rv in self.spread) / len(self.spread)

    def round_time(self, load: Load) -> float:
        sequential = bool(load.n_sd and load.steps)
        c = self.ctl
        ctl = c[0] + c[1] * (load.n - load.n_sd - load.n_ssd) + c[2] * load.n_sd + c[3] * load.n_ssd
        ctl += (c[4] + c[5] * load.steps if sequential else 0.0) + (c[6] if load.n_ssd else 0.0)
        verify = self.verify_s(load.tokens, load.n, load.n_ssd > 0, load.held, load.held_rows)
        t = max(0.0, ctl) + verify
        if sequential:
            d = self.draft
            t += max(0.0, d[0] + load.steps * (d[1] + d[2] * load.n_sd + self.held.step * load.sd_held))
        if load.n_ssd:
            a = self.after
            t += self.overrun(self.build_s(load.n_ssd, load.build_k, load.ssd_held), verify)
            p_any = 1.0 - math.exp(load.log_hit)
            t += max(0.0, a[0] + a[1] * load.n_ssd + a[2] * load.ssd_k * p_any + a[3] * load.miss_k)
        return t


class Group:
    """Sequences the model cannot tell apart: one choice for all of them."""

    __slots__ = (
        "bucket", "scale", "cap", "modes", "in_ssd", "ssd_k", "verify_k", "lagging", "members", "seq_ids", "hit", "hit_pooled",
        "e_sd", "e_ssd", "entry", "leave", "rebuild_s", "raise_s", "leave_s", "unseen", "catch_up_s", "held", "opt",
    )

    def __init__(
        self, bucket: int, scale: float, cap: int, modes: frozenset[str], in_ssd: bool, ssd_k: int = 0, lagging: bool = False,
        verify_k: int = 0,
    ) -> None:
        self.bucket = bucket
        self.scale = scale  # the members' own acceptance relative to their bucket's
        self.cap = cap
        self.modes = modes
        self.in_ssd = in_ssd
        self.ssd_k = ssd_k  # in SSD: the K of its build in flight (a leave waits for it, a return rebuilds at it)
        # in SSD: the K this round verifies if it stays, whatever K it chooses (the plans of the two
        # rounds before fixed it: a K chosen is verified two rounds on if raised, one if lowered)
        self.verify_k = min(verify_k or ssd_k, cap)
        self.lagging = lagging  # its drafts must catch up before it speculates (one more AR round)
        self.hit: list[float] = [0.0] * (cap + 1)  # SSD's hit rate by K
        self.hit_pooled = 0.0  # over every K: what the search linearises P(all hit) with
        self.members: list[int] = []  # indices into the round's auto sequences
        self.seq_ids: list[int] = []
        self.e_sd: list[float] = [1.0]  # expected tokens by K (index 0: AR), switch cost included
        self.e_ssd: list[float] = [1.0]
        self.entry: list[float] = [0.0]  # tokens an SSD entry's forced miss costs, by K
        self.leave = 0.0  # a sequence in SSD choosing AR or SD pays this (the hysteresis band)
        # seconds per member of a round that enters SSD at K (no build made ahead for it)
        self.rebuild_s: list[float] = [0.0] * (cap + 1)
        # in SSD, seconds per member of the round after one that raises K above ssd_k: it builds at
        # the new K beside a verification of the old one (the build's longer overrun, not hidden)
        self.raise_s: list[float] = [0.0] * (cap + 1)
        self.leave_s = 0.0  # seconds per member of a round that leaves SSD for SD (the build in flight)
        self.unseen = 0  # lagging: the tokens its members' drafts are to be sent (the catch-up)
        self.catch_up_s = 0.0  # seconds per member that the catch-up a switch into speculation sends costs
        self.held = 0  # the tokens its members hold between them
        self.opt: tuple[str, int] = ("ar", 0)

    def price_switches(self, costs: Costs, n: int, rebuild: float, leave: float, catch_up: float = 0.0, held: float = 0.0) -> None:
        """What switching costs this group, per member, in a round of ``n`` auto sequences
        holding ``held`` tokens between them (``rebuild``, ``leave``: what such rounds took beyond
        a steady one, in predicted builds; ``catch_up``: what a catch-up slows the rounds beside
        it by, per token sent).

        A rebuild's fixed part is shared by every sequence that rebuilds in the round: per
        member, the batch's (charged to a group alone, it kept small groups out of SSD); so is
        the wait for the build in flight when the group leaves SSD for SD, and a raise of K in
        SSD: the next round builds at the new K beside a verification of the old one (SmolLM2
        at batch 8, K 1 -> 5: that round took 573 ms where its neighbours took 200)."""
        self.catch_up_s = catch_up * self.unseen / len(self.members) if self.members else 0.0
        self.rebuild_s = [0.0] + [rebuild * costs.build_s(n, k, held) / n for k in range(1, self.cap + 1)]
        self.leave_s = leave * costs.build_s(n, self.ssd_k, held) / n if self.in_ssd and self.ssd_k else 0.0
        self.raise_s = [0.0] * (self.cap + 1)
        if self.in_ssd and self.ssd_k:
            verify = costs.verify_s(n * (self.ssd_k + 1), n, True, held, held * (self.ssd_k + 1))
            now = costs.overrun(costs.build_s(n, self.ssd_k, held), verify)
            for k in range(self.ssd_k + 1, self.cap + 1):
                self.raise_s[k] = max(0.0, costs.overrun(costs.build_s(n, k, held), verify) - now) / n

    def value(self, opt: tuple[str, int]) -> float:
        mode, k = opt
        if mode == "ssd":
            return self.e_ssd[k]
        return (self.e_sd[k] if mode == "sd" else 1.0) - self.leave

    def switch_s(self, opt: tuple[str, int]) -> float:
        """Seconds per member that choosing ``opt`` costs in switching, amortised over
        :data:`SWITCH_HORIZON` rounds: entering SSD (the build starts afresh, after
        any stale one: the round's time, not only its forced miss), or leaving it
        (coming back pays the entry again; for SD, its drafts first wait for the
        build in flight). Another K in SSD rebuilds nothing: the engine verifies
        what the build made ahead assumed and puts the new K in the next round's
        plan; a raised K is verified two rounds on, and the round between builds
        at it beside a verification of the old K (:attr:`raise_s`). A lowered K is
        free: the next round's verification clips to it. Speculation after AR rounds
        first sends the drafts what they missed (:attr:`catch_up_s`): on a shared
        machine that work slows the rounds beside it, and it grows with the AR rounds
        (8 sequences 100 tokens behind: ~800 tokens through the draft)."""
        mode, k = opt
        catch_up = self.catch_up_s if mode != "ar" else 0.0
        if mode == "ssd":
            return ((self.raise_s[k] if self.in_ssd else self.rebuild_s[k]) + catch_up) / SWITCH_HORIZON
        if not self.in_ssd:
            return catch_up / SWITCH_HORIZON
        return (self.rebuild_s[min(self.ssd_k, self.cap)] + (self.leave_s if mode == "sd" else 0.0)) / SWITCH_HORIZON

    def excursion(self, opt: tuple[str, int]) -> tuple[float, float]:
        """Tokens and seconds per member that trying ``opt`` for one round costs
        beyond :meth:`value`'s and :meth:`switch_s`'s amortised switch: an entry into
        SSD, or the re-entry after a round out of it, is paid in full; a lagging
        sequence's speculation waits a round for its drafts."""
        full = SWITCH_HORIZON - 1.0
        tokens = max(0.0, self.value(opt) - 1.0) if self.lagging and opt[0] != "ar" else 0.0
        if opt[0] == "ssd" and not self.in_ssd:
            tokens += self.entry[opt[1]] * (1.0 - 1.0 / SWITCH_HORIZON)
        elif opt[0] != "ssd" and self.in_ssd:
            tokens += self.leave * full
        return tokens, self.switch_s(opt) * full


def option(groups: list[Group], opts: list[tuple[str, int]], base: Load, costs: Costs) -> dict[str, Any]:
    """One option's prediction for the round about to run: its label (``sd:4``; ``ar+ssd:4``
    when groups differ), expected emitted tokens of the batch, predicted round seconds
    (no amortised switch) and the verification's part of them (``verify``: the timeline
    tells a misprediction of the target's call from one of drafting and control). A group
    that stays in SSD verifies and builds what its earlier plans fixed
    (:attr:`Group.verify_k`, :attr:`Group.ssd_k`), not the K it chooses now: that K is what
    the search values, for the rounds it will run in."""
    load = _load_of(groups, opts, base, as_run=True)
    label = "+".join(sorted({"ar" if m == "ar" else f"{m}:{k}" for m, k in opts}))
    verify = costs.verify_s(load.tokens, load.n, load.n_ssd > 0, load.held, load.held_rows)
    return {"option": label, "tokens": load.e, "seconds": costs.round_time(load), "verify": verify}


def predict(groups: list[Group], base: Load, costs: Costs) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the search's choice (every group's ``opt``) is predicted to do, and the
    runner-up: the best option of another mode for every auto sequence (AR; SD or
    SSD at one K, capped per group) — the option a misprediction would have
    preferred; and the AR option (what the AR guard switches to)."""
    chosen = option(groups, [g.opt for g in groups], base, costs)
    best: dict[str, dict[str, Any]] = {}
    ar = best["ar"] = option(groups, [("ar", 0)] * len(groups), base, costs)
    for mode in ("sd", "ssd"):
        cap = max((g.cap for g in groups if mode in g.modes), default=0)
        for k in range(1, cap + 1):
            opts = [(mode, min(k, g.cap)) if mode in g.modes and g.cap >= 1 else ("ar", 0) for g in groups]
            o = option(groups, opts, base, costs)
            if mode not in best or _rate(o) > _rate(best[mode]):
                best[mode] = o
    modes = {m for m, _ in (g.opt for g in groups)}
    others = [o for m, o in best.items() if modes != {m}]
    runner_up = max(others, key=_rate) if others else None
    return {"chosen": chosen, "runner_up": runner_up}, ar


def evaluate(
    groups: list[Group], opts: list[tuple[str, int]], base: Load, costs: Costs, extra: tuple[float, float] = (0.0, 0.0)
) -> tuple[float, float]:
    """(expected tokens per second, P(every SSD sequence hits)) of the round if group i
    runs opts[i] (``extra``: tokens and seconds to add, e.g. an excursion's cost)."""
    e, t, hit = round_of(groups, opts, base, costs, extra)
    return (e / t if t > 0 else math.inf), hit


def round_of(
    groups: list[Group], opts: list[tuple[str, int]], base: Load, costs: Costs, extra: tuple[float, float] = (0.0, 0.0)
) -> tuple[float, float, float]:
    """(expected tokens, predicted seconds with the amortised switch costs, P(every SSD
    sequence hits)) of that round."""
    load = _load_of(groups, opts, base)
    load.e += extra[0]
    return load.e, costs.round_time(load) + load.switch_s + extra[1], math.exp(load.log_hit)


def _load_of(groups: list[Group], opts: list[tuple[str, int]], base: Load, as_run: bool = False) -> Load:
    """``base`` with group i running ``opts[i]`` (its amortised switch in ``switch_s``, which
    :meth:`Costs.round_time` leaves out). ``as_run``: a group that stays in SSD verifies
    :attr:`Group.verify_k` and builds :attr:`Group.ssd_k` (:func:`option`), where the search
    values the K chosen as if it already ran."""
    load = base.copy()
    for g, opt in zip(groups, opts):
        mode, k = opt
        if as_run and mode == "ssd" and g.in_ssd and g.verify_k:
            v = g.verify_k
            load.add(len(g.members), mode, v, g.e_ssd[v], g.hit[v], g.switch_s(opt), min(g.ssd_k, g.cap), g.held)
        else:
            load.add(len(g.members), mode, k, g.value(opt), g.hit[k], g.switch_s(opt), held=g.held)
    return load


def optimise(groups: list[Group], base: Load, costs: Costs, last_rate: float) -> float:
    """Sets every group's ``opt``; returns the predicted tokens per second.

    A configuration is the SD group's step count S and the SSD group's
    largest K, Q. For one, every group's best choice separates once the
    ratio is linearised at λ (and P(all SSD sequences hit) at the
    incumbent's): N − λ·T. Each candidate is then evaluated exactly; S and
    Q are swept in turn from the incumbent's, λ ← the best ratio, until the
    incumbent stands (Dinkelbach). Each sweep also tries the other mode
    off: a step count held fixed would hide its own fixed cost. λ starts
    at ``last_rate`` (the last search's ratio), where it usually already is."""
    # verification is flat up to its knee and linear past it: the picks are linearised with the
    # slope past it and, where the batch in AR leaves a flat part, with none (tokens under the
    # knee are free)
    ar_tokens = base.tokens + sum(len(g.members) for g in groups)
    slopes = (costs.ver[1], 0.0) if costs.ver[3] > ar_tokens and costs.ver[1] > 0 else (costs.ver[1],)
    # the build's overrun, max(0, B − V), has no slope to linearise by: picks leave it out
    # and every Q of the sweep is evaluated exactly (with it)
    s_max = max([g.cap for g in groups if "sd" in g.modes] + [base.steps])
    q_max = max([g.cap for g in groups if "ssd" in g.modes] + [base.ssd_k])
    s_values = ([0] if not base.steps else []) + list(range(max(1, base.steps), s_max + 1))
    q_values = ([0] if not base.ssd_k else []) + list(range(max(1, base.ssd_k), q_max + 1))
    best_opts: list[tuple[str, int]] = [("ar", 0)] * len(groups)
    best, all_hit = evaluate(groups, best_opts, base, costs)
    config = (s_values[0], q_values[0])
    lam = max(best, last_rate)
    seen: set[tuple[tuple[str, int], ...]] = set()
    # P(some SSD sequence misses) is not additive: a group is charged its share of it either
    # as the one that joins the incumbent's SSD sequences (dear) or as one of every group
    # that may run SSD (cheap); both kinds of candidate are generated and evaluated exactly
    weights = [len(g.members) * -math.log(min(max(g.hit_pooled, 1e-9), 1.0 - 1e-9)) if "ssd" in g.modes else 0.0 for g in groups]
    total_weight = sum(weights)
    p_all = 1.0 - math.exp(base.log_hit - total_weight)
    for it in range(_DINKELBACH_ITERS):
        # the flat part's candidates once, from the first λ: later iterations refine the incumbent
        used = slopes if it == 0 else slopes[:1]
        per_slope = {b_tok: linearised(groups, best_opts, weights, lam, b_tok, costs, all_hit, p_all) for b_tok in used}

        def picks(s: int, q: int, share: int, per_group: list[tuple[float, list, list, tuple[float, float], float]]) -> list[tuple[str, int]]:
            opts = []
            for ar_val, sd_pref, ssd_pref, any_costs, d_step in per_group:
                any_cost = any_costs[share]
                v, pick = ar_val, ("ar", 0)
                if s and sd_pref:
                    sv, k = sd_pref[min(s, len(sd_pref)) - 1]
                    if sv - lam * s * d_step > v:
                        v, pick = sv - lam * s * d_step, ("sd", k)
                if q and ssd_pref:
                    qv, k = ssd_pref[min(q, len(ssd_pref)) - 1]
                    if qv - q * any_cost > v:
                        pick = ("ssd", k)
                opts.append(pick)
            return opts

        incumbent = best_opts
        for sweep in range(2):  # S with Q held or off, then Q with S held or off
            s_off, q_off = s_values[0], q_values[0]
            if sweep == 0:
                configs = [(v, q) for v in s_values for q in dict.fromkeys((config[1], q_off))]
            else:
                configs = [(s, v) for v in q_values for s in dict.fromkeys((config[0], s_off))]
            for (s, q), share, per_group in itertools.product(configs, (0, 1), per_slope.values()):
                opts = picks(s, q, share, per_group)
                key = tuple(opts)
                if key in seen:
                    continue  # configurations that lead to the same choices: evaluated once
                seen.add(key)
                r, hit = evaluate(groups, opts, base, costs)
                if r > best * (1.0 + 1e-12):
                    best, best_opts, all_hit, config = r, opts, hit, (s, q)
        if best_opts is incumbent and lam == best:
            break  # λ is the incumbent's own ratio and nothing beats it
        lam = best
        seen.clear()  # λ moved: the same choices may now come from other configurations
    for g, o in zip(groups, best_opts):
        g.opt = o
    return best


def linearised(
    groups: list[Group], incumbent: list[tuple[str, int]], weights: list[float], lam: float, b_tok: float, costs: Costs,
    all_hit: float, p_all: float,
) -> list[tuple[float, list[tuple[float, int]], list[tuple[float, int]], tuple[float, float], float]]:
    """Per group, N − λ·T linearised with ``b_tok`` a token (and what its row attends): AR's
    value, SD's and SSD's best value up to each K, SSD's share of P(some sequence misses)
    (dear, cheap) and a draft step's cost per member: see :func:`optimise`."""
    _, e_seq, e_any, e_miss = costs.after
    total_weight = sum(weights)
    per_group = []
    for g, inc, w in zip(groups, incumbent, weights):
        c = len(g.members)
        token = b_tok + costs.held.verify_token * g.held / c
        d_step = costs.draft[2] + costs.held.step * g.held / c
        leave_s, sd_s = g.switch_s(("ar", 0)), g.switch_s(("sd", 1))
        sd = [g.e_sd[k] - g.leave - lam * (token * (k + 1) + sd_s) for k in range(1, g.cap + 1)] if "sd" in g.modes else []
        ssd = (
            [g.e_ssd[k] - lam * (token * (k + 1) + e_seq + e_miss * (1.0 - g.hit[k]) * k + g.switch_s(("ssd", k))) for k in range(1, g.cap + 1)]
            if "ssd" in g.modes
            else []
        )
        joined = (g.hit[inc[1]] if inc[0] == "ssd" else g.hit_pooled) ** c
        others = all_hit / joined if inc[0] == "ssd" and joined > 0 else all_hit
        dear = lam * e_any * others * (1.0 - joined) / c
        cheap = lam * e_any * p_all * w / total_weight / c if w else dear
        per_group.append((g.value(("ar", 0)) - lam * (token + leave_s), _prefix_best(sd), _prefix_best(ssd), (dear, cheap), d_step))
    return per_group


def fill_values(
    g: Group, alphas: list[float], miss: list[float], hit_rates: Callable[[Sequence[float]], list[float]], pooled: float
) -> None:
    """A group's expected tokens by mode and K under these acceptance rates and
    hit rates (``hit_rates``: by K, from P(all K accepted) by K; ``pooled``: over every K)."""
    e_draft = expected_tokens(alphas, g.scale, g.cap)
    hits = hit_rates(all_accepted(e_draft))
    g.hit, g.hit_pooled = hits, pooled
    if g.cap == 0:
        return
    # a lagging group's speculation waits a round for its drafts: that round's gain, amortised
    lag = (lambda e: [x - (x - 1.0) / SWITCH_HORIZON for x in e]) if g.lagging else (lambda e: e)  # noqa: E731
    if "sd" in g.modes:
        g.e_sd = lag(e_draft)
    if "ssd" in g.modes:
        e_miss = expected_tokens(miss, 1.0, g.cap)
        g.entry = [h * max(0.0, d - m) for h, d, m in zip(hits, e_draft, e_miss)]
        switch = [x / SWITCH_HORIZON for x in g.entry]
        e_ssd = [h * d + (1.0 - h) * m for h, d, m in zip(hits, e_draft, e_miss)]
        g.e_ssd = lag(e_ssd if g.in_ssd else [e - s for e, s in zip(e_ssd, switch)])
        g.leave = max(switch) if g.in_ssd else 0.0


def all_accepted(expected: list[float]) -> list[float]:
    """P(all K accepted) for K = 0.. from :func:`expected_tokens`'s output (its increments)."""
    return [1.0] + [b - a for a, b in zip(expected, expected[1:])]


def _rate(option: dict[str, Any]) -> float:
    """An option's predicted tokens per second."""
    return option["tokens"] / option["seconds"] if option["seconds"] > 0 else math.inf


def _prefix_best(values: list[float]) -> list[tuple[float, int]]:
    """For each K = 1..len: the best (value, k) with k <= K (values[k-1] is K = k's)."""
    out: list[tuple[float, int]] = []
    for k, v in enumerate(values, start=1):
        out.append((v, k) if not out or v > out[-1][0] else out[-1])
    return out
