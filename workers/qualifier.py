"""Qualifier-worker logic (PyramidSD): turns draft tokens into qualified tokens.

The qualifier checks a draft proposal with its own processed law p_Q under a
stage-1 rule (``exact``, ``assisted`` or ``fuzzy``) and returns the qualified
tokens — the accepted draft prefix plus its recovery/bonus token. A sampled
sequence's exact stage is the drafter-invariant rule under the target's noise
(its qualified tokens are the qualifier's race winners); a lossy fuzzy stage
(τ > 0) and a greedy sequence go through speculative sampling's test. Where a
lossy fuzzy stage 2 will read them (``VerifyItem.laws``), the qualified
tokens carry the p_Q rows they were drawn from, its q (DESIGN §4): a race
winner is an exact draw from its row too, independent of the target's
uniforms.
"""

from __future__ import annotations

from typing import Sequence

from saguaro_ray.algorithms.pyramid import qualify
from saguaro_ray.algorithms.sampling import STREAM_QUALIFIER
from saguaro_ray.workers.messages import Proposal, ProposalSource, VerifyItem
from saguaro_ray.algorithms.verification import invariant_outcomes
from saguaro_ray.workers.target import RunnerLogic, flat_rows, processed_rows, row_keys, rule_of, verification_batch


class QualifierLogic(RunnerLogic):
    def qualify(self, items: Sequence[VerifyItem]) -> list[Proposal]:
        steps = [it.step for it in items]
        proposals = [it.proposal for it in items]
        n_rows = [len(p.tokens) + 1 for p in proposals]
        logits = self.adjusted(self.feed(steps, [p.tokens for p in proposals], n_rows), steps, n_rows)
        inv = [i for i, it in enumerate(items) if rule_of(it) == "invariant"]
        out: list[Proposal | None] = [None] * len(items)
        if inv:  # the qualifier's own race winners under the target's noise
            steps_i, props_i = [steps[i] for i in inv], [proposals[i] for i in inv]
            lens = [len(p.tokens) for p in props_i]
            p_q = processed_rows(logits[flat_rows(logits, n_rows, inv)], steps_i, lens)
            offset = 0
            for i, n, (k, t) in zip(inv, lens, invariant_outcomes(p_q, row_keys(steps_i, lens), [p.tokens for p in props_i])):
                law = p_q[offset : offset + k + 1].clone() if items[i].laws else None
                out[i] = Proposal(proposals[i].tokens[:k] + [t], law, ProposalSource.QUALIFIED)
                offset += n + 1
        std = [i for i in range(len(items)) if out[i] is None]
        if std:
            steps_s, props_s = [steps[i] for i in std], [proposals[i] for i in std]
            vb = verification_batch(logits[flat_rows(logits, n_rows, std)], steps_s, props_s, STREAM_QUALIFIER)
            first = items[std[0]]
            res = qualify(first.rule, vb.p, vb.tokens, vb.q, vb.lens, vb.u, first.tau, first.div)
            for r, (i, st, prop) in enumerate(zip(std, steps_s, props_s)):
                k, t = int(res.accepted[r]), int(res.next_token[r])
                law = None if st.params.greedy or not items[i].laws else vb.p[r, : k + 1].clone()
                out[i] = Proposal(prop.tokens[:k] + [t], law, ProposalSource.QUALIFIED)
        return out  # type: ignore[return-value]

