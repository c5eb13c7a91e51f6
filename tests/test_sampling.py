"""The processed target law and the samplers every mode shares."""

import pytest
import torch

from saguaro_ray.algorithms.sampling import (
    STREAM_QUALIFIER,
    STREAM_TARGET,
    argmax_lowest,
    position_uniforms,
    process_logits,
    sample_from,
)
from saguaro_ray.config import SamplingParams
from saguaro_ray.errors import ConfigError


def test_greedy_is_one_hot_on_lowest_tied_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    p = process_logits(logits, [0.0, 0.0])
    assert torch.equal(p, torch.tensor([[0.0, 1, 0, 0], [1.0, 0, 0, 0]]))
    assert argmax_lowest(logits).tolist() == [1, 0]


def test_temperature_only_is_tempered_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    p = process_logits(logits, [0.5, 1.0, 2.0])
    for row, t in enumerate([0.5, 1.0, 2.0]):
        assert torch.allclose(p[row], torch.softmax(logits[row] / t, -1), atol=1e-7)


def test_top_k_breaks_ties_by_lowest_id():
    logits = torch.tensor([[2.0, 1.0, 2.0, 2.0, 0.0]])
    p = process_logits(logits, [1.0], top_k=[2])
    assert (p[0] > 0).tolist() == [True, False, True, False, False]
    assert torch.allclose(p[0, [0, 2]], torch.tensor([0.5, 0.5]))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = process_logits(probs.log(), [1.0], top_p=[0.8])
    # 0.5 < 0.8 so the second token is needed; mass before the third is 0.8, not < 0.8
    assert (p[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p[0, :2], torch.tensor([0.5, 0.3]) / 0.8)
    # always keeps at least the top token
    p = process_logits(probs.log(), [1.0], top_p=[0.1])
    assert (p[0] > 0).tolist() == [True, False, False, False]


def test_rows_have_independent_settings():
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    p = process_logits(logits, [0.0, 1.0], top_k=[0, 3], top_p=[1.0, 1.0])
    assert p[0].max() == 1 and int((p[1] > 0).sum()) == 3
    assert torch.allclose(p.sum(-1), torch.ones(2))


def test_inverse_cdf_sampler_hits_the_law_on_a_uniform_grid():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    n = 1000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    draws = sample_from(probs.expand(n, -1), u)
    counts = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(counts, probs.double(), atol=1.5 / n)
    assert counts[1] == 0


def test_sampler_never_returns_zero_mass_tokens_at_the_edges():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 3)
    draws = sample_from(probs, torch.tensor([0.0, 1.0 - 1e-16, 0.999999999]))
    assert set(draws.tolist()) <= {1, 2}


def test_position_streams_are_deterministic_and_separate():
    a = position_uniforms([7, 7], [3, 4], 2)
    b = position_uniforms([7, 7], [3, 4], 2)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])
    qualifier = position_uniforms([7], [3], 2, stream=STREAM_QUALIFIER)
    assert not torch.equal(qualifier[0], position_uniforms([7], [3], 2, stream=STREAM_TARGET)[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"seed": -3},
    ],
)
def test_invalid_sampling_params_are_refused(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)
