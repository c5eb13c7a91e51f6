"""``saguaro-ray demo``: a real model, every mode side by side.

The default, ``--family coder``, runs the Qwen2.5-Coder pair: the
1.5B instruct model as the target, drafted by its small sibling, the 0.5B,
quantised to int4 at load; PyramidSD adds the 1.5B's own int4 copy as the
qualifier (0.5B int4 → 1.5B int4 → 1.5B). It answers a few code requests
rendered through the model's chat template. One engine (one target copy)
serves every mode as a per-request strategy — ``ar``, ``sd``, ``ssd``,
``pyramid`` and ``auto``, which picks K and SD or SSD itself each round — on
the same prompts at temperature 0, as Ray actors on the embedded local Ray
instance (or in process with ``--in-process``). It prints one answer, then
throughput, speedup over AR, mean accepted length, cache hit rate and whether
each mode's tokens equal AR's (they must: exactness is the contract), and
what ``auto`` chose. ``--family smollm2`` runs SmolLM2-135M-Instruct
with drafts made from it (its own int4 / int8 copies), ``--family zoo:tiny`` the
built-in trained family.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from saguaro_ray.bench.plan import in_turn
from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine.sequence import strategy_totals
from saguaro_ray.errors import ConfigError

# Requests the demo runs at once. One: each request alone, the latency regime
# speculation is for (on the real family, 2 cores, fp32: SD and SSD 1.6-1.8x AR
# at batch 1; at batch 4 every mode was within noise of AR — 62-64 tok/s each —
# since a verification of 4 x 5 tokens costs what 4 AR steps do on a CPU).
DEFAULT_BATCH = 1

@dataclass(frozen=True)
class Family:
    """A named model set for the demo and how it is run by default."""

    models: dict[str, str]  # target, draft, qualifier (PyramidSD: draft → qualifier → target)
    requests: tuple[str, ...]  # user messages, rendered through the target's chat template
    prompts: int  # how many requests
    max_tokens: int
    # SSD's fan-out ceiling: the build must not outlast verification. A
    # self-draft of SmolLM2 costs about half a target step on a CPU (4 prompts
    # x 64 tokens, Ray: budget 8 gave SSD 0.63x AR at a 96% hit rate, budget 2
    # 1.19x); on the Qwen pair SSD K=4 budget 2 gave 2.75x AR (issue 32).
    budget: int
    # EngineConfig fields (the dtype every worker loads in, a draft's reduced head)
    engine: dict[str, Any] = field(default_factory=dict)


CODE_REQUESTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that returns the n-th Fibonacci number, iteratively.",
    "Write a Python function that counts how often each word occurs in a text.",
)
# two code requests, two prose ones
CHAT_REQUESTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in three sentences.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Give me three tips for writing clear emails.",
)

# The default is sized for 2 CPU cores: the 1.5B decodes ~3 tokens/s on one
# thread, so 3 requests x 48 tokens keep every mode's run well under a minute.
FAMILIES = {
    "coder": Family(
        {"target": "real:qwen2.5-coder-1.5b-instruct", "draft": "int4:real:qwen2.5-coder-0.5b-instruct", "qualifier": "self:int4"},
        CODE_REQUESTS, prompts=3, max_tokens=48, budget=2,
        # bf16: the 1.5B as converted (fp32 would read twice the bytes and need
        # ~14 GB in the target's worker while packing); a 32k-id draft head cuts
        # the int4 0.5B's step by a third (docs/performance.md, the Qwen pair);
        # a KV cache of 4096 tokens a worker (the default 32k costs a 1.5B
        # ~0.9 GB it never uses here: on a 23 GB VM shared with other work,
        # Ray's memory monitor killed the demo's workers at the default)
        engine={"dtype": "bfloat16", "draft_vocab": 32768, "max_kv_tokens": 4096},
    ),
    "smollm2": Family(
        {"target": "real:smollm2-135m-instruct", "draft": "self:int4", "qualifier": "self:int8"},
        CHAT_REQUESTS, prompts=4, max_tokens=64, budget=2,
    ),
}
DEFAULT_FAMILY = "coder"  # a real target with its real small sibling: the setting SSD is for
ZOO_BUDGET = 8  # the zoo's draft is ~10x cheaper than its target: a wide fan-out pays


# The demo's rows, in order: each a request strategy on the one engine.
DEMO_MODES = ("ar", "sd", "ssd", "pyramid", "auto")


@dataclass
class DemoRow:
    mode: str
    tokens: int
    seconds: float
    mean_accepted: float | None
    cache_hit_rate: float | None
    same_as_ar: bool
    strategy: dict[str, int]  # mode → rounds its requests ran in it (what auto chose)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def get_family(family: str) -> Family:
    """A name of :data:`FAMILIES`, or ``zoo:<preset>`` (that zoo family's three
    roles on its held-out source); anything else is one :class:`ConfigError`."""
    if family in FAMILIES:
        return FAMILIES[family]
    if family.startswith("zoo:") and "/" not in family and len(family) > 4:
        preset = family.removeprefix("zoo:")
        models = {role: f"zoo:{preset}/{role}" for role in ("target", "draft", "qualifier")}
        return Family(models, (), prompts=4, max_tokens=64, budget=ZOO_BUDGET)
    known = ", ".join([*FAMILIES, "zoo:tiny", "zoo:small"])
    raise ConfigError(f"unknown demo family {family!r}: expected one of {known}")


def family_models(family: str) -> dict[str, str]:
    """The family's target, draft and qualifier specs."""
    return dict(get_family(family).models)


def demo_prompts(family: Family, count: int) -> list[str]:
    """``count`` of the family's requests through the target's chat template
    (a zoo family: its held-out source, which it was trained to continue)."""
    from saguaro_ray.prompt_sets import load_prompts
    from saguaro_ray.serve.chat import render_chat
    from saguaro_ray.tokenizer import load_tokenizer
    from saguaro_ray.models.resolve import resolve_model_path

    if not family.requests:
        return load_prompts("code", count, chars=160)
    tokenizer = load_tokenizer(resolve_model_path(family.models["target"]))
    requests = family.requests
    return [render_chat(tokenizer, [{"role": "user", "content": requests[i % len(requests)]}]) for i in range(count)]


def _engine(spec: SpeculationConfig, family: Family, threads: int, in_process: bool, address: str) -> tuple[Any, Any]:
    """An engine for ``spec`` on the family's models and its close function."""
    from saguaro_ray.runtime.engine_config import EngineConfig

    config = EngineConfig(**family.models, **family.engine, spec=spec, threads_per_worker=threads, address=address)
    if in_process:
        from saguaro_ray.engine import LocalEngine

        engine = LocalEngine(config)
        return engine, engine.close
    from saguaro_ray.runtime.engine import Engine

    handle = Engine.launch(config)
    return handle, handle.shutdown


def run_demo(
    family: str = DEFAULT_FAMILY,
    prompts: int | None = None,
    max_tokens: int | None = None,
    k: int = 4,
    budget: int | None = None,
    threads: int = 1,
    in_process: bool = False,
    address: str = "local",
    batch: int = DEFAULT_BATCH,
) -> tuple[list[DemoRow], str, str]:
    """Generate with every mode of :data:`DEMO_MODES` on one engine (Ray
    actors by default, on an embedded local Ray instance unless ``address``
    names a cluster), ``batch`` requests at a time: one row per mode, the
    first prompt and AR's answer to it. ``prompts``, ``max_tokens`` and
    ``budget`` default to the family's.

    The modes take turns: every batch of prompts is generated by each mode in
    a rotating order before the next batch starts. Run one mode after
    another, the last row also carried how the machine had drifted by then (a
    shared 2-core VM's speed moved 10-20 % within one demo; docs/auto.md);
    taking turns charges drift, and whatever one request leaves behind for
    the next, to every mode alike."""
    if batch < 1:
        raise ConfigError(f"the demo's batch must be at least 1, got {batch}")
    fam = get_family(family)
    prompts = fam.prompts if prompts is None else prompts
    max_tokens = fam.max_tokens if max_tokens is None else max_tokens
    budget = fam.budget if budget is None else budget
    texts = demo_prompts(fam, prompts)
    spec = SpeculationConfig(mode="auto", k=k, budget=budget, lq=k, ld=2)
    batches = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    seconds = dict.fromkeys(DEMO_MODES, 0.0)
    results: dict[str, list[Any]] = {mode: [] for mode in DEMO_MODES}
    engine, close = _engine(spec, fam, threads, in_process, address)
    try:
        for mode in DEMO_MODES:
            # warm-up at the timed batch size: the shared engine's first batch
            # of that size is not charged to whichever mode happens to run first
            engine.generate(batches[0], SamplingParams(temperature=0.0, max_tokens=4, speculation=mode))
        for j, chunk in enumerate(batches):
            for mode in in_turn(list(DEMO_MODES), j):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculation=mode)
                t0 = time.perf_counter()
                results[mode] += engine.generate(chunk, params)
                seconds[mode] += time.perf_counter() - t0
    finally:
        close()
    reference = [r.token_ids for r in results[DEMO_MODES[0]]]
    return [_row(mode, results[mode], seconds[mode], reference) for mode in DEMO_MODES], texts[0], results[DEMO_MODES[0]][0].text


def _row(mode: str, results: list[Any], seconds: float, reference: list[list[int]]) -> DemoRow:
    """One mode's row: its throughput, acceptance, hit rate, strategies, and whether it emitted AR's tokens."""
    tokens = [r.token_ids for r in results]
    acc = [r.stats["mean_accepted"] for r in results if r.stats["mean_accepted"] is not None]
    hits = [r.stats["cache_hit_rate"] for r in results if r.stats["cache_hit_rate"] is not None]
    strategy = strategy_totals([r.stats for r in results])[0]
    return DemoRow(
        mode=mode,
        tokens=sum(len(t) for t in tokens),
        seconds=seconds,
        mean_accepted=sum(acc) / len(acc) if acc else None,
        cache_hit_rate=sum(hits) / len(hits) if hits else None,
        same_as_ar=tokens == reference,
        strategy=strategy,
    )


def format_rows(rows: list[DemoRow]) -> str:
    """The side-by-side table, then what ``auto`` chose (its rounds per strategy)."""
    ar = rows[0].tokens_per_s
    lines = [f"{'mode':<8} {'tokens/s':>9} {'vs ar':>6} {'accepted':>9} {'hit rate':>9}  same tokens as ar"]
    for r in rows:
        acc = "-" if r.mean_accepted is None else f"{r.mean_accepted:.2f}"
        hit = "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.0%}"
        lines.append(f"{r.mode:<8} {r.tokens_per_s:>9.1f} {r.tokens_per_s / ar:>5.2f}x {acc:>9} {hit:>9}  {'yes' if r.same_as_ar else 'NO'}")
    for r in rows:
        if r.mode == "auto" and r.strategy:
            chose = ", ".join(f"{m} {n}" for m, n in sorted(r.strategy.items(), key=lambda kv: -kv[1]))
            lines.append(f"\nwhat auto chose, sequence-rounds per strategy: {chose}")
    return "\n".join(lines)
