"""Qualifier-worker logic (PyramidSD): turns draft tokens into qualified tokens.

The qualifier checks a draft proposal with its own processed law p_Q under a
stage-1 rule (``exact``, ``assisted`` or ``fuzzy``) and returns the qualified
tokens — the accepted draft prefix plus its recovery/bonus token — together
with the p_Q rows they follow, which the target then uses as q.
"""

from __future__ import annotations

from typing import Sequence

from saguaro_ray.algorithms.pyramid import qualify
from saguaro_ray.algorithms.sampling import STREAM_QUALIFIER
from saguaro_ray.workers.messages import Proposal, ProposalSource, VerifyItem
from saguaro_ray.workers.target import RunnerLogic, verification_batch


class QualifierLogic(RunnerLogic):
    def qualify(self, items: Sequence[VerifyItem]) -> list[Proposal]:
        steps = [it.step for it in items]
        proposals = [it.proposal for it in items]
        n_rows = [len(p.tokens) + 1 for p in proposals]
        logits = self.adjusted(self.feed(steps, [p.tokens for p in proposals], n_rows), steps, n_rows)
        vb = verification_batch(logits, steps, proposals, STREAM_QUALIFIER)
        res = qualify(items[0].rule, vb.p, vb.tokens, vb.q, vb.lens, vb.u, items[0].tau, items[0].div)
        out = []
        for i, (st, prop) in enumerate(zip(steps, proposals)):
            k, t = int(res.accepted[i]), int(res.next_token[i])
            rows = None if st.params.greedy else vb.p[i, : k + 1].clone()
            out.append(Proposal(prop.tokens[:k] + [t], rows, ProposalSource.QUALIFIED))
        return out
