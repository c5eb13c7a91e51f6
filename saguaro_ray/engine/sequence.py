"""Per-request state kept by the engine (the authoritative token history)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from saguaro_ray.algorithms.logprobs import TokenLogprobs
from saguaro_ray.config import SamplingParams, Strategy
from saguaro_ray.engine.stops import StopChecker


@dataclass
class SequenceState:
    """One sample being generated: the prompt, what was emitted, and why it stopped."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    prompt_index: int = 0
    sample_index: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    stopper: StopChecker | None = None  # the request's stop strings / stop token ids, if any
    strategy: Strategy | None = None  # resolved by the engine's StrategyMenu (None: the engine's default)
    # speculation bookkeeping (the round loop's)
    proposal: Any = None  # the Proposal to verify next round (SSD), None = needs a backup
    served: str = "draft"  # what made the proposal verified last (a ProposalSource value: cache, neural, fast, ...)
    # SSD: this round's build was made afresh though one was planned, and started ahead, for it
    # (it did not fit what was verified): the tree's whole build on the critical path
    rebuilt: bool = False
    built: int = 0  # SSD: the K of the speculations this round's build made (the next round's hits' length)
    rounds: int = 0  # verification rounds, the prefill round included
    spec_rounds: int = 0  # rounds that verified at least one draft token
    accepted_total: int = 0
    lookups: int = 0
    hits: int = 0
    mode: str | None = None  # the fixed mode this round runs it with (auto's pick, or its strategy's)
    k: int = 0  # ... and its K
    chosen: dict[str, int] = field(default_factory=dict)  # rounds run per mode (the per-request ``strategy`` stat)
    k_total: int = 0  # sum of K over its speculative rounds (mean K)
    # per worker kind: the tokens it holds at least, as of the last step sent to it (a draft
    # that sat out rounds catches up from there; see RoundLoop.step)
    fed: dict[str, int] = field(default_factory=dict)
    # tokens emitted in AR rounds since the drafts last took part (a round that drafted, the
    # prefill, a catch-up): what they miss — the tokens they drafted themselves they hold
    unseen_by_drafts: int = 0
    # the target's logprobs of output_ids, entry for entry (None: the params ask for none)
    logprobs: list[TokenLogprobs] | None = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def emit(self, tokens: list[int], eos_ids: tuple[int, ...], logprobs: list[TokenLogprobs] | None = None) -> list[int]:
        """Append accepted tokens one by one, stopping at EOS, a stop (see
        :mod:`saguaro_ray.engine.stops`) or ``max_tokens``; returns those kept
        (the ones after a stop are dropped, as if never decoded, and their
        ``logprobs`` with them: a sequence that asks keeps one entry per token)."""
        kept: list[int] = []
        for i, t in enumerate(tokens):
            if self.finished:
                break
            kept.append(t)
            self.output_ids.append(t)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i])  # type: ignore[index]
            if t in eos_ids and not self.params.ignore_eos:
                self.finish_reason = "stop"
            elif self.stopper is not None and self.stopper.accept(t):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        return kept


def strategy_totals(stats: list[dict[str, Any]]) -> tuple[dict[str, int], float, int]:
    """Several samples' ``strategy`` (mode → rounds) and ``mean_k`` stats
    summed: the rounds per mode, and K summed over the speculative (not AR)
    rounds with their number — so a mean K over them weighs every round
    alike (``k_total / k_rounds``), not every sample."""
    counts: dict[str, int] = {}
    k_total, k_rounds = 0.0, 0
    for s in stats:
        modes = s.get("strategy") or {}
        for mode, n in modes.items():
            counts[mode] = counts.get(mode, 0) + int(n)
        drafted = sum(int(n) for mode, n in modes.items() if mode != "ar")
        if drafted and s.get("mean_k") is not None:
            k_total += s["mean_k"] * drafted
            k_rounds += drafted
    return counts, k_total, k_rounds


@dataclass
class GenerationResult:
    """What a caller gets back for one sample (the CLI prints it as JSON)."""

    prompt_index: int
    sample_index: int
    mode: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: dict[str, Any]
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the params asked

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "mode": self.mode,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats,
            "logprobs": None if self.logprobs is None else [asdict(x) for x in self.logprobs],
        }
