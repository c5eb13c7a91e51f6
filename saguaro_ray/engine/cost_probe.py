"""What ``auto`` knows of the machine before a request: step costs measured on the engine's workers.

At engine start (issue 33) the round loop's own workers run a few real steps on throwaway
sequences — target calls of K + 1 tokens per sequence at batch 1, 2, 4, 8 (decode is K = 0), and
draft calls of 1 and ``max_k`` sequential steps at the same batches, and SSD tree builds of 1 and
``max_k`` steps over the engine's ``budget`` branches per sequence — timed by the worker's own
span, as a round's are; then decodes, verifications of ``max_k`` + 1 tokens and draft steps on
sequences holding :data:`PROBE_PROMPT` and :data:`PROBE_LONG` tokens by turns, at the largest
batch up to :data:`PROBE_LONG_BATCH`, so what the tokens a sequence holds cost is measured too
(a request's context grows by hundreds of tokens, and within one request's rounds the fits
cannot tell that cost from the rest). :meth:`~saguaro_ray.algorithms.strategy_model.AutoPolicy.seed` starts the
cost fits from them, so the first round of the first request is already a search instead of a
schedule of trial rounds. The table is cached per machine, models, dtype and runner options (under
``$SAGUARO_COSTS_DIR`` or ``~/.cache/saguaro-ray/costs``): a second engine of the same kind reads it
instead of measuring, and one of another model or dtype measures its own. The rounds run
afterwards refresh the fits (they outweigh the table within ~50 rounds).

The probe only uses the worker calls the round loop makes (``verify``, ``prefill``, ``propose``,
``release``), so it runs the same in process and on Ray. It is best effort: an engine whose probe
fails (a worker lost, too little KV) logs why and starts from the policy's cold-start schedule.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saguaro_ray.algorithms.strategy_model import AutoPolicy
from saguaro_ray.algorithms.strategy_views import StepCosts
from saguaro_ray.config import SamplingParams
from saguaro_ray.engine.calls import RetryingCall
from saguaro_ray.errors import ConfigError
from saguaro_ray.workers.messages import RECENT_TOKENS, BuildItem, Proposal, ProposalSource, SeqStep, VerifyItem

if TYPE_CHECKING:
    from saguaro_ray.engine.round_loop import RoundLoop

log = logging.getLogger(__name__)

PROBE_BATCHES = (1, 2, 4, 8)  # batch sizes measured (those up to the engine's max batch)
PROBE_REPEATS = 2  # each measurement's minimum over this many calls (a busy machine only adds time)
PROBE_PROMPT = 16  # tokens of each throwaway sequence's prompt
PROBE_LONG = 192  # ... and of the long ones (a request's context some hundred tokens in)
PROBE_LONG_BATCH = 8  # the largest batch measured at two contexts (the long ones' prefill is the probe's dearest call)
PROBE_CONTEXT_REPEATS = 5  # turns of those measurements
PROBE_SEQ_BASE = 1 << 62  # throwaway sequence ids: far above any request's
# what a cached table measured: 2 added the draft call's own part, 3 the context (an older table is measured afresh)
PROBE_VERSION = 3
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def costs_dir() -> Path:
    """``$SAGUARO_COSTS_DIR`` if set, else ``~/.cache/saguaro-ray/costs`` (beside the zoo's cache)."""
    env = os.environ.get("SAGUARO_COSTS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "saguaro-ray" / "costs"


def cost_identity(config: Any, runtime: str) -> dict[str, Any]:
    """What the step costs depend on: the machine, the runtime, each role's model and runner
    options (device, dtype, attention, graphs, a draft's head), threads and drafts. Any
    difference is another cache entry (``config``: an :class:`EngineConfig`)."""
    roles = {"target": config.target, "draft": config.draft, "qualifier": config.qualifier}
    gpu = None
    if str(config.device).startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "machine": [platform.node(), platform.machine(), platform.processor(), os.cpu_count(), gpu],
        "runtime": runtime,
        "models": {role: repr(spec) for role, spec in roles.items() if spec is not None},
        "runner": {role: config.role_runner_options(role) for role, spec in roles.items() if spec is not None},
        "threads": config.threads_per_worker,
        "num_drafts": config.num_drafts,
        "target_tp": config.target_tp,
        "max_k": config.spec.k_max,
        "max_batch": config.max_batch_size,
        "probe": PROBE_VERSION,
    }


def cost_path(identity: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=repr).encode()).hexdigest()[:20]
    return costs_dir() / f"{digest}.json"


def seed_auto(loop: "RoundLoop", identity: Mapping[str, Any], max_batch: int, kv_tokens: int) -> StepCosts | None:
    """Seed ``loop``'s ``auto`` policy with this machine's step costs: the cached table for
    ``identity``, else a fresh measurement (then cached; ``kv_tokens``: what each worker's KV
    holds, of which the probe's sequences take at most a quarter). None when there is nothing to
    seed (no auto policy, no draft: auto can only run AR) or the probe failed."""
    policy = loop.assigner.policy
    if not isinstance(policy, AutoPolicy) or not loop.draft_up or policy.modes == frozenset({"ar"}):
        return None
    path = cost_path(identity)
    costs = _read(path)
    if costs is None:
        try:
            started = time.perf_counter()
            costs = measure(loop, max_batch, policy.max_k, kv_tokens)
            log.info("auto: step costs measured in %.1f s (%s)", time.perf_counter() - started, path)
        except ConfigError as e:  # an engine too small for the probe's sequences
            log.info("auto: no step-cost probe (%s); auto starts from its cold-start schedule", e)
            return None
        except Exception as e:  # noqa: BLE001 — best effort: the policy's cold start serves without it
            log.warning("auto: step-cost probe failed (%r); auto starts from its cold-start schedule", e)
            return None
        _write(path, costs, identity)
    policy.seed(costs)
    return costs


def _read(path: Path) -> StepCosts | None:
    try:
        return StepCosts.from_json(json.loads(path.read_text())["costs"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None  # absent or unreadable: measured afresh


def _write(path: Path, costs: StepCosts, identity: Mapping[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"identity": identity, "costs": costs.to_json()}, default=repr, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old table or the new, never half
    except OSError as e:
        log.warning("auto: could not cache step costs at %s (%r)", path, e)


class _Probe:
    """Throwaway sequences on the loop's workers, stepped as the round loop steps real ones."""

    def __init__(self, loop: "RoundLoop", first_id: int, n: int, prompt: int = PROBE_PROMPT) -> None:
        self.loop = loop
        self.prompt = prompt
        self.ids = [first_id + i for i in range(n)]
        self.tokens = {s: [1 + (7 * s + 3 * j) % 61 for j in range(prompt)] for s in self.ids}
        self.rounds = {s: 0 for s in self.ids}

    def step(self, s: int, full: bool = False) -> SeqStep:
        ids = self.tokens[s]
        committed = len(ids) - 1 if self.rounds[s] and not full else 0
        recent = ids[max(0, committed - RECENT_TOKENS) : committed]
        return SeqStep(s, committed, ids[committed:], _GREEDY, 0, len(ids) - self.prompt, recent, self.prompt)

    def context(self, seqs: Sequence[int]) -> int:
        """The tokens ``seqs`` hold, on average: what each of their rows attends."""
        return max(1, round(sum(len(self.tokens[s]) for s in seqs) / len(seqs)))

    def admit(self) -> None:
        """Every sequence's prompt onto the target: its first decode."""
        self.verify(self.ids, 0)

    def prefill(self) -> None:
        """Every sequence's prompt onto the draft: it holds every prompt token but the last,
        as after a round."""
        self.timed(self.loop.drafts.primary, "prefill", lambda full: ([self.step(s, full) for s in self.ids],))
        for s in self.ids:
            self.rounds[s] = 1

    def timed(self, worker: Any, method: str, args: Callable[[bool], tuple]) -> tuple[Any, float]:
        value, (start, end) = RetryingCall(worker, method, args).value()
        return value, end - start

    def verify(self, seqs: Sequence[int], k: int) -> float:
        """One target call verifying ``k`` tokens for each of ``seqs``; the outcome is kept."""
        props = {s: Proposal([1 + (self.tokens[s][-1] + j) % 61 for j in range(k)], None, ProposalSource.DRAFT) for s in seqs}
        outcomes, seconds = self.timed(self.loop.target, "verify", lambda full: ([VerifyItem(self.step(s, full), props[s]) for s in seqs],))
        for s, out in zip(seqs, outcomes):
            self.tokens[s] += out.emitted(props[s])
            self.rounds[s] += 1
        return seconds

    def propose(self, seqs: Sequence[int], k: int) -> float:
        """``k`` sequential draft steps for each of ``seqs``, taken as accepted."""
        draft = self.loop.drafts.primary
        props, seconds = self.timed(draft, "propose", lambda full: ([self.step(s, full) for s in seqs], [k] * len(seqs)))
        for s, p in zip(seqs, props):
            self.tokens[s] += p.tokens
            self.rounds[s] += 1
        return seconds

    def release(self) -> None:
        for w in (self.loop.target, *self.loop.drafts.up()):
            try:
                RetryingCall(w, "release", lambda full: (self.ids,)).value()
            except Exception as e:  # noqa: BLE001 — a worker that cannot release them is restarted empty anyway
                log.debug("auto: releasing the probe's sequences on %s failed: %r", getattr(w, "name", w), e)


def _per_step(one: float, many: float, max_k: int) -> float:
    """A call's cost per step from calls of 1 and ``max_k`` steps (their own part is in both)."""
    return max(0.0, (many - one) / (max_k - 1)) if max_k > 1 else one


def _build(loop: "RoundLoop", probe: _Probe, seqs: Sequence[int], k_next: int) -> float:
    """One SSD tree build of ``k_next`` steps over ``seqs``' branches (the engine's ``budget``
    each), timed; every call rolls the draft back to the step's start, so the same items can
    be built again."""
    budget = max(1, loop.spec.budget)
    fanout = [budget // 2, budget - budget // 2]  # after a rejection of the one proposed token, after its acceptance

    def args(full: bool) -> tuple:
        items = [BuildItem(probe.step(s, full), Proposal([1 + probe.tokens[s][-1] % 61], None, ProposalSource.DRAFT), fanout, k_next) for s in seqs]
        return (items,)

    return probe.timed(loop.drafts.primary, "build", args)[1]


class _Rows:
    """The measured rows of a :class:`StepCosts` table, as the probe collects them."""

    def __init__(self) -> None:
        self.verify: list[tuple[int, int, int, float]] = []
        self.draft: list[tuple[int, int, float]] = []
        self.build: list[tuple[int, int, float]] = []
        self.calls: list[tuple[int, float]] = []

    def table(self) -> StepCosts:
        return StepCosts(tuple(self.verify), tuple(self.draft), tuple(self.build), tuple(self.calls))


def _at_every_batch(loop: "RoundLoop", rows: _Rows, batches: Sequence[int], ks: Sequence[int], max_k: int) -> None:
    """Verifications at each K of ``ks``, draft steps, draft calls' own parts and build steps
    at each of ``batches``, on short sequences. A tree step over n sequences' branches costs
    at least a draft step over them, as the policy's build model has it."""
    n = batches[-1]
    target, draft = _Probe(loop, PROBE_SEQ_BASE, n), _Probe(loop, PROBE_SEQ_BASE + n, n)
    try:
        target.admit()  # the whole prompt (and any warm-up of the worker)
        draft.prefill()
        draft.propose(draft.ids, 1)  # warm-up
        for b in batches:
            for k in ks:
                context = target.context(target.ids[:b])
                rows.verify.append((b * (k + 1), b, context, min(target.verify(target.ids[:b], k) for _ in range(PROBE_REPEATS))))
        steps = {}
        for b in batches:
            context = draft.context(draft.ids[:b])
            one = min(draft.propose(draft.ids[:b], 1) for _ in range(PROBE_REPEATS))
            many = min(draft.propose(draft.ids[:b], max_k) for _ in range(PROBE_REPEATS))
            steps[b] = _per_step(one, many, max_k)
            rows.draft.append((b, context, steps[b]))
            rows.calls.append((b, max(0.0, one - steps[b])))
        _build(loop, draft, draft.ids[:1], 1)  # warm-up
        for b in batches:
            context = draft.context(draft.ids[:b])
            one = min(_build(loop, draft, draft.ids[:b], 1) for _ in range(PROBE_REPEATS))
            many = min(_build(loop, draft, draft.ids[:b], max_k) for _ in range(PROBE_REPEATS))
            rows.build.append((b, context, max(_per_step(one, many, max_k), steps[b])))
    finally:
        target.release()
        draft.release()


def _at_two_contexts(loop: "RoundLoop", rows: _Rows, b: int, max_k: int) -> None:
    """Decodes, verifications of ``max_k`` + 1 tokens and draft steps over ``b`` sequences
    holding :data:`PROBE_PROMPT` and :data:`PROBE_LONG` tokens (a tree step's held tokens are
    priced as a draft step's), the two contexts' calls taking turns
    (:data:`PROBE_CONTEXT_REPEATS` each): the short context's time is its calls' median, the
    long one's that plus the median of the turns' differences, so a machine's drift slows both
    alike and a slow spell in one turn moves neither. (On 2 shared cores a verification of 72
    tokens took 313-432 ms over five turns at one context: a context's calls measured after
    the other's, or their least times, put the difference anywhere from -50 to +110 ms.)"""
    first = PROBE_SEQ_BASE + 2 * PROBE_BATCHES[-1]
    probes = {
        (role, prompt): _Probe(loop, first + 2 * b * i + b * (role == "draft"), b, prompt)
        for i, prompt in enumerate((PROBE_PROMPT, PROBE_LONG))
        for role in ("target", "draft")
    }
    try:
        for (role, _), probe in probes.items():
            if role == "target":
                probe.admit()
            else:
                probe.prefill()
                probe.propose(probe.ids, 1)  # warm-up

        def turns(call: Callable[[_Probe], float], role: str) -> dict[int, tuple[int, float]]:
            """Per context: the tokens its sequences held at the first call, and its time."""
            held = {prompt: probes[(role, prompt)].context(probes[(role, prompt)].ids) for prompt in (PROBE_PROMPT, PROBE_LONG)}
            pairs = [tuple(call(probes[(role, prompt)]) for prompt in (PROBE_PROMPT, PROBE_LONG)) for _ in range(PROBE_CONTEXT_REPEATS)]
            short = statistics.median(s for s, _ in pairs)
            return {PROBE_PROMPT: (held[PROBE_PROMPT], short), PROBE_LONG: (held[PROBE_LONG], short + statistics.median(l - s for s, l in pairs))}

        for k in sorted({0, max_k}):
            for held, seconds in turns(lambda p: p.verify(p.ids, k), "target").values():
                rows.verify.append((b * (k + 1), b, held, seconds))
        one, many = turns(lambda p: p.propose(p.ids, 1), "draft"), turns(lambda p: p.propose(p.ids, max_k), "draft")
        for prompt in (PROBE_PROMPT, PROBE_LONG):
            rows.draft.append((b, one[prompt][0], _per_step(one[prompt][1], many[prompt][1], max_k)))
    finally:
        for probe in probes.values():
            probe.release()


def measure(loop: "RoundLoop", max_batch: int, max_k: int, kv_tokens: int) -> StepCosts:
    """Time the target's and the primary draft's steps (module docstring) on throwaway sequences:
    at every batch on short sequences, then at two contexts for one batch (skipped where the
    engine's context or KV has no room for the long ones)."""
    ks = sorted({0, 1, max(1, max_k // 2), max_k})
    batches = [b for b in PROBE_BATCHES if b <= max(1, max_batch)]

    def need(prompt: int, kinds: Sequence[int], count: int, repeats: int) -> int:  # the first sequence's context, the longest
        return prompt + 1 + count * repeats * sum(k + 1 for k in kinds)

    short = need(PROBE_PROMPT, ks, len(batches), PROBE_REPEATS)
    batches = [b for b in batches if b * short <= kv_tokens // 4]
    if short > loop.max_context or not batches:
        raise ConfigError(f"the probe's sequences need {short} tokens of context each; this engine has {loop.max_context}, KV {kv_tokens}")
    rows = _Rows()
    _at_every_batch(loop, rows, batches, ks, max_k)
    b = max(x for x in batches if x <= PROBE_LONG_BATCH)
    long = need(PROBE_LONG, sorted({0, max_k}), 1, PROBE_CONTEXT_REPEATS)
    if long <= loop.max_context and b * (long + need(PROBE_PROMPT, sorted({0, max_k}), 1, PROBE_CONTEXT_REPEATS)) <= kv_tokens // 4:
        _at_two_contexts(loop, rows, b, max_k)
    return rows.table()
