"""What ``auto`` knows of the machine before a request: step costs measured on the engine's workers.

At engine start (issue 33) the round loop's own workers run a few real steps on throwaway
sequences — target calls of K + 1 tokens per sequence at batch 1, 2, 4, 8 (decode is K = 0), and
draft calls of 1 and ``max_k`` sequential steps at the same batches, and SSD tree builds of 1 and
``max_k`` steps over the engine's ``budget`` branches per sequence — timed by the worker's own
span, as a round's are. :meth:`~saguaro_ray.algorithms.strategy_model.AutoPolicy.seed` starts the
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
PROBE_SEQ_BASE = 1 << 62  # throwaway sequence ids: far above any request's
PROBE_VERSION = 2  # what a cached table measured: 2 added the draft call's own part (an older table is measured afresh)
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

    def __init__(self, loop: "RoundLoop", first_id: int, n: int) -> None:
        self.loop = loop
        self.ids = [first_id + i for i in range(n)]
        self.tokens = {s: [1 + (7 * s + 3 * j) % 61 for j in range(PROBE_PROMPT)] for s in self.ids}
        self.rounds = {s: 0 for s in self.ids}

    def step(self, s: int, full: bool = False) -> SeqStep:
        ids = self.tokens[s]
        committed = len(ids) - 1 if self.rounds[s] and not full else 0
        recent = ids[max(0, committed - RECENT_TOKENS) : committed]
        return SeqStep(s, committed, ids[committed:], _GREEDY, 0, len(ids) - PROBE_PROMPT, recent, PROBE_PROMPT)

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


def _build_steps(loop: "RoundLoop", probe: _Probe, batches: Sequence[int], max_k: int, draft_step: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    """One step of SSD's tree build over n sequences' branches (the engine's ``budget`` each),
    for n in ``batches``: builds of 1 and ``max_k`` steps from the same state (every call rolls
    the draft back to the step's start, so the same items can be built again), their
    difference per step — at least a draft step over as many sequences, as the policy's
    build model has it."""
    budget = max(1, loop.spec.budget)
    fanout = [budget // 2, budget - budget // 2]  # after a rejection of the one proposed token, after its acceptance

    def build(seqs: Sequence[int], k_next: int) -> float:
        def args(full: bool) -> tuple:
            items = [BuildItem(probe.step(s, full), Proposal([1 + probe.tokens[s][-1] % 61], None, ProposalSource.DRAFT), fanout, k_next) for s in seqs]
            return (items,)

        return probe.timed(loop.drafts.primary, "build", args)[1]

    out = []
    build(probe.ids[:1], 1)  # warm-up
    for b in batches:
        one = min(build(probe.ids[:b], 1) for _ in range(PROBE_REPEATS))
        many = min(build(probe.ids[:b], max_k) for _ in range(PROBE_REPEATS))
        step = (many - one) / (max_k - 1) if max_k > 1 else one
        out.append((b, max(step, draft_step.get(b, 0.0))))
    return tuple(out)


def measure(loop: "RoundLoop", max_batch: int, max_k: int, kv_tokens: int) -> StepCosts:
    """Time the target's and the primary draft's steps (module docstring) on throwaway sequences."""
    ks = sorted({0, 1, max(1, max_k // 2), max_k})
    batches = [b for b in PROBE_BATCHES if b <= max(1, max_batch)]
    need = PROBE_PROMPT + 1 + len(batches) * PROBE_REPEATS * sum(k + 1 for k in ks)  # the first sequence's, the longest
    batches = [b for b in batches if b * need <= kv_tokens // 4]
    if need > loop.max_context or not batches:
        raise ConfigError(f"the probe's sequences need {need} tokens of context each; this engine has {loop.max_context}, KV {kv_tokens}")
    n = batches[-1]
    target = _Probe(loop, PROBE_SEQ_BASE, n)
    draft = _Probe(loop, PROBE_SEQ_BASE + n, n)
    try:
        target.verify(target.ids, 0)  # admission: the whole prompt (and any warm-up of the worker)
        draft.timed(loop.drafts.primary, "prefill", lambda full: ([draft.step(s, full) for s in draft.ids],))
        for s in draft.ids:  # the draft holds every prompt token but the last, as after a round
            draft.rounds[s] = 1
        draft.propose(draft.ids, 1)  # warm-up
        verify = tuple(
            (b * (k + 1), b, min(target.verify(target.ids[:b], k) for _ in range(PROBE_REPEATS))) for b in batches for k in ks
        )
        steps, calls = [], []
        for b in batches:
            one = min(draft.propose(draft.ids[:b], 1) for _ in range(PROBE_REPEATS))
            many = min(draft.propose(draft.ids[:b], max_k) for _ in range(PROBE_REPEATS))
            # the call's own part (feeding the pending token, the first draw) is in both; a step is the rest
            step = max(0.0, (many - one) / (max_k - 1)) if max_k > 1 else one
            steps.append((b, step))
            calls.append((b, max(0.0, one - step)))
        return StepCosts(verify, tuple(steps), _build_steps(loop, draft, batches, max_k, dict(steps)), tuple(calls))
    finally:
        target.release()
        draft.release()
