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

With one draft, a lookup also carries each sequence's :class:`NextRound`: a
miss gets its backup in the same call, and with every next proposal known
the draft starts the next round's build itself once the lookup is answered
(:meth:`DraftLogic.after_reply`) — one control-plane hop before the build call
would reach it — with the items :func:`ssd_protocol.next_build_item` gives,
which are the ones the round loop sends (it says so with ``ahead``). The
draft keeps no copy of the round loop's state: :func:`ssd_protocol.resolve`
reads the plan at the outcome, with the step and proposal of the build item
this draft got for the round.

The three stay one module (~430 lines): they share one runner and its KV,
the speculation cache and the state of the build in progress, which a lookup
reads and the next build continues.

A sampled sequence is verified by the drafter-invariant rule, so a draft
proposes the race winner of its own law under the public noise of (seed,
output position), the noise the verifier's token is drawn with, and a build
ranks its candidates by the same noisy scores. A hit and a neural backup
propose the same tokens for the same outcome.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from saguaro_ray.algorithms.cache import SpeculationCache, Speculation
from saguaro_ray.algorithms.tensors import host_to, tensor_like
from saguaro_ray.algorithms.sampling import argmax_lowest, position_keys, process_logits, race_scores, race_token
from saguaro_ray.config import SamplingParams
from saguaro_ray.algorithms.fanout import deal_candidates
from saguaro_ray.algorithms.ranking import RowOrder, RowSource, ranks, top_order, top_tokens
from saguaro_ray.workers import ssd_protocol
from saguaro_ray.workers.messages import BuildItem, KVDelta, LookupResult, NextRound, Proposal, ProposalSource, SeqStep, Timed
from saguaro_ray.workers.runner import ModelRunner, TreeState
from saguaro_ray.workers.logit_adjust import RowContext
from saguaro_ray.workers.target import RunnerLogic

log = logging.getLogger(__name__)

def _draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row; returns (tokens, the processed draft law or None when all greedy).

    Greedy rows propose the argmax (their law row is one-hot in a mixed
    batch). Sampled rows propose the race winner of the processed draft law
    under the position's public noise, the noise the verifier's token is
    drawn with: the drafter-invariant rule only compares tokens, and the two
    agree with probability at least ``(1 - TV) / (1 + TV)``. A race winner is
    an exact draw from its law, so the returned law is what a fuzzy PyramidSD
    stage checks it against (the only reader of a draft's law)."""
    if all(p.greedy for p in params):
        return argmax_lowest(logits), None
    q = process_logits(logits, [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params])
    return race_token(q, position_keys(seeds, positions)), q


def _race_rows(rows: list[RowSource], step: SeqStep) -> list[RowSource]:
    """A glue row's ranking under the drafter-invariant rule: row k (the draft's
    logits for output position ``output_pos + k``) becomes its race scores
    there, whose top is the draft's own proposal and whose runner-up is its
    best guess at the target's token after a rejection (the target emits its
    own race winner, a deterministic function of p and the same noise, so the
    draft ranks outcomes as it does at T = 0). Token-list rows (a peer's KV
    delta) are used as they come: the peer ranked them so
    (:meth:`DraftLogic._commit_hit`)."""
    if step.params.greedy:
        return rows
    live = [k for k, r in enumerate(rows) if isinstance(r, torch.Tensor)]
    if not live:
        return rows
    pp = step.params
    q = process_logits(torch.stack([rows[k] for k in live]), [pp.temperature], [pp.top_k], [pp.top_p])
    scores = race_scores(q, position_keys([step.seed] * len(live), [step.output_pos + k for k in live]))
    out = list(rows)
    for k, row in zip(live, scores.log().float()):
        out[k] = row
    return out


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
        self._tree_pos: list[int] = []  # per branch: the output position its first tree step predicts
        # per sequence: the KV delta of the hit this draft served (already in its cache)
        self._own: dict[int, KVDelta] = {}
        self.glue_tokens = 0  # tokens forwarded to build glue rows (recomputation avoided by KV deltas is not counted)
        # the round whose build the cache holds (None: none complete); a lookup names the
        # round it expects: one that overtook a re-sent build must not read another round's cache
        self._round: int | None = None
        self._started: int | None = None  # round id of the latest build begun
        self._items: dict[int, BuildItem] = {}  # that build's item per sequence: where a plan is read from
        # the next round's build, known since the latest lookup (to start once it is answered) ...
        self._next_build: list[BuildItem] | None = None
        # ... and, once run, its sequences, span and result, until the build call comes
        self._built_ahead: tuple[set[int], tuple[float, float], dict[str, object]] | None = None
        # per sequence: the part of its own hit's delta a build started ahead kept in the KV
        # (a build call that is not answered from it reuses that instead of recomputing)
        self._delta_in_kv: dict[int, KVDelta] = {}
        self.ahead_started = 0  # builds started ahead (those no call asked for were wasted work)
        self.ahead_builds = 0  # build calls answered from a build started ahead

    def adjust_rows(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
        """The adjusted rows; with a reduced-vocabulary head, a row left with
        no allowed token (a grammar that allows only ids outside the subset)
        is recomputed with the full head and adjusted again, so every law
        drawn from stays a proper one."""
        out = self.adjuster.adjust(logits, rows)
        if out is logits or self.runner.head_ids is None:
            return out
        dead = torch.isneginf(out.amax(-1)).nonzero().flatten()
        if dead.numel():
            out[dead] = self.adjuster.adjust(self.runner.full_head_logits(dead), [rows[i] for i in dead.tolist()])
        return out

    # ------------------------------------------------------------ propose
    def propose(self, steps: Sequence[SeqStep], ks: Sequence[int], with_laws: bool = False) -> list[Proposal]:
        """Draft ``ks[b]`` tokens for each sequence by sequential decoding.
        ``with_laws``: every sampled proposal carries the law it was drawn
        from (a race winner is an exact draw from its law, independent of any
        other stream: a fuzzy PyramidSD stage checks it by speculative
        sampling); otherwise proposals are tokens alone, all the
        drafter-invariant rule reads."""
        self._forget_builds({st.seq_id for st in steps})
        ones = [1] * len(steps)
        logits = self.adjusted(self.feed(steps, [[]] * len(steps), ones), steps, ones)
        tokens: list[list[int]] = [[] for _ in steps]
        qrows: list[list[torch.Tensor]] = [[] for _ in steps]
        active = [i for i, k in enumerate(ks) if k > 0]
        if active:
            logits = logits[tensor_like(logits, active)]  # from here on, one row per active sequence
        j = 0
        while active:
            toks, q = _draw(logits, [steps[i].params for i in active], [steps[i].seed for i in active], [steps[i].output_pos + j for i in active])
            for r, i in enumerate(active):
                tokens[i].append(int(toks[r]))
                if with_laws and q is not None and not steps[i].params.greedy:
                    qrows[i].append(q[r])
            j += 1
            active = [i for i in active if len(tokens[i]) < ks[i]]
            if active:
                logits = self.runner.forward([steps[i].seq_id for i in active], [[tokens[i][-1]] for i in active])
                for i in active:
                    self.history.append(steps[i].seq_id, tokens[i][-1:])
                logits = self.adjusted(logits, [steps[i] for i in active], [1] * len(active))
        return [Proposal(t, torch.stack(q) if q else None, ProposalSource.DRAFT) for t, q in zip(tokens, qrows)]

    def _forget_builds(self, seqs: set[int]) -> None:
        """``seqs`` are drafted from their step now, not from a build: a build
        started ahead (or about to be) assumed them untouched and is dropped if
        it holds one of them, and the hit deltas kept for their next build
        are stale. Sequences of other strategies in the same batch (SD's
        beside SSD's) leave the SSD sequences' build alone."""
        if self._built_ahead is not None and seqs & self._built_ahead[0]:
            self._built_ahead = None
        if self._next_build is not None and seqs & {it.step.seq_id for it in self._next_build}:
            self._next_build = None
        for s in seqs:
            self._own.pop(s, None)

    def propose_for_qualifier(self, steps: Sequence[SeqStep], ks: Sequence[int], with_laws: bool = False) -> list[Proposal]:
        """:meth:`propose` for a PyramidSD sequence (``with_laws`` for a fuzzy
        stage 1, which reads them); the name lets a transport with a data
        plane send their q rows to the qualifier that checks them rather than
        to the target."""
        return self.propose(steps, ks, with_laws=with_laws)

    # -------------------------------------------------------------- build
    def _glue_plan(self, it: BuildItem) -> tuple[SeqStep | None, list[RowSource]]:
        """How to get the glue rows (the draft's law after each token of
        ``new_tokens + proposal``) for one item: rows already known from a KV
        delta (this draft's own hit, or a peer's ``it.kv_delta``), and the
        step that forwards the rest (None when nothing is left to forward)."""
        st, seq = it.step, it.step.seq_id
        glue = list(st.new_tokens) + list(it.proposal.tokens)
        own = self._own.pop(seq, None)
        ext = own or it.kv_delta
        usable = (
            ext is not None
            and ext.seq_id == seq
            and ext.start == st.start
            and len(st.new_tokens) == 1
            and self.runner.has_sequence(seq)
            and ext.start <= self.runner.seq_len(seq)
        )
        if usable and ext is it.kv_delta:  # a peer's delta: append it in place of the stale glue
            if ext.kv is None:
                usable = False
            else:
                self.runner.truncate(seq, ext.start)
                self.runner.append_kv(seq, ext.kv)
                self.history.put(seq, ext.start, ext.tokens)
        m = 0
        if usable and self.runner.seq_len(seq) >= ext.start + len(ext.tokens):
            while m < min(len(glue), len(ext.tokens)) and glue[m] == ext.tokens[m]:
                m += 1
        n_rows = len(it.proposal.tokens) + 1
        if m == 0:
            return replace(st, new_tokens=glue), []
        known = ext.rankings[: min(m, n_rows)]
        self.runner.truncate(seq, ext.start + m)
        self.history.truncate(seq, ext.start + m)
        if own is not None:  # the KV now holds its first m tokens: what a later build of this round may reuse
            self._delta_in_kv[seq] = replace(own, tokens=own.tokens[:m], rankings=own.rankings[:m])
        if m == len(glue):
            return None, known
        return replace(st, start=ext.start + m, new_tokens=glue[m:], recent=[]), known

    def build(self, items: Sequence[BuildItem], round_id: int | None = None, ahead: bool = False) -> dict[str, object] | Timed:
        """Pre-compute next round's speculation for the likely outcomes (SSD).
        ``round_id`` names the round for :meth:`lookup`'s check.

        ``ahead``: the round loop made ``items`` with
        :func:`ssd_protocol.next_build_item` from the plans of this draft's
        latest lookup and the proposals it served — the build this draft
        started itself (:meth:`after_reply`), if it did, for every sequence
        still running. Then that build is the answer: its result with
        ``"ahead": True``, as a :class:`Timed` of the span it really ran (the
        worker reports that span for the call). Anything else is built now."""
        started, self._built_ahead, self._next_build = self._built_ahead, None, None
        if ahead and started is not None and items and {it.step.seq_id for it in items} <= started[0]:
            self._round = round_id
            self._started = round_id if round_id is not None else self._started
            self.ahead_builds += 1
            return Timed({**started[2], "ahead": True}, *started[1])
        if started is not None:  # built for nothing: the hits' deltas it consumed are still in the KV
            self._own.update(self._delta_in_kv)
        return self._build(items, round_id)

    def after_reply(self) -> Callable[[], None] | None:
        """Work for the worker to run once the call just served has been
        answered: the next round's build, when the latest lookup made it known
        (every sequence's next proposal is here and the lookup brought its
        :class:`NextRound`). None: nothing to do."""
        return self._build_ahead if self._next_build is not None else None

    def _build_ahead(self) -> None:
        items, self._next_build = self._next_build, None
        if not items:
            return
        start = time.perf_counter()
        self.ahead_started += 1
        try:
            got = self._build(items, None)
        except Exception as e:  # the build call will run it again and report what is wrong
            log.debug("a build started ahead failed: %s", e)
            self._tree, self._tree_logits = None, []
            self._own.update(self._delta_in_kv)
            return
        self._built_ahead = ({it.step.seq_id for it in items}, (start, time.perf_counter()), got)

    def _build(self, items: Sequence[BuildItem], round_id: int | None) -> dict[str, object]:
        self._round = None  # until this build is complete
        self._started = round_id if round_id is not None else self._started
        self._delta_in_kv = {}
        self._items = {it.step.seq_id: it for it in items}
        glue_plans = [self._glue_plan(it) for it in items]
        fwd = [(i, st) for i, (st, _) in enumerate(glue_plans) if st is not None]
        n_rows = [len(it.proposal.tokens) + 1 for it in items]
        rows: list[list[RowSource]] = [list(known) for _, known in glue_plans]
        if fwd:
            want = [min(len(st.new_tokens), n_rows[i]) for i, st in fwd]
            self.glue_tokens += sum(len(st.new_tokens) for _, st in fwd)
            glue_steps = [st for _, st in fwd]
            glue = self.adjusted(self.feed(glue_steps, [[]] * len(fwd), want), glue_steps, want)
            offset = 0
            for (i, _), w in zip(fwd, want):
                rows[i].extend(glue[offset : offset + w].unbind(0))
                offset += w
        # -- choose branches: (sequence index, k, first token) — candidate (k, j)
        # is the j-th token of row k, the drafted s_{k+1} left out
        picks: list[tuple[int, int, int]] = []
        for i, it in enumerate(items):
            toks = it.proposal.tokens
            ranking = [RowOrder(row, toks[k] if k < len(toks) else None) for k, row in enumerate(_race_rows(rows[i], it.step))]
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
        # a branch's history: the sequence's held ids up to its prefix, then its own tokens
        b_hist: list[list[int]] | None = None
        if any(p.adjusts_logits for p in b_params):
            b_hist = [[t] for _, _, t in branches]
            b_prefix = [it.step.start + len(it.step.new_tokens) + k for it, (_, k, _) in zip(b_item, branches)]
            b_seq = [it.step.seq_id for it in b_item]
        cur = host_to(self.runner.device, [[t] for _, _, t in branches])
        steps: list[torch.Tensor] = []  # sampled tokens per step [N] (rows past a branch's length unused)
        step_logits = []
        for j in range(depth):
            logits = self.runner.tree_forward(tree, cur)[:, 0]
            if b_hist is not None:
                contexts = [
                    RowContext(s, p, self.history.tokens(s), u, tuple(h), self.history.prompt_len(s))
                    for s, p, u, h in zip(b_seq, b_params, b_prefix, b_hist)
                ]
                logits = self.adjust_rows(logits, contexts)
            step_logits.append(logits)
            if all_greedy:
                toks = argmax_lowest(logits)
            else:
                live = [r for r in range(n) if j < b_len[r]]
                toks_live, _ = _draw(
                    logits[live] if len(live) < n else logits,
                    [b_params[r] for r in live],
                    [b_seed[r] for r in live],
                    [b_pos[r] + j for r in live],
                )
                toks = cur[:, 0].clone()
                toks[tensor_like(toks, live)] = toks_live
            steps.append(toks)
            if b_hist is not None:
                for h, x in zip(b_hist, toks.tolist()):
                    h.append(x)
            cur = toks.unsqueeze(1)
        tokens = torch.stack(steps, dim=1).tolist()
        self._tree, self._tree_logits, self._tree_pos = tree, step_logits, b_pos
        per_seq: dict[int, dict[tuple[int, int], Speculation]] = {}
        for r, (i, k, t) in enumerate(branches):
            spec = Speculation(tokens=tokens[r][: b_len[r]], branch=r)
            per_seq.setdefault(items[i].step.seq_id, {})[(k, t)] = spec
        for seq_id, entries in per_seq.items():
            self.cache.put_round(seq_id, entries)
        self._round = round_id
        return {"branches": len(branches)}

    # ------------------------------------------------------------- lookup
    def ready(self, method: str, args: Sequence[object]) -> bool:
        """Can ``method(*args)`` run now? Not a lookup (``keys, share_kv,
        round_id, ...``) that the target forwarded ahead of the build it looks
        into: the command server holds it back until that build has begun."""
        if method == "lookup" and len(args) >= 3:
            return not self.awaits_build(args[2])  # type: ignore[arg-type]
        return True

    def awaits_build(self, round_id: int | None) -> bool:
        """Is a lookup for ``round_id`` ahead of every build begun here (its
        build is still on the way)? Round ids increase from round to round."""
        return round_id is not None and (self._started is None or self._started < round_id)

    def lookup(
        self,
        keys: Sequence[tuple[int, int, int]],
        share_kv: bool = False,
        round_id: int | None = None,
        plans: Sequence[NextRound | None] | None = None,
    ) -> list[LookupResult]:
        """Serve cached speculations for the real outcomes (seq_id, k, t*).

        Per key: the proposal (None on a miss), the 1-based rank of t* in the
        draft's ranking of row k (None if beyond what was kept) — the
        observation the fan-out estimator fits its power law to — and, on a
        hit, the KV delta: the branch's K/V becomes part of this draft's cache
        at once (so the next build forwards at most one glue token), and with
        ``share_kv`` a copy is returned for peer drafts.

        ``plans[i]`` (the round loop's only draft): what the next round
        verifies and builds for key i's sequence, read at its outcome
        (:func:`ssd_protocol.resolve`). A miss gets the plan's backup in this
        same call, as ``backup`` — the neural one drafted exactly as
        :meth:`propose` would from the next step, the fast one the n-gram
        guess from the plan's history — which saves the round loop a second
        call; and with every next proposal known here, the next build starts
        once this lookup is answered (:meth:`after_reply`).

        A ``round_id`` other than the latest complete build's (the lookup
        overtook a re-sent build, or that build failed) gets misses and no
        backups: the cache holds another round's speculations."""
        self._next_build = None
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
            out.append(LookupResult(Proposal(list(spec.tokens), None, ProposalSource.CACHE), rank, ext))
        if plans is not None and len(plans) == len(keys):
            built = [self._items.get(seq_id) for seq_id, _, _ in keys]
            resolved = [
                None if p is None or it is None else ssd_protocol.resolve(p, it.step, it.proposal.tokens, k, t)
                for p, it, (_, k, t) in zip(plans, built, keys)
            ]
            self._serve_backups(out, resolved)
            served = [r.proposal or r.backup for r in out]
            if not share_kv and all(p is not None for p in served) and all(r is not None for r in resolved):
                items = [
                    ssd_protocol.next_build_item(p, it.step, it.proposal.tokens, k, t, x)  # type: ignore[arg-type, union-attr]
                    for p, it, (_, k, t), x in zip(plans, built, keys, served)
                ]
                self._next_build = items if all(i is not None for i in items) else None  # else the round loop's build call
        return out

    def _serve_backups(self, out: list[LookupResult], plans: Sequence[ssd_protocol.Resolved | None]) -> None:
        """Give each miss with a plan its backup (see :meth:`lookup`); none
        where a neural backup's sequence is not held here (this draft was
        restarted: the round loop serves that miss itself)."""
        neural: list[int] = []
        for i, (res, plan) in enumerate(zip(out, plans)):
            if res.proposal is not None or plan is None:
                continue
            backup = ssd_protocol.miss_backup(plan)
            if backup is not None:
                out[i] = replace(res, backup=backup)
            elif plan.backup == "neural" and self.runner.has_sequence(plan.step.seq_id):
                neural.append(i)
        if not neural:
            return
        todo: list[ssd_protocol.Resolved] = [plans[i] for i in neural]  # type: ignore[misc]
        got = self.propose([p.step for p in todo], [p.k for p in todo])
        for i, p in zip(neural, got):
            out[i] = replace(out[i], backup=replace(p, source=ProposalSource.NEURAL))

    def _commit_hit(self, seq_id: int, t: int, spec: Speculation, share_kv: bool) -> KVDelta | None:
        """Move a hit branch's K/V ([t*, x_1..x_{K-1}]) into the sequence's
        cache; with ``share_kv``, return the KV delta for peer drafts (its
        rankings as token lists, in race order under the invariant rule as
        this draft's own build ranks them — this draft keeps the logit rows)."""
        tree, n = self._tree, len(spec.tokens)
        if tree is None or n == 0 or not self.runner.has_sequence(seq_id):
            return None
        start = tree.prefix_lens[spec.branch]
        kv = self.runner.tree_export(tree, spec.branch, n) if share_kv else None
        self.runner.tree_commit(tree, spec.branch, n)
        self.history.put(seq_id, start, [t] + list(spec.tokens[: n - 1]))
        rows = [lg[spec.branch] for lg in self._tree_logits[:n]]
        ext = KVDelta(seq_id, start, [t] + list(spec.tokens[: n - 1]), rows)
        self._own[seq_id] = ext
        if not share_kv:
            return None
        item = self._items.get(seq_id)
        order = rows if item is None else _race_rows(rows, replace(item.step, output_pos=self._tree_pos[spec.branch]))
        return replace(ext, rankings=top_order(torch.stack(order)).tolist(), kv=kv)

    def prefill(self, steps: Sequence[SeqStep]) -> None:
        self._next_build = self._built_ahead = None  # the next build has new sequences: it is built when called
        super().prefill(steps)

    def release(self, seq_ids: Sequence[int]) -> None:
        super().release(seq_ids)  # (a build started ahead stands for the other sequences)
        for s in seq_ids:
            self.cache.drop(s)
            self._rankings.pop(s, None)
            self._own.pop(s, None)
            self._delta_in_kv.pop(s, None)
            self._items.pop(s, None)
