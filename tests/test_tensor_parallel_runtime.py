"""A tensor-parallel target in the Ray engine (CPU, gloo): same tokens, same recovery.

The target runs as two rank actors; AR and SSD must emit exactly the tokens
the unsharded target emits, and killing a follower rank mid-stream must
restart the whole group, re-prefill, and still complete with identical
tokens. One Ray instance for the module; the zoo ``tiny`` family.
"""

from __future__ import annotations

import os
import signal

import pytest

from saguaro_ray import Engine, EngineConfig, SamplingParams, SpeculationConfig
from saguaro_ray.engine.transport import WorkerGone
from saguaro_ray.errors import ConfigError

PROMPTS = [[3, 5, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8], [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MODES = {"ar": SpeculationConfig(mode="ar"), "ssd": SpeculationConfig(mode="ssd", k=3, budget=4)}


def _config(zoo_tiny, mode: str, tp: int, **kw) -> EngineConfig:
    return EngineConfig(
        target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), spec=MODES[mode], target_tp=tp, address="local", **kw
    )


def _generate(config: EngineConfig) -> list[list[int]]:
    handle = Engine.launch(config)
    try:
        return [r.token_ids for r in handle.generate(PROMPTS, GREEDY)]
    finally:
        handle.shutdown()


@pytest.fixture(scope="module")
def reference(ray_instance, zoo_tiny):
    """The unsharded target's greedy tokens (AR; SSD must agree: exactness)."""
    tokens = _generate(_config(zoo_tiny, "ar", 1))
    assert _generate(_config(zoo_tiny, "ssd", 1)) == tokens
    return tokens


def test_ar_with_two_target_ranks_emits_the_same_tokens(reference, zoo_tiny):
    assert _generate(_config(zoo_tiny, "ar", 2)) == reference


def test_ssd_with_two_target_ranks_survives_losing_a_follower(reference, zoo_tiny):
    handle = Engine.launch(_config(zoo_tiny, "ssd", 2))
    try:
        info = handle.worker_info()["target"]
        assert [r["tp_rank"] for r in info["ranks"]] == [0, 1]
        assert len({r["node_id"] for r in info["ranks"]}) == 1  # STRICT_PACK
        assert [r.token_ids for r in handle.generate(PROMPTS, GREEDY)] == reference

        follower = info["ranks"][1]["pid"]
        tokens = []
        for i, chunk in enumerate(handle.stream(PROMPTS[0], GREEDY)):
            tokens += chunk.token_ids
            if i == 2:
                os.kill(follower, signal.SIGKILL)
        assert tokens == reference[0]
        assert handle.metrics()["restarts"]["target"] == 1
        ranks = handle.worker_info()["target"]["ranks"]
        assert ranks[1]["pid"] != follower and ranks[1]["following"]
        assert [r.token_ids for r in handle.generate(PROMPTS, GREEDY)] == reference
    finally:
        handle.shutdown()


def test_a_degree_the_model_cannot_split_is_refused_before_launch(ray_instance, zoo_tiny):
    with pytest.raises(ConfigError, match="not divisible by target_tp=3"):
        Engine.launch(_config(zoo_tiny, "ar", 3))


def test_losing_a_rank_with_no_restarts_left_fails_with_a_clear_error(ray_instance, zoo_tiny):
    handle = Engine.launch(_config(zoo_tiny, "ar", 2, max_restarts=0))
    try:
        follower = handle.worker_info()["target"]["ranks"][1]["pid"]
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        with pytest.raises(WorkerGone, match="target"):
            for i, _ in enumerate(handle.stream(PROMPTS[0], params)):
                if i == 1:
                    os.kill(follower, signal.SIGKILL)
    finally:
        handle.shutdown()


@pytest.mark.parametrize("tp, match", [(0, "target_tp must be a positive integer"), (True, "target_tp"), (1.5, "target_tp")])
def test_target_tp_is_validated(tp, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(target="t", target_tp=tp)
    with pytest.raises(ConfigError, match="target_placement_strategy"):
        EngineConfig(target="t", target_tp=2, target_placement_strategy="NEAR")


def test_the_cli_and_the_generate_job_take_target_tp(capsys):
    from saguaro_ray.cli import build_parser, main
    from saguaro_ray.jobs.generate import build_parser as job_parser

    assert build_parser().parse_args(["generate", "--target", "t", "--prompt", "x", "--target-tp", "2"]).target_tp == 2
    assert build_parser().parse_args(["bench", "--target-tp", "4"]).target_tp == 4
    job = job_parser().parse_args(["--input", "i", "--output", "o", "--target-tp", "2"])
    assert (job.target_tp, job.target_placement_strategy) == (2, "STRICT_PACK")
    assert main(["generate", "--target", "t", "--prompt", "x", "--in-process", "--target-tp", "2"]) != 0
    assert "--target-tp needs the Ray runtime" in capsys.readouterr().err
