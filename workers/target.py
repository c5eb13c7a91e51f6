"""Target-worker logic: owns the target runner, verifies proposals, samples.

Plain Python, no transport: the in-process engine calls it directly and the
Ray actor wraps the very same object. Logits never leave this object — only
outcomes (k accepted, next token) do. Autoregressive decoding is verification
of an empty proposal, so every mode goes through one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from saguaro_ray.algorithms.logprobs import row_logprobs, token_logprobs
from saguaro_ray.algorithms.sampling import STREAM_TARGET, position_keys, position_uniforms, process_logits
from saguaro_ray.algorithms.fuzzy import is_lossy
from saguaro_ray.algorithms.pyramid import target_check
from saguaro_ray.algorithms.tensors import tensor_like
from saguaro_ray.algorithms.verification import greedy_outcomes, invariant_outcomes, point_mass
from saguaro_ray.workers.messages import NeedsPrefillError, Outcome, Proposal, SeqStep, VerifyItem
from saguaro_ray.workers.grammar_masks import GrammarMasks
from saguaro_ray.workers.logit_adjust import LogitAdjuster, RowContext
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.token_history import TokenHistory


def feed(
    runner: ModelRunner, history: TokenHistory, steps: Sequence[SeqStep], extra: Sequence[Sequence[int]], num_logits: Sequence[int]
) -> torch.Tensor:
    """Roll each sequence back to ``step.start`` and append ``new_tokens + extra``.

    Shared by every worker kind: this is where rejected speculation is dropped
    from the KV cache (and from ``history``, which follows the KV). Returns the
    requested trailing logit rows, flat.
    """
    added = []
    catch_up: list[list[int]] = []
    keep: list[int] = []  # per step: the length its KV is cut back to (rejected or stale speculation dropped)
    for st in steps:
        if not runner.has_sequence(st.seq_id):
            if st.start != 0:
                raise NeedsPrefillError(f"sequence {st.seq_id} is unknown here; resend it from position 0")
            runner.add_sequence(st.seq_id)
            added.append(st.seq_id)
        held = _valid_length(history.tokens(st.seq_id), runner.seq_len(st.seq_id), st)
        gap = st.start - held
        if gap > len(st.recent):
            raise NeedsPrefillError(f"sequence {st.seq_id} holds {held} valid tokens, step starts at {st.start}")
        catch_up.append(st.recent[len(st.recent) - gap :] if gap > 0 else [])
        keep.append(min(held, st.start))
    for st, n in zip(steps, keep):  # every step checked: now change the KV
        if runner.seq_len(st.seq_id) > n:
            runner.truncate(st.seq_id, n)
            history.truncate(st.seq_id, n)
    fed = [c + st.new_tokens + list(x) for st, c, x in zip(steps, catch_up, extra)]
    try:
        logits = runner.forward([st.seq_id for st in steps], fed, num_logits=num_logits)
    except Exception:
        for s in added:  # a refused step leaves no half-registered sequence behind
            runner.free_sequence(s)
            history.drop(s)
        raise
    for st, n, tokens in zip(steps, keep, fed):
        history.put(st.seq_id, n, tokens)
        if st.prompt_len is not None:
            history.set_prompt_len(st.seq_id, st.prompt_len)
    return logits


def _valid_length(held: Sequence[int], kv_len: int, step: SeqStep) -> int:
    """How many of the ``kv_len`` tokens a worker holds are the sequence's:
    all up to the first that differs from the committed tokens the step
    repeats (``recent``). A worker that sat out rounds after drafting holds
    its proposal past the tokens it was last sent; where the sequence went
    on otherwise, that speculation must go before the catch-up is appended,
    or the worker would draft after tokens the sequence never had."""
    base = step.start - len(step.recent)
    for pos in range(max(base, 0), min(kv_len, step.start, len(held))):
        if held[pos] != step.recent[pos - base]:
            return pos
    return kv_len


@dataclass
class VerificationBatch:
    """Padded tensors for verifying a ragged batch of proposals (see
    :func:`saguaro_ray.algorithms.verification.verify` for the layout)."""

    p: torch.Tensor  # [B, Kmax+1, V] processed law of the verifying model
    tokens: torch.Tensor  # [B, Kmax]
    q: torch.Tensor | None  # [B, Kmax, V] the proposals' exact laws; None when every proposal is a point mass
    lens: torch.Tensor  # [B]
    u: torch.Tensor  # [B, Kmax+1, 2]


def processed_rows(logits: torch.Tensor, steps: Sequence[SeqStep], lens: Sequence[int]) -> torch.Tensor:
    """The processed law of each of the flat logit rows (``lens[i] + 1`` rows
    for ``steps[i]``), each under its own sequence's sampling parameters."""
    params = [st.params for st in steps]
    if all(p is params[0] for p in params):  # one law for every row: scalars broadcast
        pp = params[0]
        return process_logits(logits, [pp.temperature], [pp.top_k], [pp.top_p])
    reps = tensor_like(logits, [n + 1 for n in lens])
    per_row = lambda f: tensor_like(logits, [f(p) for p in params]).repeat_interleave(reps)  # noqa: E731
    return process_logits(logits, per_row(lambda p: p.temperature), per_row(lambda p: p.top_k), per_row(lambda p: p.top_p))


def row_keys(steps: Sequence[SeqStep], lens: Sequence[int]) -> list[int]:
    """The public noise key of each flat row (``lens[i] + 1`` for ``steps[i]``,
    at output positions ``output_pos .. output_pos + lens[i]``)."""
    return position_keys(
        [st.seed for st, n in zip(steps, lens) for _ in range(n + 1)],
        [st.output_pos + j for st, n in zip(steps, lens) for j in range(n + 1)],
    )


def invariant_check(logits: torch.Tensor, steps: Sequence[SeqStep], proposals: Sequence[Proposal]) -> list[tuple[int, int]]:
    """The drafter-invariant rule on flat logit rows: (accepted, emitted
    token) per sequence (the qualifier runs it on rows it also keeps)."""
    lens = [len(p.tokens) for p in proposals]
    return invariant_outcomes(processed_rows(logits, steps, lens), row_keys(steps, lens), [p.tokens for p in proposals])


def verification_batch(logits: torch.Tensor, steps: Sequence[SeqStep], proposals: Sequence[Proposal], stream: int) -> VerificationBatch:
    """Turn the verifying model's logit rows (``len(proposal)+1`` per sequence,
    flat) into the processed law p, the proposals' q, and the uniforms of
    ``stream`` keyed by each position's output index."""
    lens = [len(p.tokens) for p in proposals]
    kmax = max(lens)
    b, vocab = len(steps), logits.shape[-1]
    params = [st.params for st in steps]
    p_flat = processed_rows(logits, steps, lens)
    if min(lens) == kmax:
        p = p_flat.view(b, kmax + 1, vocab)
    else:
        p = p_flat.new_zeros(b, kmax + 1, vocab)
        offset = 0
        for i, n in enumerate(lens):
            p[i, : n + 1] = p_flat[offset : offset + n + 1]
            offset += n + 1
    tokens = tensor_like(logits, [prop.tokens + [0] * (kmax - n) for prop, n in zip(proposals, lens)], torch.long).view(b, kmax)
    q = None  # every proposal a point mass: verification uses δ_token
    if any(prop.q is not None for prop in proposals):
        q = p_flat.new_zeros(b, kmax, vocab)
        for i, (prop, n) in enumerate(zip(proposals, lens)):
            if n:
                q[i, :n] = point_mass(tokens[i, :n], vocab) if prop.q is None else prop.q[:n].to(q)
    if all(pr.greedy for pr in params):
        # one-hot p: every accept test and every draw is decided whatever the
        # uniform, so none is drawn (identical results, no generator work)
        u = p.new_zeros(b, kmax + 1, 2, dtype=torch.float64)
    else:
        u = position_uniforms(
            [st.seed for st in steps for _ in range(kmax + 1)],
            [st.output_pos + j for st in steps for j in range(kmax + 1)],
            2,
            stream,
        ).view(b, kmax + 1, 2)
        u = tensor_like(p, u)
    return VerificationBatch(p, tokens, q, tensor_like(p, lens), u)


def with_logprobs(
    outcomes: list[Outcome], raw: torch.Tensor, adjusted: torch.Tensor, steps: Sequence[SeqStep], proposals: Sequence[Proposal]
) -> list[Outcome]:
    """Give each outcome whose sequence asks for logprobs those of its emitted
    tokens: rows 0..k of its item's logit rows (flat, ``len(proposal)+1``
    each; ``raw`` before the logit adjustments, ``adjusted`` after)."""
    start = 0
    for o, st, prop in zip(outcomes, steps, proposals):
        pp = st.params
        if pp.logprobs is not None:
            rows = slice(start, start + o.accepted + 1)
            logp = row_logprobs(raw[rows], adjusted[rows], pp.logprobs_mode, pp.temperature, pp.top_k, pp.top_p)
            o.logprobs = token_logprobs(logp, o.emitted(prop), pp.logprobs)
        start += len(prop.tokens) + 1
    return outcomes


def flat_rows(like: torch.Tensor, n_rows: Sequence[int], idx: Sequence[int]) -> torch.Tensor:
    """The indices of items ``idx``'s rows among flat logit rows (``n_rows[i]``
    per item), on the device of ``like`` (the rows they index)."""
    starts = [0]
    for n in n_rows:
        starts.append(starts[-1] + n)
    return tensor_like(like, [r for i in idx for r in range(starts[i], starts[i + 1])])


def rule_of(item: VerifyItem) -> str:
    """The rule that checks ``item``: ``invariant`` — the drafter-invariant
    rule, the one rule of every exact check of a sampled sequence (SD, SSD,
    AR, PyramidSD's exact stages and a fuzzy stage at τ = 0: it compares
    tokens, so a qualified block is checked like any proposal) — else the
    item's own: a lossy fuzzy stage (τ > 0) runs speculative sampling's test
    with its extra accepts, and a greedy sequence keeps ``exact``, whose
    closed form (:func:`greedy_outcomes`) accepts the same argmax prefix with
    no noise."""
    if item.step.params.greedy or (item.rule == "fuzzy" and is_lossy(item.tau)):
        return item.rule
    return "invariant"


class RunnerLogic:
    """What every worker kind shares: one runner, prefill, and releasing sequences."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.history = TokenHistory()
        self.adjuster = LogitAdjuster(self.history, GrammarMasks.for_runner(runner))

    def feed(self, steps: Sequence[SeqStep], extra: Sequence[Sequence[int]], num_logits: Sequence[int]) -> torch.Tensor:
        """:func:`feed` on this worker's runner and history."""
        return feed(self.runner, self.history, steps, extra, num_logits)

    def adjusted(self, logits: torch.Tensor, steps: Sequence[SeqStep], num_logits: Sequence[int]) -> torch.Tensor:
        """The rows :meth:`feed` just returned (``num_logits[i]`` trailing rows
        of ``steps[i]``'s sequence, flat), adjusted by each sequence's penalties,
        bias and grammar; ``logits`` itself when no sequence asks for any."""
        if not any(st.params.adjusts_logits for st in steps):
            return logits
        rows = [ctx for st, n in zip(steps, num_logits) for ctx in self.adjuster.rows_after(st.seq_id, st.params, n)]
        return self.adjust_rows(logits, rows)

    def adjust_rows(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
        """Every row this worker adjusts goes through here (a draft adds its
        reduced head's fallback)."""
        return self.adjuster.adjust(logits, rows)

    def prefill(self, steps: Sequence[SeqStep]) -> None:
        self.feed(steps, [[]] * len(steps), [1] * len(steps))

    def release(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            self.runner.free_sequence(s)
            self.history.drop(s)
        self.adjuster.release(seq_ids)


class TargetLogic(RunnerLogic):

    def verify(self, items: Sequence[VerifyItem]) -> list[Outcome]:
        """Feed each sequence's pending tokens plus its proposal, verify the
        proposal against the processed target law, and return the outcomes.
        One forward scores the whole batch; each item is checked with its own
        rule (``exact``, or a PyramidSD sequence's stage-2 test), so sequences
        of different strategies share one verification."""
        steps = [it.step for it in items]
        proposals = [it.proposal for it in items]
        lens = [len(p.tokens) for p in proposals]
        n_rows = [n + 1 for n in lens]
        raw = self.feed(steps, [p.tokens for p in proposals], n_rows)
        logits = self.adjusted(raw, steps, n_rows)
        groups: dict[tuple[str, float, str], list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault((rule_of(it), it.tau, it.div), []).append(i)
        if len(groups) == 1:
            return with_logprobs(self._check(next(iter(groups)), logits, steps, proposals), raw, logits, steps, proposals)
        out: list[Outcome | None] = [None] * len(items)
        for key, idx in groups.items():
            rows = flat_rows(logits, n_rows, idx)
            for i, o in zip(idx, self._check(key, logits[rows], [steps[i] for i in idx], [proposals[i] for i in idx])):
                out[i] = o
        return with_logprobs(out, raw, logits, steps, proposals)  # type: ignore[arg-type]

    @staticmethod
    def _check(rule_key: tuple[str, float, str], logits: torch.Tensor, steps: Sequence[SeqStep], proposals: Sequence[Proposal]) -> list[Outcome]:
        """Verify ``proposals`` under one rule from their flat logit rows."""
        rule, tau, div = rule_key
        lens = [len(p.tokens) for p in proposals]
        if rule == "invariant":
            outs = invariant_check(logits, steps, proposals)
            return [Outcome(st.seq_id, a, t, n) for st, (a, t), n in zip(steps, outs, lens)]
        if rule == "exact" and all(st.params.greedy for st in steps):  # the same rule, in closed form
            outs = greedy_outcomes(logits, [p.tokens for p in proposals])
            return [Outcome(st.seq_id, a, t, n) for st, (a, t), n in zip(steps, outs, lens)]
        vb = verification_batch(logits, steps, proposals, STREAM_TARGET)
        res = target_check(rule, vb.p, vb.tokens, vb.q, vb.lens, vb.u, tau, div)
        acc, nxt = res.accepted.tolist(), res.next_token.tolist()
        return [Outcome(st.seq_id, a, t, n) for st, a, t, n in zip(steps, acc, nxt, lens)]
