"""Draft-worker logic: proposes speculations and pre-computes the next round's.

Three jobs, all batched over sequences:

* :meth:`DraftLogic.propose` — K sequential draft steps from where a sequence
  stands (ordinary SD drafting, and the *neural* backup on an SSD miss).
* :meth:`DraftLogic.build` — SSD's cache construction while the target
  verifies: one glue forward along the speculation being verified gives the
  draft's rows 0..K; for every k the top-F_k tokens of row k (excluding the
  drafted s_{k+1}, which cannot be the recovery token) start a branch; all
  branches of all sequences decode together as one shared-prefix tree decode,
  branch (k, t) attending to the sequence's cached prefix up to
  ``start + 1 + k`` plus its own tokens. Results go to the speculation cache
  keyed (sequence, k, t).
* :meth:`DraftLogic.lookup` — after verification, return the cached
  speculation for the real outcome, or ``None`` (a miss).

The only draft knows the next proposal the moment its lookup has served it
(a hit, or the backup it made for a miss), so with the lookup's
:class:`NextRound` plans it starts the next round's build itself once the
lookup is answered (:meth:`DraftLogic.follow_up`), instead of waiting for the
build call to come back through the coordinator; the build call is then
answered from it when it asks for the same items.

Every sampled token records the exact law it was drawn from (Saguaro-rescaled
when C < 1). Random draws come from the draft stream of (seed, output
position), so a hit and a neural backup propose the same tokens for the same
outcome.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from saguaro_ray.algorithms.cache import SpeculationCache, Speculation
from saguaro_ray.algorithms.saguaro_sampling import saguaro_rescale
from saguaro_ray.algorithms.sampling import STREAM_DRAFT, argmax_lowest, position_uniforms, process_logits, sample_from
from saguaro_ray.config import SamplingParams
from saguaro_ray.algorithms.fanout import deal_candidates
from saguaro_ray.algorithms.ngram import ngram_guess
from saguaro_ray.algorithms.ranking import RowOrder, RowSource, ranks, top_order, top_tokens
from saguaro_ray.workers.messages import RECENT_TOKENS, BuildItem, Extension, LookupResult, NextRound, Plan, Proposal, SeqStep, Timed, plan_for
from saguaro_ray.workers.runner import ModelRunner, TreeState
from saguaro_ray.workers.target import RunnerLogic, feed

log = logging.getLogger(__name__)


def _draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    fanouts: Sequence[int] | None,
    saguaro_c: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row; returns (tokens, q rows or None when all greedy).

    Greedy rows propose the argmax — a point mass, so callers keep no q row for
    them (their returned row is one-hot in a mixed batch). Stochastic rows draw
    from the processed draft law, Saguaro-rescaled with the row's fan-out."""
    greedy = [p.greedy for p in params]
    if all(greedy):
        return argmax_lowest(logits), None
    q = process_logits(logits, [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params])
    if fanouts is not None and saguaro_c < 1.0:
        q = saguaro_rescale(q, torch.tensor(fanouts), saguaro_c)
    u = position_uniforms(seeds, positions, 1, STREAM_DRAFT).squeeze(-1)
    tokens = sample_from(q, u)
    return tokens, q


class DraftLogic(RunnerLogic):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.cache = SpeculationCache()
        # per sequence, per k: the draft's ranking of row k (s_{k+1} excluded)
        self._rankings: dict[int, list[RowOrder]] = {}
        # the latest build's tree and its logits per step ([N, V] each): a hit's
        # rankings are read from them (ranking every branch up front costs more)
        self._tree: TreeState | None = None
        self._tree_logits: list[torch.Tensor] = []
        # per sequence: the KV delta of the hit this draft served (already in its cache)
        self._own: dict[int, Extension] = {}
        self.glue_tokens = 0  # tokens forwarded to build glue rows (recomputation avoided by KV deltas is not counted)
        # the round whose build the cache holds (None: none complete); a lookup names the
        # round it expects, since it may be sent before that round's build is done
        self._round: int | None = None
        self._started: int | None = None  # round id of the latest build begun
        self._items: dict[int, BuildItem] = {}  # that build's item per sequence (a miss's backup starts from it)
        self._history: dict[int, list[int]] = {}  # per sequence: its token ids, as the calls reveal them (fast guesses)
        # the next round's build, known since the latest lookup (to start once it is answered) ...
        self._next: list[BuildItem] | None = None
        # ... and, once run (its items are then ``_items``), its span and result, until the build call comes
        self._ahead: tuple[tuple[float, float], dict[str, object]] | None = None
        # per sequence: the part of its own hit's delta the latest build kept in the KV (a build
        # called with other items than the one started ahead reuses it instead of recomputing)
        self._glued: dict[int, Extension] = {}
        self.ahead_started = 0  # builds started ahead (those no call asked for were wasted work)
        self.ahead_builds = 0  # build calls answered from a build started ahead

    # ------------------------------------------------------------ propose
    def propose(self, steps: Sequence[SeqStep], ks: Sequence[int], saguaro_c: float = 1.0, fanouts: Sequence[Sequence[int]] | None = None) -> list[Proposal]:
        """Draft ``ks[b]`` tokens for each sequence by sequential decoding."""
        self._next = self._ahead = None  # a build started ahead assumed the sequences untouched
        self._record(steps)
        logits = feed(self.runner, steps, [[]] * len(steps), [1] * len(steps))
        tokens: list[list[int]] = [[] for _ in steps]
        qrows: list[list[torch.Tensor]] = [[] for _ in steps]
        active = [i for i, k in enumerate(ks) if k > 0]
        if active:
            logits = logits[torch.tensor(active)]  # from here on, one row per active sequence
        j = 0
        while active:
            fo = None if fanouts is None else [fanouts[i][j] if j < len(fanouts[i]) else 0 for i in active]
            toks, q = _draw(
                logits,
                [steps[i].params for i in active],
                [steps[i].seed for i in active],
                [steps[i].output_pos + j for i in active],
                fo,
                saguaro_c,
            )
            for r, i in enumerate(active):
                tokens[i].append(int(toks[r]))
                if q is not None and not steps[i].params.greedy:  # greedy proposals are point masses
                    qrows[i].append(q[r])
            j += 1
            active = [i for i in active if len(tokens[i]) < ks[i]]
            if active:
                logits = self.runner.forward([steps[i].seq_id for i in active], [[tokens[i][-1]] for i in active])
        return [Proposal(t, torch.stack(q) if q else None, "draft") for t, q in zip(tokens, qrows)]

    # -------------------------------------------------------------- build
    def _glue_plan(self, it: BuildItem) -> tuple[SeqStep | None, list[RowSource]]:
        """How to get the glue rows (the draft's law after each token of
        ``new_tokens + proposal``) for one item: rows already known from a KV
        delta (this draft's own hit, or a peer's ``it.extension``), and the
        step that forwards the rest (None when nothing is left to forward)."""
        st, seq = it.step, it.step.seq_id
        glue = list(st.new_tokens) + list(it.proposal.tokens)
        own = self._own.pop(seq, None)
        ext = own or it.extension
        usable = (
            ext is not None
            and ext.seq_id == seq
            and ext.start == st.start
            and len(st.new_tokens) == 1
            and self.runner.has_sequence(seq)
            and ext.start <= self.runner.seq_len(seq)
        )
        if usable and ext is it.extension:  # a peer's delta: append it in place of the stale glue
            if ext.kv is None:
                usable = False
            else:
                self.runner.truncate(seq, ext.start)
                self.runner.append_kv(seq, ext.kv)
        m = 0
        if usable and self.runner.seq_len(seq) >= ext.start + len(ext.tokens):
            while m < min(len(glue), len(ext.tokens)) and glue[m] == ext.tokens[m]:
                m += 1
        n_rows = len(it.proposal.tokens) + 1
        if m == 0:
            return replace(st, new_tokens=glue), []
        known = ext.rankings[: min(m, n_rows)]
        self.runner.truncate(seq, ext.start + m)
        if own is not None:  # the KV now holds its first m tokens: what a later build of this round may reuse
            self._glued[seq] = replace(own, tokens=own.tokens[:m], rankings=own.rankings[:m])
        if m == len(glue):
            return None, known
        return SeqStep(seq, ext.start + m, glue[m:], st.params, st.seed, st.output_pos, []), known

    def build(self, items: Sequence[BuildItem], round_id: int | None = None) -> dict[str, object] | Timed:
        """Pre-compute next round's speculation for the likely outcomes (SSD).
        ``round_id`` names the round for :meth:`lookup`'s check.

        When this draft already ran the build for these very items (started
        ahead, see :meth:`follow_up`) — field by field the same, for every
        sequence still running — that build is the answer: its result with
        ``"ahead": True``, as a :class:`Timed` of the span it really ran (the
        worker reports that span for the call); anything else (a sequence
        admitted, a fan-out or step that differs) is built now."""
        ahead, self._ahead, self._next = self._ahead, None, None
        if ahead is not None and items and all(self._items.get(it.step.seq_id) == it for it in items):
            self._started = round_id if round_id is not None else self._started
            self._round = round_id
            self.ahead_builds += 1
            return Timed({**ahead[1], "ahead": True}, *ahead[0])
        if ahead is not None:  # built for nothing: the hits' deltas it consumed are still in the KV
            self._own.update(self._glued)
        return self._build(items, round_id)

    def follow_up(self) -> Callable[[], None] | None:
        """Work for the worker to run once the call just served has been
        answered: the next round's build, when the latest lookup made it known
        (every sequence's next proposal is here and the lookup brought its
        :class:`NextRound`). None: nothing to do."""
        return self._build_ahead if self._next is not None else None

    def _build_ahead(self) -> None:
        items, self._next = self._next, None
        if not items:
            return
        start = time.perf_counter()
        self.ahead_started += 1
        try:
            got = self._build(items, None)
        except Exception as e:  # the build call will run it again and report what is wrong
            log.debug("a build started ahead failed: %s", e)
            self._tree, self._tree_logits = None, []
            self._own.update(self._glued)
            return
        self._ahead = ((start, time.perf_counter()), got)

    def _build(self, items: Sequence[BuildItem], round_id: int | None) -> dict[str, object]:
        self._round = None  # until this build is complete
        self._glued = {}
        self._record([it.step for it in items])
        self._started = round_id if round_id is not None else self._started
        self._items = {it.step.seq_id: it for it in items}
        plans = [self._glue_plan(it) for it in items]
        fwd = [(i, st) for i, (st, _) in enumerate(plans) if st is not None]
        n_rows = [len(it.proposal.tokens) + 1 for it in items]
        rows: list[list[RowSource]] = [list(known) for _, known in plans]
        if fwd:
            want = [min(len(st.new_tokens), n_rows[i]) for i, st in fwd]
            self.glue_tokens += sum(len(st.new_tokens) for _, st in fwd)
            glue = feed(self.runner, [st for _, st in fwd], [[]] * len(fwd), want)
            offset = 0
            for (i, _), w in zip(fwd, want):
                rows[i].extend(glue[offset : offset + w].unbind(0))
                offset += w
        # -- choose branches: (sequence index, k, first token) — candidate (k, j)
        # is the j-th token of row k, the drafted s_{k+1} left out
        picks: list[tuple[int, int, int]] = []
        for i, it in enumerate(items):
            toks = it.proposal.tokens
            ranking = [RowOrder(row, toks[k] if k < len(toks) else None) for k, row in enumerate(rows[i])]
            self._rankings[it.step.seq_id] = ranking
            self.cache.put_round(it.step.seq_id, {})
            if it.k_next > 0:
                picks.extend((i, k, j) for k, j in deal_candidates(it.fanout, n_rows[i], it.shard, it.num_shards))
        # every row of the fan-out is read as deep as its F_k (not just this shard's
        # picks): every draft makes the same topk call, so the shares stay disjoint
        wanted = [(i, k) for i, it in enumerate(items) if it.k_next > 0 for k in range(n_rows[i]) if k < len(it.fanout) and it.fanout[k] > 0]
        tops = dict(zip(wanted, top_tokens([self._rankings[items[i].step.seq_id][k] for i, k in wanted], [items[i].fanout[k] for i, k in wanted])))
        branches = [(i, k, tops[i, k][j]) for i, k, j in picks if j < len(tops[i, k])]
        self._tree, self._tree_logits = None, []
        if not branches:
            self._round = round_id
            return {"branches": 0}
        # -- one batched shared-prefix tree decode over all branches
        depth = max(items[i].k_next for i, _, _ in branches)
        tree = self.runner.tree_start(
            [items[i].step.seq_id for i, _, _ in branches],
            [items[i].step.start + len(items[i].step.new_tokens) + k for i, k, _ in branches],
            depth=depth,
        )
        # per-branch facts, gathered once (the step loop stays free of Python per branch)
        n = len(branches)
        b_item = [items[i] for i, _, _ in branches]
        b_len = [it.k_next for it in b_item]
        b_params = [it.step.params for it in b_item]
        b_seed = [it.step.seed for it in b_item]
        # branch (k, t): t sits at output_pos + k, its j-th successor at output_pos + k + 1 + j
        b_pos = [it.step.output_pos + k + 1 for it, (_, k, _) in zip(b_item, branches)]
        all_greedy = all(p.greedy for p in b_params)
        cur = torch.tensor([[t] for _, _, t in branches])
        steps: list[torch.Tensor] = []  # sampled tokens per step [N] (rows past a branch's length unused)
        step_q: list[tuple[list[int], torch.Tensor] | None] = []  # (live rows, their q rows) per step
        step_logits = []
        for j in range(depth):
            logits = self.runner.tree_forward(tree, cur)[:, 0]
            step_logits.append(logits)
            if all_greedy:  # every proposal is a point mass: no law to keep
                toks = argmax_lowest(logits)
                step_q.append(None)
            else:
                live = [r for r in range(n) if j < b_len[r]]
                toks_live, q = _draw(
                    logits[live] if len(live) < n else logits,
                    [b_params[r] for r in live],
                    [b_seed[r] for r in live],
                    [b_pos[r] + j for r in live],
                    [b_item[r].fanout[j] if j < len(b_item[r].fanout) else 0 for r in live],
                    min(b_item[r].saguaro_c for r in live),
                )
                toks = cur[:, 0].clone()
                toks[torch.tensor(live)] = toks_live
                step_q.append(None if q is None else (live, q))
            steps.append(toks)
            cur = toks.unsqueeze(1)
        tokens = torch.stack(steps, dim=1).tolist()
        q_rows: list[list[torch.Tensor]] = [[] for _ in branches]
        for entry in step_q:
            if entry is not None:
                live, q = entry
                for pos, r in enumerate(live):
                    if not b_params[r].greedy:  # greedy rows are point masses
                        q_rows[r].append(q[pos])
        self._tree, self._tree_logits = tree, step_logits
        per_seq: dict[int, dict[tuple[int, int], Speculation]] = {}
        for r, (i, k, t) in enumerate(branches):
            spec = Speculation(tokens=tokens[r][: b_len[r]], q=torch.stack(q_rows[r]) if q_rows[r] else None, branch=r)
            per_seq.setdefault(items[i].step.seq_id, {})[(k, t)] = spec
        for seq_id, entries in per_seq.items():
            self.cache.put_round(seq_id, entries)
        self._round = round_id
        return {"branches": len(branches)}

    # ------------------------------------------------------------- lookup
    def awaits_build(self, round_id: int | None) -> bool:
        """Is a lookup for ``round_id`` ahead of every build begun here (its
        build is still on the way)? Round ids increase from round to round."""
        return round_id is not None and (self._started is None or self._started < round_id)

    def lookup(
        self,
        keys: Sequence[tuple[int, int, int]],
        share_kv: bool = False,
        round_id: int | None = None,
        plans: Sequence[Plan] | None = None,
    ) -> list[LookupResult]:
        """Serve cached speculations for the real outcomes (seq_id, k, t*).

        Per key: the proposal (None on a miss), the 1-based rank of t* in the
        draft's ranking of row k (None if beyond what was kept) — the
        observation the fan-out estimator fits its power law to — and, on a
        hit, the KV delta: the branch's K/V becomes part of this draft's cache
        at once (so the next build forwards at most one glue token), and with
        ``share_kv`` a copy is returned for peer drafts.

        ``plans[i]`` (the round loop's only draft; :class:`NextRound`, or one
        per outcome — :func:`plan_for`): what the next round verifies and
        builds for key i's sequence. A miss gets
        the plan's backup in this same call, as ``backup`` — the neural one:
        K draft tokens from the real outcome, drawn exactly as :meth:`propose`
        would for the next round's step; the fast one: the n-gram guess from
        the sequence's history (:func:`ngram_guess`) — which saves the round
        loop making it after the answer; and with every next proposal known
        here, the next build starts once this lookup is answered
        (:meth:`follow_up`).

        A ``round_id`` other than the latest complete build's (the lookup
        overtook a re-sent build, or that build failed) gets misses and no
        backups: the cache holds another round's speculations."""
        self._next = None
        if round_id is not None and round_id != self._round:
            return [LookupResult(None, None) for _ in keys]
        rows = [self._rankings.get(seq_id, []) for seq_id, _, _ in keys]
        found = ranks([r[k] if k < len(r) else None for r, (_, k, _) in zip(rows, keys)], [t for _, _, t in keys])
        out: list[LookupResult] = []
        for (seq_id, k, t), rank in zip(keys, found):
            spec = self.cache.lookup(seq_id, k, t)
            if spec is None:
                out.append(LookupResult(None, rank))
                continue
            ext = self._commit_hit(seq_id, t, spec, share_kv)
            out.append(LookupResult(Proposal(list(spec.tokens), spec.q, "cache"), rank, ext))
        self._record_outcomes(keys)
        if plans is not None and len(plans) == len(keys):
            nexts = [plan_for(p, k) for p, (_, k, _) in zip(plans, keys)]
            self._serve_backups(keys, out, nexts)
            self._next = self._next_items(keys, out, nexts)
        return out

    def _serve_backups(self, keys: Sequence[tuple[int, int, int]], out: list[LookupResult], plans: Sequence[NextRound | None]) -> None:
        """Give each miss with a plan its backup of the plan's kind, from the
        real outcome (see :meth:`lookup`); none where this draft does not know
        the sequence's step (or, for the fast guess, its history)."""
        neural: list[int] = []
        for i, (res, plan) in enumerate(zip(out, plans)):
            seq_id, k, t = keys[i]
            if res.proposal is not None or plan is None or seq_id not in self._items:
                continue
            if plan.k == 0:  # nothing left worth speculating
                out[i] = replace(res, backup=Proposal([], None, plan.backup))
            elif plan.backup == "neural":
                neural.append(i)
            elif (history := self._history_after(seq_id, k, t)) is not None:
                out[i] = replace(res, backup=Proposal(ngram_guess(history, plan.k), None, "fast"))
        if neural:
            got = self.propose(
                [self._next_step(*keys[i]) for i in neural],
                [plans[i].k for i in neural],
                min(self._items[keys[i][0]].saguaro_c for i in neural),
                [plans[i].after_backup for i in neural],
            )
            for i, p in zip(neural, got):
                out[i] = replace(out[i], backup=replace(p, source="neural"))

    def _next_items(self, keys: Sequence[tuple[int, int, int]], results: Sequence[LookupResult], plans: Sequence[NextRound | None]) -> list[BuildItem] | None:
        """The build items the next round will send, as the round loop makes
        them, when they are all known here: per key, the step
        :meth:`_next_step` gives, the hit clipped to the plan's K (else the
        backup this lookup made), and the plan's fan-out for it (``plans``:
        each key's own, see :func:`plan_for`). None when any is unknown (a
        sequence without a plan, whose miss the round loop serves itself) or
        several drafts share the outcomes (their builds need the hit's KV
        delta first)."""
        items = []
        for (seq_id, k, t), res, plan in zip(keys, results, plans):
            it = self._items.get(seq_id)
            if plan is None or it is None or it.num_shards != 1:
                return None
            if res.proposal is not None:
                proposal, fanout = Proposal(res.proposal.tokens[: plan.k], None, "cache"), plan.after_hit
            elif res.backup is not None and res.backup.source == plan.backup:
                proposal, fanout = Proposal(res.backup.tokens, None, plan.backup), plan.after_backup
            else:
                return None
            items.append(BuildItem(self._next_step(seq_id, k, t), proposal, list(fanout), plan.k, it.saguaro_c))
        return items

    def _history_after(self, seq_id: int, k: int, t: int) -> list[int] | None:
        """The sequence's token ids once outcome (k, t) of the latest build is
        emitted (the round loop's history then), or None if not all known."""
        it, history = self._items[seq_id], self._history.get(seq_id)
        if history is None or len(history) != it.step.start + len(it.step.new_tokens) + k:
            return None
        return history + [t]

    def _record(self, steps: Sequence[SeqStep]) -> None:
        """Keep each sequence's token ids as the steps reveal them (in place:
        a step rewrites what follows its start; a few missing tokens come from
        its ``recent``). A step that starts further on than that leaves the
        history unknown until the whole of it is sent again."""
        for st in steps:
            history = self._history.get(st.seq_id)
            if history is None:
                if st.start == 0:
                    self._history[st.seq_id] = list(st.new_tokens)
                continue
            gap = st.start - len(history)
            if gap > len(st.recent):
                del self._history[st.seq_id]
                continue
            if gap > 0:
                history.extend(st.recent[len(st.recent) - gap :])
            else:
                del history[st.start :]
            history.extend(st.new_tokens)

    def _record_outcomes(self, keys: Sequence[tuple[int, int, int]]) -> None:
        """The accepted draft tokens of each outcome (seq, k, t) are part of the
        sequence now (t comes with the next step)."""
        for seq_id, k, _ in keys:
            it, history = self._items.get(seq_id), self._history.get(seq_id)
            if it is not None and history is not None and len(history) == it.step.start + len(it.step.new_tokens):
                history.extend(it.proposal.tokens[:k])

    def _next_step(self, seq_id: int, k: int, t: int) -> SeqStep:
        """The step the round loop would send next for outcome (k, t) of the
        latest build: its proposal's first k tokens accepted, t emitted."""
        it = self._items[seq_id]
        st = it.step
        held = list(st.new_tokens) + list(it.proposal.tokens[:k])
        recent = (list(st.recent) + held)[-RECENT_TOKENS:]
        return SeqStep(seq_id, st.start + len(held), [t], st.params, st.seed, st.output_pos + k + 1, recent)

    def _commit_hit(self, seq_id: int, t: int, spec: Speculation, share_kv: bool) -> Extension | None:
        """Move a hit branch's K/V ([t*, x_1..x_{K-1}]) into the sequence's
        cache; with ``share_kv``, return the KV delta for peer drafts (its
        rankings as token lists — this draft keeps the logit rows)."""
        tree, n = self._tree, len(spec.tokens)
        if tree is None or n == 0 or not self.runner.has_sequence(seq_id):
            return None
        start = tree.prefix_lens[spec.branch]
        kv = self.runner.tree_export(tree, spec.branch, n) if share_kv else None
        self.runner.tree_commit(tree, spec.branch, n)
        rows = [lg[spec.branch] for lg in self._tree_logits[:n]]
        ext = Extension(seq_id, start, [t] + list(spec.tokens[: n - 1]), rows)
        self._own[seq_id] = ext
        return replace(ext, rankings=top_order(torch.stack(rows)).tolist(), kv=kv) if share_kv else None

    def prefill(self, steps: Sequence[SeqStep]) -> None:
        self._next = self._ahead = None  # the next build has new sequences: it is built when called
        self._record(steps)
        super().prefill(steps)

    def release(self, seq_ids: Sequence[int]) -> None:
        super().release(seq_ids)  # (a build started ahead stands for the other sequences)
        for s in seq_ids:
            self.cache.drop(s)
            self._rankings.pop(s, None)
            self._own.pop(s, None)
            self._glued.pop(s, None)
            self._items.pop(s, None)
            self._history.pop(s, None)
