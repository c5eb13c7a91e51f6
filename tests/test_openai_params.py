"""SamplingParams' OpenAI fields (issue 21): validated once, in config, with a
one-line ConfigError naming the field, and carried over the wire unchanged."""

import os

import pytest

from saguaro_ray.config import ResponseFormat, SamplingParams
from saguaro_ray.errors import ConfigError
from saguaro_ray.runtime.wire import FrameCodec


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs_mode": "sampled"}, "logprobs_mode"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "not json"}}}, "response_format"),
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format"),
    ],
)
def test_invalid_fields_are_refused_naming_them(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        SamplingParams(**kwargs)
    assert "\n" not in str(e.value)


def test_openai_shapes_are_normalised():
    p = SamplingParams(logit_bias={"50": 2, 7: -100}, response_format={"type": "text"})
    assert p.logit_bias == ((7, -100.0), (50, 2.0))
    assert p.response_format is None and p.adjusts_logits
    assert not SamplingParams(response_format={"type": "text"}).adjusts_logits
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert p.response_format == ResponseFormat("json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}')  # key order kept
    assert p.adjusts_logits and not p.penalized
    assert SamplingParams(repetition_penalty=1.2).penalized


def test_fields_cross_the_wire():
    codec = FrameCodec(os.urandom(32))
    p = SamplingParams(
        logprobs=3, logprobs_mode="processed", presence_penalty=0.5, frequency_penalty=-0.25,
        repetition_penalty=1.1, logit_bias={5: 2}, response_format={"type": "json_object"},
    )
    assert codec.decode(codec.encode(p)) == p
