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

Every sampled token records the exact law it was drawn from (Saguaro-rescaled
when C < 1). Random draws come from the draft stream of (seed, output
position), so a hit and a neural backup propose the same tokens for the same
outcome.
"""

from __future__ import annotations

from typing import Sequence

import torch

from saguaro_ray.algorithms.cache import SpeculationCache, Speculation
from saguaro_ray.algorithms.saguaro_sampling import saguaro_rescale
from saguaro_ray.algorithms.sampling import STREAM_DRAFT, argmax_lowest, position_uniforms, process_logits, sample_from
from saguaro_ray.config import SamplingParams
from saguaro_ray.workers.messages import BuildItem, Proposal, SeqStep
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.target import RunnerLogic, feed


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


RANK_DEPTH = 64  # how far down each glue row we remember the draft's ranking (for fitting r)


class DraftLogic(RunnerLogic):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.cache = SpeculationCache()
        # per sequence, per k: the draft's candidate ranking of row k (s_{k+1} excluded)
        self._rankings: dict[int, list[list[int]]] = {}

    # ------------------------------------------------------------ propose
    def propose(self, steps: Sequence[SeqStep], ks: Sequence[int], saguaro_c: float = 1.0, fanouts: Sequence[Sequence[int]] | None = None) -> list[Proposal]:
        """Draft ``ks[b]`` tokens for each sequence by sequential decoding."""
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
    def build(self, items: Sequence[BuildItem]) -> dict[str, int]:
        """Pre-compute next round's speculation for the likely outcomes (SSD)."""
        lens = [len(it.proposal.tokens) for it in items]
        glue = feed(self.runner, [it.step for it in items], [it.proposal.tokens for it in items], [n + 1 for n in lens])
        # -- choose branches: (sequence index, k, first token)
        branches: list[tuple[int, int, int]] = []
        offset = 0
        for i, (it, n) in enumerate(zip(items, lens)):
            rows = glue[offset : offset + n + 1]
            offset += n + 1
            order = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, : RANK_DEPTH + 1].tolist()
            ranking = []
            for k in range(n + 1):
                exclude = it.proposal.tokens[k] if k < n else None  # s_{k+1} cannot be the recovery token
                ranking.append([t for t in order[k] if t != exclude][:RANK_DEPTH])
                want = it.fanout[k] if k < len(it.fanout) else 0
                if want > 0 and it.k_next > 0:
                    branches.extend((i, k, t) for t in ranking[k][:want])
            self._rankings[it.step.seq_id] = ranking
        for it in items:
            self.cache.put_round(it.step.seq_id, {})
        if not branches:
            return {"branches": 0}
        # -- one batched shared-prefix tree decode over all branches
        depth = max(items[i].k_next for i, _, _ in branches)
        tree = self.runner.tree_start(
            [items[i].step.seq_id for i, _, _ in branches],
            [items[i].step.start + len(items[i].step.new_tokens) + k for i, k, _ in branches],
            depth=depth,
        )
        cur = torch.tensor([[t] for _, _, t in branches])
        out_tokens: list[list[int]] = [[] for _ in branches]
        out_q: list[list[torch.Tensor]] = [[] for _ in branches]
        for j in range(depth):
            logits = self.runner.tree_forward(tree, cur)[:, 0]
            live = [r for r, (i, _, _) in enumerate(branches) if j < items[i].k_next]
            toks, q = _draw(
                logits[live] if len(live) < len(branches) else logits,
                [items[branches[r][0]].step.params for r in live],
                [items[branches[r][0]].step.seed for r in live],
                # branch (k, t): t sits at output_pos + k, its j-th successor at output_pos + k + 1 + j
                [items[branches[r][0]].step.output_pos + branches[r][1] + 1 + j for r in live],
                [items[branches[r][0]].fanout[j] if j < len(items[branches[r][0]].fanout) else 0 for r in live],
                min(items[branches[r][0]].saguaro_c for r in live),
            )
            nxt = cur.clone()
            for pos, r in enumerate(live):
                out_tokens[r].append(int(toks[pos]))
                if q is not None and not items[branches[r][0]].step.params.greedy:  # greedy: point masses
                    out_q[r].append(q[pos])
                nxt[r, 0] = toks[pos]
            cur = nxt
        per_seq: dict[int, dict[tuple[int, int], Speculation]] = {}
        for r, (i, k, t) in enumerate(branches):
            spec = Speculation(tokens=out_tokens[r], q=torch.stack(out_q[r]) if out_q[r] else None, branch=r)
            per_seq.setdefault(items[i].step.seq_id, {})[(k, t)] = spec
        for seq_id, entries in per_seq.items():
            self.cache.put_round(seq_id, entries)
        return {"branches": len(branches)}

    # ------------------------------------------------------------- lookup
    def lookup(self, keys: Sequence[tuple[int, int, int]]) -> list[tuple[Proposal | None, int | None]]:
        """Serve cached speculations for the real outcomes (seq_id, k, t*).

        Returns, per key, the proposal (None on a miss) and the 1-based rank of
        t* in the draft's ranking of row k (None if beyond what was kept) —
        the observation the fan-out estimator fits its power law to."""
        out: list[tuple[Proposal | None, int | None]] = []
        for seq_id, k, t in keys:
            spec = self.cache.lookup(seq_id, k, t)
            ranking = self._rankings.get(seq_id, [])
            row = ranking[k] if k < len(ranking) else []
            rank = row.index(t) + 1 if t in row else None
            out.append((None if spec is None else Proposal(list(spec.tokens), spec.q, "cache"), rank))
        return out

    def release(self, seq_ids: Sequence[int]) -> None:
        super().release(seq_ids)
        for s in seq_ids:
            self.cache.drop(s)
            self._rankings.pop(s, None)
