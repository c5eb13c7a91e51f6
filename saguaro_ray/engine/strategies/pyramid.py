"""PyramidSD: the draft proposes ``ld`` tokens at a time, the qualifier turns
them into qualified tokens until ``lq`` are ready, and the target verifies
that block — by the drafter-invariant rule, or, in a lossy fuzzy stage 2,
with the qualifier's law as q (then the qualifier ships those rows)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from saguaro_ray.algorithms.fuzzy import is_lossy
from saguaro_ray.engine.calls import RetryingCall
from saguaro_ray.engine.round_loop import local
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.engine.timeline import Span
from saguaro_ray.workers.messages import Proposal, ProposalSource, SeqStep, VerifyItem

if TYPE_CHECKING:
    from saguaro_ray.engine.round_loop import RoundLoop


def _cat_rows(parts: list[Any]) -> Any:
    """Concatenate q blocks: tensors in process, data-plane references between actors."""
    if all(isinstance(x, torch.Tensor) for x in parts):
        return torch.cat(parts)
    return type(parts[0]).cat(parts)


class PyramidStrategy:
    def __init__(self, loop: "RoundLoop") -> None:
        self.loop = loop
        self.rule = (loop.spec.stage2, loop.spec.tau_t)

    def propose(self, running: list[SequenceState]) -> tuple[list[Proposal], Span | None]:
        loop, spec = self.loop, self.loop.spec
        limits = [loop.spec_len(s, spec.lq) for s in running]
        blocks: list[list[int]] = [[] for _ in running]
        block_q: list[list[Any]] = [[] for _ in running]
        t0 = time.perf_counter()
        lossy_stage1 = spec.stage1 == "fuzzy" and is_lossy(spec.tau_q)  # the one stage 1 that reads the draft's laws
        lossy_stage2 = spec.stage2 == "fuzzy" and is_lossy(spec.tau_t)  # the one stage 2 that reads the qualifier's
        while True:
            todo = [i for i, lim in enumerate(limits) if len(blocks[i]) < lim]
            if not todo:
                break
            seqs = [running[i] for i in todo]

            def sub(full: bool, kind: str, todo: list[int] = todo) -> list[SeqStep]:
                out = []
                for i in todo:
                    st = loop.step(running[i], full, kind)
                    out.append(replace(st, new_tokens=st.new_tokens + blocks[i], output_pos=st.output_pos + len(blocks[i])))
                return out

            ks = [min(spec.ld, limits[i] - len(blocks[i])) for i in todo]
            got = loop.draft_value(loop.draft_call("propose_for_qualifier", lambda full: (sub(full, "draft"), ks, lossy_stage1)))
            drafts = loop.fast(seqs, ks, [blocks[i] for i in todo]) if got is None else got[0]
            quals = RetryingCall(
                loop.qualifier,  # type: ignore[arg-type]
                "qualify",
                lambda full: (
                    [VerifyItem(st, local(d) if full else d, spec.stage1, spec.tau_q, spec.div, lossy_stage2) for st, d in zip(sub(full, "qualifier"), drafts)],
                ),
            ).value()[0]
            for i, qp in zip(todo, quals):
                room = limits[i] - len(blocks[i])
                blocks[i].extend(qp.tokens[:room])
                if qp.q is not None:
                    block_q[i].append(qp.q[:room])
        proposals = [Proposal(b, _cat_rows(q) if q else None, ProposalSource.QUALIFIED) for b, q in zip(blocks, block_q)]
        return proposals, (t0, time.perf_counter())
